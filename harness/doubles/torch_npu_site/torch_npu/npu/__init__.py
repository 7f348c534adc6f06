"""Stub of ``torch_npu.npu``, the device runtime API (no device behind it).

Every call that would touch the NPU runtime is recorded in ``runtime_calls`` so a
test can assert that a process never initialised the runtime (the API server must
not). ``TORCH_NPU_DOUBLE_DEVICES`` sets what ``device_count()`` reports (default 0,
so the double never makes a host look like an Ascend host by accident).
``TORCH_NPU_DOUBLE_MEMORY_MB`` sets the total memory ``mem_get_info`` reports.
``TORCH_NPU_DOUBLE_SOC`` (``A2``, default, or ``A3``) sets what ``get_soc_version()``
reports (``_backends.py``).

The device is per thread, as CANN's context is (``aclrtSetDevice`` binds the calling
thread): once a process has set a device, an event used on a thread that never set one is
refused (on the device it would query device 0's context, or none).

Streams and events follow torch_npu's API (``npu/streams.py``, ``npu/utils.py``):
``Stream``, ``Event``, ``current_stream``, ``default_stream``, ``set_stream`` and the
``stream(s)`` context manager. Work runs eagerly on the CPU, so they only keep track of
which stream is current; a wait on the host (``synchronize``) ends the in-flight count.

Importing this module also gives gloo process groups torch_npu's
``get_hccl_comm_name`` (``_hccl_names.py``), so the NPU device class resolves
communicator names in NPU-path mode.
"""

from __future__ import annotations

import os
import sys
import threading

from torch_npu import _syncs
from torch_npu.npu import _hccl_names  # noqa: F401  (gives gloo groups get_hccl_comm_name)
from torch_npu.npu._backends import get_soc_version  # noqa: F401  (torch_npu exports it here)

runtime_calls: list[str] = []
_current_device: int | None = None
_thread_device = threading.local()  # .index: the device this thread set
_allocated = 0


def _record(name: str) -> None:
    runtime_calls.append(name)


def device_count() -> int:
    # Counting devices does not create a context (aclrtGetDeviceCount); not recorded.
    return int(os.environ.get("TORCH_NPU_DOUBLE_DEVICES", "0"))


def is_available() -> bool:
    return device_count() > 0


def set_device(index) -> None:
    global _current_device
    _record("set_device")
    _current_device = int(getattr(index, "index", index) or 0)
    _thread_device.index = _current_device


def _thread_has_a_device(what: str) -> None:
    if _current_device is not None and getattr(_thread_device, "index", None) is None:
        raise RuntimeError(
            f"{what} on thread {threading.current_thread().name!r}, which never set a device: "
            "an NPU context is per thread (aclrtSetDevice); call torch_npu.npu.set_device on it first"
        )


def current_device() -> int:
    _record("current_device")
    return _current_device or 0


def synchronize(device=None) -> None:
    _record("synchronize")
    _host_waits("synchronize")


def mem_get_info(device=None) -> tuple[int, int]:
    _record("mem_get_info")
    total = int(os.environ.get("TORCH_NPU_DOUBLE_MEMORY_MB", "65536")) << 20
    return total - _allocated, total


def _device_memory_used(delta: int) -> None:
    """The double's graph pools are its device memory (``_graphs.py``)."""
    global _allocated
    _allocated += delta


def memory_allocated(device=None) -> int:
    _record("memory_allocated")
    return _allocated


def empty_cache() -> None:
    _record("empty_cache")


def get_device_name(device=None) -> str:
    _record("get_device_name")
    return "Ascend910B3 (contract double)"


def _host_waits(what: str) -> None:
    """The host waits for the device: a graph replay still waiting for its update would
    block it for ever (``_graphs.py``)."""
    graphs = sys.modules.get("torch_npu._graphs")
    if graphs is not None:
        graphs.refuse_while_a_replay_waits(what)
    _syncs.drained()


class Stream:
    """Work runs eagerly; what a stream keeps is the graph replays launched on it (``launched``)
    and, per other stream, how many of that stream's replays it has waited for
    (``wait_stream``): the double's graphs check an update's order against them."""

    def __init__(self, device=None, priority=0, **kwargs) -> None:
        _record("Stream")
        self.device_index = _current_device or 0
        self.priority = priority
        self.launched = 0
        self._waited: dict[int, int] = {}  # id(other stream) -> its launches when last waited for

    @property
    def device(self):
        import torch

        return torch.device("cpu")  # the double's tensors live on the CPU

    def wait_stream(self, other) -> None:
        self._waited[id(other)] = other.launched

    def waited_for(self, other) -> int:
        """How many of ``other``'s replays this stream's later work waits for."""
        return self._waited.get(id(other), 0)

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _host_waits("Stream.synchronize")


class Event:
    def __init__(self, *args, **kwargs) -> None:
        _record("Event")

    def record(self, stream=None) -> None:
        _thread_has_a_device("Event.record")

    def synchronize(self) -> None:
        _thread_has_a_device("Event.synchronize")
        _host_waits("Event.synchronize")

    def wait(self, stream=None) -> None:
        _thread_has_a_device("Event.wait")

    def query(self) -> bool:
        _thread_has_a_device("Event.query")
        return True

    def elapsed_time(self, end_event) -> float:
        return 0.0


_default_stream: Stream | None = None
_current_stream: Stream | None = None


def default_stream(device=None) -> Stream:
    global _default_stream
    _record("default_stream")
    if _default_stream is None:
        _default_stream = Stream()
    return _default_stream


def current_stream(device=None) -> Stream:
    _record("current_stream")
    return _current_stream if _current_stream is not None else default_stream(device)


def set_stream(stream) -> None:
    global _current_stream
    if stream is None:  # torch_npu: a no-op for None
        return
    _record("set_stream")
    _current_stream = stream


class StreamContext:
    """``torch_npu.npu.stream(s)``: ``s`` is the current stream inside the block (no-op for None)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self._previous: Stream | None = None

    def __enter__(self):
        global _current_stream
        if self.stream is not None:
            self._previous = _current_stream
            set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc) -> None:
        global _current_stream
        if self.stream is not None:
            _current_stream = self._previous


def stream(stream) -> StreamContext:
    return StreamContext(stream)
