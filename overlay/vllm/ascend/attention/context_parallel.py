"""Context-parallel attention, shared by the GQA and MLA backends.

The KV cache of a sequence is spread over the ranks of a context-parallel group by
``vllm.ascend.context_parallel.placement``; the step's plan (which rows are decode
rows, which prefill query runs this rank has) is ``cp_step.py``.

* Decode rows (one query token each, the same on every PCP rank): the query heads of
  the DCP group are gathered, each rank attends over the tokens it holds and returns
  the output with its log-sum-exp, and the partials of the whole group are combined
  (``kernels.context_parallel.combine_partials``). Only per-row outputs travel.
* Prefill query runs: each prefill request's history (cached context and this step's
  tokens, already written) is gathered from the group's caches into position order,
  chunk by chunk (at most ``VLLM_ASCEND_PREFILL_CHUNK_TOKENS`` tokens per gather, several
  requests' chunks per gather when they fit), and every run attends causally over its
  prefix, the chunks' partial results merged by log-sum-exp (``prefill_chunks.py``).
"""

from __future__ import annotations

import torch

from vllm.ascend.attention.prefill_chunks import Round
from vllm.ascend.context_parallel.placement import RankLayout
from vllm.ascend.kernels.attention import gather_range
from vllm.ascend.kernels.context_parallel import combine_partials


def rank_layout(parallel_config) -> RankLayout | None:
    """This rank's place in its context-parallel group (None without context parallelism)."""
    pcp, dcp = parallel_config.prefill_context_parallel_size, parallel_config.decode_context_parallel_size
    if pcp * dcp == 1:
        return None
    from vllm.distributed.parallel_state import get_dcp_group, get_pcp_group

    from vllm.ascend.distributed.groups import get_context_parallel_group

    layout = RankLayout(
        pcp,
        get_pcp_group().rank_in_group if pcp > 1 else 0,
        dcp,
        get_dcp_group().rank_in_group if dcp > 1 else 0,
        parallel_config.cp_kv_cache_interleave_size,
    )
    group_rank = get_context_parallel_group().rank_in_group
    if group_rank != layout.cp_rank:
        raise RuntimeError(
            f"context-parallel group rank {group_rank} != PCP/DCP rank {layout.cp_rank}: "
            "the DCP group must be consecutive TP ranks of one PCP rank"
        )
    return layout


def _cp_group():
    from vllm.ascend.distributed.groups import get_context_parallel_group

    return get_context_parallel_group()


def gather_dcp_heads(x: torch.Tensor, rank: RankLayout) -> torch.Tensor:
    """``[rows, heads, D]`` -> ``[rows, heads x DCP, D]``: the query heads of the DCP group."""
    if rank.dcp == 1:
        return x
    from vllm.distributed.parallel_state import get_dcp_group

    return get_dcp_group().all_gather(x.contiguous(), dim=1)


def combine_decode(out: torch.Tensor, lse: torch.Tensor, rank: RankLayout, own_heads: int) -> torch.Tensor:
    """Merge every rank's partial ``out [rows, H, D]`` / ``lse [rows, H]`` and keep this
    rank's ``own_heads`` heads (its slice of the DCP group's heads)."""
    group = _cp_group()
    outs = group.all_gather(out.unsqueeze(0).contiguous(), dim=0)
    lses = group.all_gather(lse.unsqueeze(0).contiguous(), dim=0)
    merged = combine_partials(outs, lses)
    first = rank.dcp_rank * own_heads
    return merged[:, first : first + own_heads]


def gather_round(planes: list[torch.Tensor], block_table: torch.Tensor, rnd: Round) -> torch.Tensor:
    """One round of the step's prefill plan: the tokens of its history chunks
    ``[rnd.rows, heads, D]`` in position order, chunks concatenated, gathered from the
    group's head-major planes ``[blocks, heads, block_size, D_i]`` (their last dims
    concatenated). Every rank of the group calls it for every round."""
    parts = []
    for (r, _, _), (lo, hi), pad in zip(rnd.chunks, rnd.extra["local"], rnd.extra["pads"]):
        rows = torch.cat([gather_range(p, block_table[r], lo, hi) for p in planes], dim=-1)
        if pad > hi - lo:
            rows = torch.cat([rows, rows.new_zeros(pad - (hi - lo), *rows.shape[1:])])
        parts.append(rows)
    every = _cp_group().all_gather(torch.cat(parts).contiguous(), dim=0)
    cache = rnd.extra["take_device"]
    key = str(every.device)
    if key not in cache:
        cache[key] = rnd.extra["take"].to(every.device, non_blocking=True)
    return every[cache[key]]


def pcp_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """All PCP ranks' rows, rank-major (the layout of the runner's PCP slot mapping)."""
    from vllm.distributed.parallel_state import get_pcp_group

    return get_pcp_group().all_gather(x.contiguous(), dim=0)
