"""Prefill attention over long histories in bounded memory.

A prefill query run (consecutive positions ``p0 .. p1 - 1`` of one request) attends
causally over its request's history ``0 .. p1 - 1``. Materialising that history (MLA:
expanding the latent cache through ``kv_b_proj``; context parallelism: gathering it from
the group's caches) costs memory linear in the context length. Instead the history of
each request is cut into chunks of at most ``chunk`` tokens (``VLLM_ASCEND_PREFILL_CHUNK_TOKENS``),
chunks are packed into rounds of at most ``chunk`` tokens, and each round is materialised,
attended and dropped before the next. For a run and a chunk ``[k0, k1)``:

* queries at positions ``>= k1`` see the whole chunk: one non-causal entry;
* queries inside ``[k0, k1)`` see the chunk's keys up to themselves: a causal entry over
  keys ``[k0, e)`` with ``e`` the last such query position + 1 (rightDownCausal then
  lines up, and every query sees at least one key);
* queries before ``k0`` do not see the chunk.

Each query row collects one partial result per chunk it sees; partials are merged by
their log-sum-exp (``kernels.context_parallel.merge_partials``). When every request's
history fits in one chunk each row gets exactly one partial and nothing is merged (the
single-call prefill of before). The plan is host-side and built once per step by the
metadata builder; ``attend`` runs it per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm.ascend.kernels import context_parallel as cp_kernels
from vllm.ascend.kernels import mla as dense_kernels

MAX_CALL_ROWS = dense_kernels.NPU_DENSE_MAX_T  # query rows per dense attention call


@dataclass(frozen=True)
class Run:
    """Consecutive query positions ``first_position ..`` of one request at rows ``row ..``."""

    row: int
    length: int
    request: int
    first_position: int

    @property
    def kv_len(self) -> int:
        return self.first_position + self.length


@dataclass
class Call:
    """One dense attention call: entries of query rows over slices of the round's keys."""

    causal: bool
    q_runs: list[tuple[int, int]] = field(default_factory=list)  # (first row, length)
    kv_runs: list[tuple[int, int]] = field(default_factory=list)  # (offset in the round, length)
    _rows: dict = field(default_factory=dict, repr=False)

    @property
    def q_lens(self) -> list[int]:
        return [n for _, n in self.q_runs]

    @property
    def kv_lens(self) -> list[int]:
        return [n for _, n in self.kv_runs]

    def rows(self, device, offset: int = 0) -> torch.Tensor:
        """The query rows minus ``offset`` as an int64 device tensor (made once per step)."""
        key = (str(device), offset)
        if key not in self._rows:
            index = [r - offset + i for r, n in self.q_runs for i in range(n)]
            # non_blocking: a host-to-device copy queued behind the step's work, no wait
            self._rows[key] = torch.as_tensor(index, dtype=torch.int64).to(device, non_blocking=True)
        return self._rows[key]

    def keys(self, x: torch.Tensor, round_rows: int) -> torch.Tensor:
        """The call's key rows of a round tensor: a view when they tile it, else a copy."""
        offsets, at = [], 0
        for offset, n in self.kv_runs:
            offsets.append(offset == at)
            at = offset + n
        if all(offsets) and at == round_rows:
            return x
        if len(self.kv_runs) == 1:
            offset, n = self.kv_runs[0]
            return x[offset : offset + n]
        return torch.cat([x[offset : offset + n] for offset, n in self.kv_runs])


@dataclass
class Round:
    chunks: list[tuple[int, int, int]]  # (request, first position, end position), in key order
    calls: list[Call]
    extra: dict = field(default_factory=dict)  # the materialiser's per-round host data (CP gathers)

    @property
    def rows(self) -> int:
        return sum(end - start for _, start, end in self.chunks)


@dataclass
class ChunkPlan:
    rounds: list[Round]
    merge: bool  # some request's history spans several chunks

    @property
    def empty(self) -> bool:
        return not self.rounds


def _entries(run: Run, start: int, end: int, offset: int):
    """(causal, first row, length, key offset in the round, key length) of one run over the
    chunk ``[start, end)`` stored at ``offset``."""
    p0, p1 = run.first_position, run.kv_len
    if start >= p1:
        return
    first = max(p0, start)
    last = min(p1, end)
    if last > first:  # queries inside the chunk: causal over keys [start, last)
        yield True, run.row + first - p0, last - first, offset, last - start
    first = max(p0, end)
    if p1 > first:  # queries after the chunk see all of it
        yield False, run.row + first - p0, p1 - first, offset, end - start


def build_chunk_plan(runs: list[Run], history_lens: dict[int, int], chunk: int) -> ChunkPlan:
    """The rounds of a step. ``history_lens``: every request's history length (under context
    parallelism the same on every rank of the group, so all join the same gathers, runs or
    not); ``runs`` this rank's query runs (each within its request's history)."""
    chunks = [
        (r, start, min(start + chunk, length))
        for r, length in history_lens.items()
        for start in range(0, length, chunk)
    ]
    packed: list[list[tuple[int, int, int]]] = []
    total = 0
    for c in chunks:
        size = c[2] - c[1]
        if not packed or total + size > chunk:
            packed.append([])
            total = 0
        packed[-1].append(c)
        total += size
    by_request: dict[int, list[Run]] = {}
    for run in runs:
        if run.length:
            by_request.setdefault(run.request, []).append(run)
    rounds = []
    for chunk_list in packed:
        entries = []
        offset = 0
        for r, start, end in chunk_list:
            for run in by_request.get(r, []):
                entries.extend(_entries(run, start, end, offset))
            offset += end - start
        calls: list[Call] = []
        for causal in (True, False):
            current = None
            for is_causal, row, length, kv_offset, kv_len in entries:
                if is_causal != causal:
                    continue
                while length:
                    if current is None or sum(current.q_lens) == MAX_CALL_ROWS:
                        current = Call(causal)
                        calls.append(current)
                    take = min(length, MAX_CALL_ROWS - sum(current.q_lens))
                    current.q_runs.append((row, take))
                    current.kv_runs.append((kv_offset, kv_len))
                    row, length = row + take, length - take
            # (a causal entry never needs the split: it has at most ``chunk`` <= 65536 rows)
        rounds.append(Round(chunk_list, calls))
    merge = any(length > chunk for length in history_lens.values())
    return ChunkPlan(rounds, merge)


def attend(
    q: torch.Tensor,
    plan: ChunkPlan,
    materialize: Callable[[Round], tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    out: torch.Tensor,
    v_dim: int,
    row_offset: int = 0,
) -> None:
    """``out[rows] = attention`` for every run of the plan. ``materialize(round)`` gives the
    round's keys and values ``[round.rows, heads, D]`` (chunks concatenated in order); it is
    called for every round, also on a rank without runs (collectives stay matched).
    ``q``/``out`` row ``i`` is the plan's row ``i + row_offset``."""
    acc_out = acc_lse = None
    if plan.merge:
        acc_out = q.new_zeros(q.shape[0], q.shape[1], v_dim)
        acc_lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    touched: list[torch.Tensor] = []
    for rnd in plan.rounds:
        k, v = materialize(rnd)
        for call in rnd.calls:
            rows = call.rows(q.device, row_offset)
            part, lse = dense_kernels.dense_attention(
                q[rows],
                call.keys(k, rnd.rows),
                call.keys(v, rnd.rows),
                call.q_lens,
                call.kv_lens,
                scale,
                call.causal,
            )
            if acc_out is None or acc_lse is None:
                out[rows] = part.to(out.dtype)
                continue
            merged, merged_lse = cp_kernels.merge_partials(acc_out[rows], acc_lse[rows], part, lse)
            acc_out[rows], acc_lse[rows] = merged, merged_lse
            touched.append(rows)
        del k, v
    if acc_out is not None and touched:
        rows = torch.cat(touched)
        out[rows] = acc_out[rows].to(out.dtype)
