"""Test-only: decode graphs that replay with the host arguments of their capture.

What torch_npu's per-replay update is for, shown by taking it away: each graph is still
updated before its replay (so the external events it waits for are recorded, as the
contract double requires), but with the fused attention's host lengths as they were when
the graph was captured, as a replay without an update would run them on the device. The
graph tests expect the tokens to change (tests/engine/test_graphs.py)."""

from __future__ import annotations

from contextlib import contextmanager


def freeze_graph_updates():
    """Patch this process's graph capture; returns the function that undoes it."""
    from vllm.ascend.graph import capture, host_params

    original_capture, original_replay = capture.capture, capture.AscendGraph.replay

    @contextmanager
    def frozen_capture(graph, pool, stream):
        with original_capture(graph, pool, stream):
            yield
        graph.frozen_args = host_params.latest()  # what the captured batch's builders published

    def frozen_replay(self):
        self._device.replay_graph(self.npu_graph, self.frozen_args)

    capture.capture, capture.AscendGraph.replay = frozen_capture, frozen_replay

    def restore() -> None:
        capture.capture, capture.AscendGraph.replay = original_capture, original_replay

    return restore
