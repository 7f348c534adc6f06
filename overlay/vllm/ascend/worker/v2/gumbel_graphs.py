"""The Gumbel-max sampler of a random batch replayed from NPU graphs, one per request count
the decode graphs are captured for.

Upstream's ``gumbel_sample`` is two Triton launches on CUDA. Its torch form on Ascend
(``gumbel.py``) hashes a noise value for every vocabulary entry of every row in some 140
device ops, each a host dispatch and a kernel launch. Captured once per size, a step pays
for five copies into the graph's inputs, one replay and one copy out. The graph's inputs
are buffers this object owns: the logits (float32, as the form reads them), the rows'
request slots, their positions, and the temperatures and seeds, which the sampling states
upload into a rotating set of buffers each step (their addresses change, so the graph
reads copies). Rows beyond the step's, up to the captured size, get request slot -1:
the form samples them greedily and nothing reads them.

What is captured is exactly what runs eagerly (the same form, the same arguments but the
row count), so the tokens are the eager tokens for any seed; ``tests/engine/test_graphs.py``
holds them equal. Captured right after the decode graphs, and like them once in the
memory profile, where what they take is measured, added to the graph-memory estimate that
comes off the KV cache's share, and dropped; the float32 logits buffer (largest captured
size x vocabulary) exists from the start and is in the profile. NPU-unverified: passes the
contract double's graph checks (no host read, no default-stream capture, replay on
captured memory).
"""

from __future__ import annotations

import bisect

import torch

from vllm.logger import init_logger
from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

from vllm.ascend import device as ascend_device
from vllm.ascend.graph import capture as graph_capture

logger = init_logger(__name__)


class GumbelGraphs:
    def __init__(
        self,
        sizes: list[int],
        vocab_size: int,
        max_num_reqs: int,
        use_fp64: bool,
        device: torch.device,
    ) -> None:
        self.sizes = sorted({s for s in sizes if s > 0})
        self._use_fp64 = use_fp64
        rows = self.sizes[-1] if self.sizes else 0
        self._logits = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)
        self._req = torch.full((rows,), -1, dtype=torch.int32, device=device)
        self._pos = torch.zeros(rows, dtype=torch.int64, device=device)
        self._temperature = torch.zeros(max_num_reqs, dtype=torch.float32, device=device)
        self._seeds = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        # size -> (its graph, the tokens it writes)
        self._captured: dict[int, tuple[graph_capture.AscendGraph, torch.Tensor]] = {}

    def capture(self, log: bool = True) -> int:
        """Capture one graph per size, as the decode graphs are captured (``graph/capture.py``:
        a side stream, CANN's resource errors named), all sharing one memory pool (they
        replay one at a time and each step copies its tokens out); the device memory they
        took."""
        if self._captured or not self.sizes:
            return 0
        layer = ascend_device.current()
        free_before = layer.accelerator_memory_info()[0]
        pool = layer.graph_pool_handle()
        with graph_capture.capture_context() as session:
            for rows in self.sizes:
                graph = graph_capture.AscendGraph()
                with graph_capture.capture(graph, pool, session.stream):
                    sampled = self._sample(rows)
                self._captured[rows] = (graph, sampled)
        taken = free_before - layer.accelerator_memory_info()[0]
        if log:
            logger.info(
                "Ascend sampler graphs: %d captured (random batches of up to %d requests), %.1f MiB",
                len(self._captured),
                self.sizes[-1],
                taken / 2**20,
            )
        return taken

    @property
    def logits_buffer(self) -> torch.Tensor:
        """The float32 logits rows the graphs read (the decode-step graphs' greedy sampling
        reads them too: a step samples one way or the other)."""
        return self._logits

    def release(self) -> None:
        """Drop the graphs (and so their pool): the memory profile's capture is thrown away."""
        self._captured.clear()

    def _sample(self, rows: int) -> torch.Tensor:
        return gumbel_sample(
            self._logits[:rows],
            self._req[:rows],
            self._temperature,
            self._seeds,
            self._pos[:rows],
            apply_temperature=False,
            is_drafting=False,
            use_fp64=self._use_fp64,
        )

    def covers(self, rows: int) -> bool:
        return bool(self._captured) and rows <= self.sizes[-1] and not ascend_device.current().is_capturing()

    def sample(
        self,
        logits: torch.Tensor,
        expanded_idx_mapping: torch.Tensor,
        pos: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
    ) -> torch.Tensor:
        """``gumbel_sample(logits, ...)`` without drafting, logits cache or bias, for a
        batch ``covers`` accepts: the tokens (int64, [rows])."""
        rows = logits.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, rows)]
        self._logits[:rows].copy_(logits)
        self._req[:rows].copy_(expanded_idx_mapping)
        if size > rows:
            self._req[rows:size].fill_(-1)
        self._pos[:rows].copy_(pos)
        self._temperature[: temperature.shape[0]].copy_(temperature)
        self._seeds[: seeds.shape[0]].copy_(seeds)
        graph, sampled = self._captured[size]
        graph.replay()  # (no fused-attention tasks: nothing to update)
        # the graph's output is rewritten by the next replay, which may come before an
        # asynchronous copy of this step's tokens has read them
        return sampled[:rows].clone()
