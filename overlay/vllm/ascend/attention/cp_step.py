"""One engine step under context parallelism, as one rank sees it (host-side, built once
per step by the attention metadata builder; the model runner reads the same object).

Prefill context parallel (PCP) splits each prefill request's new tokens over the PCP
ranks: the tokens are cut into ``2 x PCP`` near-equal chunks and PCP rank ``p`` runs
chunks ``p`` and ``2 x PCP - 1 - p``. Under causal attention the cost of a chunk grows
with its position, so pairing an early chunk with a late one gives every rank about the
same attention work. Decode tokens are not split: every PCP rank runs all of them.
Every PCP rank runs the same number of rows (``local_rows``: the decode tokens, then its
prefill chunks, then padding), which the collectives of MoE layers need.

The tokens of a step are numbered in the runner's order ("full" indices); a rank's rows
are ``local_index`` into them. After the PCP all-gather of per-rank rows, row
``q x local_rows + i`` is rank ``q``'s row ``i``; ``gather_order`` says which full token
each such row is (-1: padding, or another PCP rank's copy of a decode token), and
``restore`` picks, for every full token, its row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm.ascend.attention.prefill_chunks import MAX_CALL_ROWS, ChunkPlan, Run, build_chunk_plan
from vllm.ascend.context_parallel.placement import RankLayout, local_count, local_slot, owner


@dataclass(frozen=True)
class Segment:
    """A run of consecutive query positions of one prefill request on this rank."""

    row: int  # first local row (decode rows included)
    length: int
    request: int  # index of the request in the step's batch
    first_position: int

    @property
    def kv_len(self) -> int:
        return self.first_position + self.length


@dataclass
class CPStep:
    rank: RankLayout
    num_decodes: int
    num_decode_tokens: int
    decode_lens: list[int]  # tokens this rank holds for each decode query row
    segments: list[Segment]
    prefill_requests: list[int]  # every request with new prefill tokens (the same on all CP ranks)
    history_lens: list[int]  # their full sequence lengths
    local_rows: int
    local_index: list[int] | None = None  # PCP > 1 only
    num_local_tokens: int = 0  # rows of local_index that are tokens (the rest pad to local_rows)
    gather_order: list[int] | None = None
    restore: list[int] | None = None
    device_tensors: dict = field(default_factory=dict)  # device copies of the index lists (tensor())
    # The prefill attention over the gathered histories, chunk by chunk
    # (attention/prefill_chunks.py); each round's ``extra`` says what this rank
    # contributes to the round's gather and how the gathered rows go back in order.
    prefill_plan: ChunkPlan | None = None

    @property
    def segment_rows(self) -> list[int]:
        """Local rows of the query runs, in run order."""
        return [s.row + i for s in self.segments for i in range(s.length)]

    def tensor(self, name: str, device) -> torch.Tensor:
        """One of this step's index lists as an int64 device tensor, made once per step."""
        key = (name, str(device))
        if key not in self.device_tensors:
            host = torch.as_tensor(getattr(self, name), dtype=torch.int64)
            self.device_tensors[key] = host.to(device, non_blocking=True)  # queued, no wait
        return self.device_tensors[key]

    @property
    def split(self) -> bool:
        """Whether PCP splits this step's tokens (this rank runs only ``local_index``)."""
        return self.local_index is not None


def zigzag_runs(num_tokens: int, pcp: int, pcp_rank: int) -> list[tuple[int, int]]:
    """(start, length) runs of ``0 .. num_tokens - 1`` that PCP rank ``pcp_rank`` runs:
    chunks ``pcp_rank`` and ``2 x pcp - 1 - pcp_rank`` of ``2 x pcp`` near-equal chunks
    (adjacent chunks merged, empty ones dropped)."""
    parts = 2 * pcp
    base, extra = divmod(num_tokens, parts)
    bounds = [k * base + min(k, extra) for k in range(parts + 1)]
    runs: list[tuple[int, int]] = []
    for k in (pcp_rank, parts - 1 - pcp_rank):
        start, length = bounds[k], bounds[k + 1] - bounds[k]
        if length == 0:
            continue
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + length)
        else:
            runs.append((start, length))
    return runs


def add_round_gathers(plan: ChunkPlan, cp: int, cp_rank: int, interleave: int) -> None:
    """Per round of the prefill plan: the local token range of each chunk this rank
    contributes (``local``), the rows every rank contributes per chunk (``pads``: the most
    any rank holds of it), and ``take``: gathered ``[CP x sum(pads)]`` rows -> the round's
    tokens in position order, chunks concatenated."""
    for rnd in plan.rounds:
        local, pads, takes, offset = [], [], [], 0
        total_pad = sum(
            max(
                local_count(end, c, cp, interleave) - local_count(start, c, cp, interleave) for c in range(cp)
            )
            for _, start, end in rnd.chunks
        )
        for _, start, end in rnd.chunks:
            counts = [local_count(start, c, cp, interleave) for c in range(cp)]
            ends = [local_count(end, c, cp, interleave) for c in range(cp)]
            pad = max(e - s for s, e in zip(counts, ends))
            local.append((counts[cp_rank], ends[cp_rank]))
            pads.append(pad)
            t = torch.arange(start, end, dtype=torch.int64)
            holder = owner(t, cp, interleave)
            first = torch.tensor(counts, dtype=torch.int64)[holder]
            takes.append(holder * total_pad + offset + local_slot(t, cp, interleave) - first)
            offset += pad
        rnd.extra.update(local=local, pads=pads, take=torch.cat(takes), take_device={})


def build_step(
    query_start: list[int],
    seq_lens: list[int],
    num_decodes: int,
    rank: RankLayout,
    chunk: int = MAX_CALL_ROWS,
) -> CPStep:
    """The plan of one step: ``query_start``/``seq_lens`` per request (host lists, the
    runner's order, decode requests first), ``num_decodes`` of them decode requests;
    ``chunk`` the history tokens the prefill attention gathers at once."""
    cp, cp_rank, interleave = rank.cp, rank.cp_rank, rank.interleave
    q_lens = [b - a for a, b in zip(query_start, query_start[1:])]
    num_decode_tokens = query_start[num_decodes]
    decode_lens = [
        local_count(s - n + i + 1, cp_rank, cp, interleave)
        for s, n in zip(seq_lens[:num_decodes], q_lens[:num_decodes])
        for i in range(n)
    ]
    prefills = [r for r in range(num_decodes, len(q_lens)) if q_lens[r]]

    def runs_of(pcp_rank: int) -> list[tuple[int, int, int]]:
        return [
            (r, start, length)
            for r in prefills
            for start, length in zigzag_runs(q_lens[r], rank.pcp, pcp_rank)
        ]

    segments, row = [], num_decode_tokens
    for r, start, length in runs_of(rank.pcp_rank):
        segments.append(Segment(row, length, r, seq_lens[r] - q_lens[r] + start))
        row += length
    lens = [seq_lens[r] for r in prefills]
    step = CPStep(
        rank=rank,
        num_decodes=num_decodes,
        num_decode_tokens=num_decode_tokens,
        decode_lens=decode_lens,
        segments=segments,
        prefill_requests=prefills,
        history_lens=lens,
        local_rows=query_start[-1],
    )
    if prefills:
        runs = [Run(s.row, s.length, s.request, s.first_position) for s in segments]
        step.prefill_plan = build_chunk_plan(runs, dict(zip(prefills, lens)), chunk)
        add_round_gathers(step.prefill_plan, cp, cp_rank, interleave)
    if rank.pcp > 1:
        _add_pcp_split(step, query_start, runs_of)
    return step


def _add_pcp_split(step: CPStep, query_start: list[int], runs_of) -> None:
    pcp, ndec = step.rank.pcp, step.num_decode_tokens
    per_rank = [
        [query_start[r] + start + i for r, start, length in runs_of(p) for i in range(length)]
        for p in range(pcp)
    ]
    rows = ndec + max(len(tokens) for tokens in per_rank)
    order: list[int] = []
    for p, tokens in enumerate(per_rank):
        decodes = list(range(ndec)) if p == 0 else [-1] * ndec
        order += decodes + tokens + [-1] * (rows - ndec - len(tokens))
    restore = [0] * query_start[-1]
    for row, token in enumerate(order):
        if token >= 0:
            restore[token] = row
    mine = per_rank[step.rank.pcp_rank]
    step.local_rows = rows
    step.local_index = list(range(ndec)) + mine + [0] * (rows - ndec - len(mine))
    step.num_local_tokens = ndec + len(mine)
    step.gather_order = order
    step.restore = restore
