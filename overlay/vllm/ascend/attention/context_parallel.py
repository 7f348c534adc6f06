"""Context-parallel attention, shared by the GQA and MLA backends.

The KV cache of a sequence is spread over the ranks of a context-parallel group by
``vllm.ascend.context_parallel.placement``; the step's plan (which rows are decode
rows, which prefill query runs this rank has) is ``vllm.ascend.context_parallel.step``.

* Decode rows (one query token each, the same on every PCP rank): the query heads of
  the DCP group are gathered, each rank attends over the tokens it holds and returns
  the output with its log-sum-exp, and the partials of the whole group are combined
  (``kernels.context_parallel.combine_partials``). Only per-row outputs travel.
* Prefill query runs: each prefill request's whole history (cached context and this
  step's tokens, already written) is gathered from the group's caches into position
  order, and every run attends causally over its prefix. One gather per layer and
  step carries every prefill request.
"""

from __future__ import annotations

import torch

from vllm.ascend.context_parallel.placement import RankLayout
from vllm.ascend.context_parallel.step import CPStep
from vllm.ascend.kernels.attention import gather_tokens
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


def gather_history(planes: list[torch.Tensor], block_table: torch.Tensor, step: CPStep) -> torch.Tensor:
    """Every prefill request's tokens ``[sum(history_lens), heads, D]`` in position order,
    requests concatenated, from head-major planes ``[blocks, heads, block_size, D_i]``
    (their last dims concatenated)."""
    parts = []
    for r, local, pad in zip(step.prefill_requests, step.history_local, step.history_pad):
        rows = torch.cat([gather_tokens(p, block_table[r], local) for p in planes], dim=-1)
        if pad > local:
            rows = torch.cat([rows, rows.new_zeros(pad - local, *rows.shape[1:])])
        parts.append(rows)
    every = _cp_group().all_gather(torch.cat(parts).contiguous(), dim=0)
    return every[step.tensor("history_take", every.device)]


def segment_inputs(step: CPStep, history: torch.Tensor):
    """Per query run: the history prefix it attends over; (keys concatenated, q lens, kv lens)."""
    offsets = dict(zip(step.prefill_requests, step.history_offsets()))
    prefixes = [history[offsets[s.request] : offsets[s.request] + s.kv_len] for s in step.segments]
    kv = torch.cat(prefixes) if prefixes else history[:0]
    return kv, [s.length for s in step.segments], [s.kv_len for s in step.segments]


def pcp_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """All PCP ranks' rows, rank-major (the layout of the runner's PCP slot mapping)."""
    from vllm.distributed.parallel_state import get_pcp_group

    return get_pcp_group().all_gather(x.contiguous(), dim=0)
