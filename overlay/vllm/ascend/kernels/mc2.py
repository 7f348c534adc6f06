"""MC2 token dispatch and combine of a MoE layer (expert parallelism).

Contract (torch_npu ``npu_moe_distribute_dispatch_v2`` / ``combine_v2``, unquantized,
``global_bs=0``): every EP rank passes the same batch size ``BS``; ``x [BS, H]``;
``expert_ids [BS, K]`` int32 in ``[0, E)``, no repeats within a row; ``active_mask
[BS]`` bool with every True before every False (inactive rows are neither sent nor
returned). Experts are placed linearly: EP rank ``r`` owns global experts ``r*L ..
r*L+L-1`` (``L = E / ep``).

``dispatch`` returns ``expand_x [A, H]`` (``A = BS * ep * min(L, K)``) whose first
``sum(expert_token_nums)`` rows are the rows this rank's experts must process,
grouped by local expert (then by source rank); ``expert_token_nums [L]`` (int64
counts); and opaque bookkeeping that ``combine`` takes back. ``combine`` receives
the expert outputs in the same layout and returns ``[BS, H]`` with row ``t`` =
``sum_k expert_scales[t, k] * output(t, k)`` (zero for inactive rows): the routing
weights are applied here, so the experts must return unweighted rows.

The reference runs the same contract on ordinary collectives (counts, then an
``all_to_all_single`` of exactly the routed rows, and back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from vllm.ascend.kernels import pick, torch_npu

# The ops' limits (torch_npu 2.14.0 docs of dispatch_v2 / combine_v2) under the
# algorithms MC2_COMM_ALG names: fullmesh on A2, fullmesh_v1 on A3. The strategy
# selector (vllm.ascend.moe.selector) reads them when it chooses MC2.
MAX_TOP_K = 16  # "0<K<=16"
MAX_EXPERTS = 1024  # moe_expert_num range [1, 1024]
# tokens per rank one dispatch may carry (BS: A2 fullmesh "0<BS<=256", A3 "0<BS<=512";
# vllm-ascend caps at 512; the reference, run in host emulation, takes the largest)
TOKENS_PER_RANK = {"A2": 256, "A3": 512, "other": 256, "host": 512}
MAX_BATCH = max(TOKENS_PER_RANK.values())  # what the reference enforces
# ep_world_size: A2 fullmesh {2..8, 16, 32, 64, 128, 256}; A3 [2, 768]
A2_EP_SIZES = frozenset({2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256})
A3_MAX_EP = 768
# H: A2 fullmesh (0, 7168] and a multiple of 32; A3 [1024, 8192]
A2_MAX_HIDDEN = 7168
A2_HIDDEN_ALIGN = 32
A3_HIDDEN = (1024, 8192)
# The algorithm MC2 runs, passed explicitly as ``comm_alg`` and never left to the
# environment: on A2, ``""`` means "hierarchy" when HCCL_INTRA_PCIE_ENABLE=1 and
# HCCL_INTRA_ROCE_ENABLE=0, and hierarchy takes no active mask, only EP 16/32/64, and
# needs expert_scales. The selector's limits and buffer formula are fullmesh's
# (vllm.ascend.moe.selector). A3's combine_v2 takes only "" and "hierarchy", and its
# dispatch_v2 documents "" as fullmesh_v1, so A3 passes "" to both.
MC2_COMM_ALG = {"A2": "fullmesh", "A3": ""}


@dataclass(frozen=True)
class Mc2Comm:
    """The MC2 communication domain: a group carrying nothing but MC2 traffic."""

    group: object  # torch.distributed ProcessGroup (the MC2 group's device group)
    name: str  # its collective-library name (HCCL communicator name on an NPU)
    ep_size: int
    ep_rank: int
    soc: str  # "A2" | "A3" | "host" | "other": which optional arguments the ops take


class Mc2Dispatched(NamedTuple):
    expand_x: torch.Tensor
    expert_token_nums: torch.Tensor
    assist_info: torch.Tensor
    ep_recv_counts: torch.Tensor
    tp_recv_counts: torch.Tensor | None = None
    expand_scales: torch.Tensor | None = None


def _validate(x, expert_ids, active_mask, comm: Mc2Comm, num_experts: int) -> None:
    bs, k = expert_ids.shape
    if x.dim() != 2 or x.shape[0] != bs:
        raise ValueError(
            f"mc2 dispatch: x {tuple(x.shape)} and expert_ids {tuple(expert_ids.shape)} disagree"
        )
    if not 0 < bs <= MAX_BATCH or not 0 < k <= min(MAX_TOP_K, num_experts):
        raise ValueError(f"mc2 dispatch: BS={bs} must be in (0, {MAX_BATCH}], top-k={k} in (0, {MAX_TOP_K}]")
    if expert_ids.dtype != torch.int32:
        raise ValueError(f"mc2 dispatch: expert_ids must be int32, got {expert_ids.dtype}")
    if num_experts % comm.ep_size:
        raise ValueError(f"mc2 dispatch: {num_experts} experts do not split over {comm.ep_size} EP ranks")
    if active_mask.dtype != torch.bool or tuple(active_mask.shape) != (bs,):
        raise ValueError(
            f"mc2 dispatch: active_mask must be bool [{bs}], got {active_mask.dtype} "
            f"{tuple(active_mask.shape)}"
        )
    n_active = int(active_mask.sum())
    if not bool(active_mask[:n_active].all()):
        raise ValueError("mc2 dispatch: active_mask must put every True before every False")
    ids = expert_ids[:n_active].to(torch.int64)
    if n_active and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(f"mc2 dispatch: an expert id is outside [0, {num_experts})")
    if k > 1 and n_active and bool((ids.sort(dim=1).values.diff(dim=1) == 0).any()):
        raise ValueError("mc2 dispatch: a token names the same expert twice")


def _send_order(expert_ids: torch.Tensor, active_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat (token, k) indices sorted by global expert id, their global ids): the order
    rows leave this rank, grouped by destination rank and local expert."""
    k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).to(torch.int64)
    pairs = torch.nonzero(active_mask.repeat_interleave(k), as_tuple=True)[0]
    order = pairs[torch.argsort(flat[pairs], stable=True)]
    return order, flat[order]


def reference_mc2_dispatch(
    x: torch.Tensor, expert_ids: torch.Tensor, active_mask: torch.Tensor, comm: Mc2Comm, num_experts: int
) -> Mc2Dispatched:
    _validate(x, expert_ids, active_mask, comm, num_experts)
    bs, k = expert_ids.shape
    ep, local = comm.ep_size, num_experts // comm.ep_size
    order, ids = _send_order(expert_ids, active_mask)
    send_counts = torch.bincount(ids, minlength=num_experts).view(ep, local)
    # Counts first (with each rank's BS, to hold every rank to one BS), then the rows.
    header = torch.cat([send_counts, torch.full((ep, 1), bs, dtype=torch.int64, device=x.device)], dim=1)
    recv_header = torch.empty_like(header)
    dist.all_to_all_single(recv_header, header, group=comm.group)
    if bool((recv_header[:, local] != bs).any()):
        raise ValueError(
            f"mc2 dispatch: EP ranks disagree on BS ({recv_header[:, local].tolist()}); "
            "with global_bs=0 every rank must pass the same BS"
        )
    recv_counts = recv_header[:, :local]  # [source rank, local expert]
    rows = x[order // k]
    received = x.new_empty((int(recv_counts.sum()), x.shape[1]))
    dist.all_to_all_single(
        received,
        rows.contiguous(),
        recv_counts.sum(1).tolist(),
        send_counts.sum(1).tolist(),
        group=comm.group,
    )
    # Arrived grouped by (source, expert); experts want (expert, source).
    source = torch.arange(ep, device=x.device).repeat_interleave(local)
    expert = torch.arange(local, device=x.device).repeat(ep)
    row_expert = expert.repeat_interleave(recv_counts.flatten())
    row_source = source.repeat_interleave(recv_counts.flatten())
    perm = torch.argsort(row_expert * ep + row_source, stable=True)
    capacity = bs * ep * min(local, k)
    expand_x = x.new_zeros((capacity, x.shape[1]))
    expand_x[: perm.numel()] = received[perm]
    assist = torch.zeros((capacity, 128), dtype=torch.int32, device=x.device)
    assist[: perm.numel(), 0] = perm.to(torch.int32)  # where the row sat in the arrival order
    assist[: perm.numel(), 1] = row_source[perm].to(torch.int32)
    ep_recv_counts = recv_counts.t().reshape(-1).cumsum(0).to(torch.int32)  # (expert, source) prefix sums
    return Mc2Dispatched(expand_x, recv_counts.sum(0).to(torch.int64), assist.reshape(-1), ep_recv_counts)


def reference_mc2_combine(
    expand_x: torch.Tensor,
    expert_ids: torch.Tensor,
    dispatched: Mc2Dispatched,
    expert_scales: torch.Tensor,
    active_mask: torch.Tensor,
    comm: Mc2Comm,
    num_experts: int,
) -> torch.Tensor:
    bs, k = expert_ids.shape
    ep, local = comm.ep_size, num_experts // comm.ep_size
    if expert_scales.dtype != torch.float32 or tuple(expert_scales.shape) != (bs, k):
        raise ValueError(
            f"mc2 combine: expert_scales must be float32 [{bs}, {k}], got {expert_scales.dtype} "
            f"{tuple(expert_scales.shape)}"
        )
    prefix = dispatched.ep_recv_counts.to(torch.int64)
    recv_counts = torch.diff(prefix, prepend=prefix.new_zeros(1)).view(local, ep).t()  # [source, expert]
    n = int(prefix[-1]) if prefix.numel() else 0
    arrival = dispatched.assist_info.view(-1, 128)[:n, 0].to(torch.int64)
    back = expand_x.new_empty((n, expand_x.shape[1]))
    back[arrival] = expand_x[:n]
    order, ids = _send_order(expert_ids, active_mask)
    send_counts = torch.bincount(ids, minlength=num_experts).view(ep, local)
    returned = expand_x.new_empty((order.numel(), expand_x.shape[1]))
    dist.all_to_all_single(
        returned, back, send_counts.sum(1).tolist(), recv_counts.sum(1).tolist(), group=comm.group
    )
    out = torch.zeros((bs, expand_x.shape[1]), dtype=torch.float32, device=expand_x.device)
    weights = expert_scales.reshape(-1)[order].unsqueeze(1)
    out.index_add_(0, order // k, returned.float() * weights)
    return out.to(expand_x.dtype)


def _soc_arguments(comm: Mc2Comm) -> dict:
    # A3 takes the (reserved) TP-domain arguments as vllm-ascend passes them.
    extra: dict[str, str | int] = {"comm_alg": MC2_COMM_ALG.get(comm.soc, "")}
    if comm.soc == "A3":
        extra.update(group_tp=comm.name, tp_world_size=1, tp_rank_id=0)
    return extra


def npu_mc2_dispatch(
    x: torch.Tensor, expert_ids: torch.Tensor, active_mask: torch.Tensor, comm: Mc2Comm, num_experts: int
) -> Mc2Dispatched:
    """``torch_npu.npu_moe_distribute_dispatch_v2`` (unquantized, uniform BS with an
    active mask). Passes the contract double; not verified on an NPU."""
    out = torch_npu().npu_moe_distribute_dispatch_v2(
        x,
        expert_ids,
        comm.name,
        comm.ep_size,
        comm.ep_rank,
        num_experts,
        x_active_mask=active_mask,
        global_bs=0,
        expert_token_nums_type=1,
        **_soc_arguments(comm),
    )
    expand_x, _dynamic_scales, assist, token_nums, ep_recv, tp_recv, expand_scales = out
    return Mc2Dispatched(expand_x, token_nums, assist, ep_recv, tp_recv, expand_scales)


def npu_mc2_combine(
    expand_x: torch.Tensor,
    expert_ids: torch.Tensor,
    dispatched: Mc2Dispatched,
    expert_scales: torch.Tensor,
    active_mask: torch.Tensor,
    comm: Mc2Comm,
    num_experts: int,
) -> torch.Tensor:
    """``torch_npu.npu_moe_distribute_combine_v2``. Passes the contract double; not
    verified on an NPU."""
    extra = _soc_arguments(comm)
    if comm.soc == "A3":
        extra["tp_send_counts"] = dispatched.tp_recv_counts
    return torch_npu().npu_moe_distribute_combine_v2(
        expand_x,
        expert_ids,
        dispatched.assist_info,
        dispatched.ep_recv_counts,
        expert_scales,
        comm.name,
        comm.ep_size,
        comm.ep_rank,
        num_experts,
        x_active_mask=active_mask,
        expand_scales=dispatched.expand_scales,
        global_bs=0,
        **extra,
    )


mc2_dispatch = pick(reference_mc2_dispatch, npu_mc2_dispatch)
mc2_combine = pick(reference_mc2_combine, npu_mc2_combine)
