"""What Model Runner V2's full-graph manager asks the platform for (hook patch
``v2-runner-capture-its-full-graphs-through-the-platform``): the graph object, the capture
context around all captures, and the capture of one graph.

``AscendGraph`` stands where upstream keeps a ``torch.cuda.CUDAGraph``: the manager only
captures it and calls ``replay()``, which here first updates the graph's fused-attention
tasks with the step's host arguments (``host_params.latest()``), through the device layer.
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager

from vllm.logger import init_logger

from vllm.ascend import device as ascend_device
from vllm.ascend.errors import AscendStartupError
from vllm.ascend.graph import host_params

logger = init_logger(__name__)


class AscendGraph:
    def __init__(self) -> None:
        self._device = ascend_device.current()
        self.npu_graph = self._device.new_graph()

    def replay(self) -> None:
        self._device.replay_graph(self.npu_graph, host_params.latest())

    def pool(self):
        return self.npu_graph.pool()


class _CaptureSession:
    """One graph-capture context: the stream its graphs are captured on (what upstream's
    manager reads back as ``context.stream``), timed for the start-up log, which counts the
    graphs the device layer captured meanwhile."""

    def __init__(self, stream, graphs_before: int) -> None:
        self.stream = stream
        self.graphs_before = graphs_before
        self.started = time.perf_counter()


@contextmanager
def capture_context(stream=None):
    """Around all of a manager's captures: capture on ``stream`` (a manager sharing another's
    capture stream) or a new side stream of this process's device (the NPU refuses the
    default stream), then return to the stream that was current. Capture errors CANN names
    by code become one line that says what to change."""
    device = ascend_device.current()
    previous = device.current_stream()
    stream = stream if stream is not None else device.stream()
    stream.wait_stream(previous)
    session = _CaptureSession(stream, device.graphs_captured)
    try:
        with device.stream_context(stream), capture_errors():
            yield session
    finally:
        previous.wait_stream(stream)
        graphs = device.graphs_captured - session.graphs_before
        if graphs:
            logger.info("Ascend graphs: %d captured in %.1f s", graphs, time.perf_counter() - session.started)


@contextmanager
def capture(graph: AscendGraph, pool, stream):
    """One graph's capture. The stream upstream names is vLLM's cached current stream, which
    does not follow this platform's stream changes: capture on the device's live current
    stream, the capture context's side stream."""
    device = ascend_device.current()
    with device.capture_graph(graph.npu_graph, pool, device.current_stream()):
        yield


# CANN runtime codes a capture runs into when it exhausts a device resource
# (ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, ACL_ERROR_RT_NO_EVENT_RESOURCE, ACL_ERROR_RT_NO_STREAM_RESOURCE)
_RESOURCE_ERRORS = {
    "207005": "a device resource could not be allocated (CANN 207005)",
    "207007": "the device ran out of events (CANN 207007)",
    "207008": "the device ran out of streams (CANN 207008)",
}
_CODE = re.compile(r"\b(20700[578])\b")


@contextmanager
def capture_errors():
    try:
        yield
    except RuntimeError as e:
        found = _CODE.search(str(e))
        if found is None:
            raise
        raise AscendStartupError(
            f"ACL graph capture failed: {_RESOURCE_ERRORS[found.group(1)]}: capture fewer graphs "
            "(a smaller -cc.max_decode_cudagraph_capture_requests, or fewer request counts in "
            "-cc.decode_cudagraph_capture_request_sizes) or run without graphs (--enforce-eager)"
        ) from e
