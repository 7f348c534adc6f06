"""The contract double's CPU kernels for MC2: npu_moe_distribute_dispatch_v2 / combine_v2."""

from __future__ import annotations

import os

import torch

from .._rules import require, unmodelled
from ._common import HALF_TYPES, _refuse_unmodelled

# -- npu_moe_distribute_dispatch_v2 / combine_v2 (MC2) ------------------------------------------------
# The double computes the documented result by brute force: every rank all-gathers every
# rank's tokens, routing and mask, and keeps what its experts own. ``assist_info`` rows
# hold (source rank, token, k) here; on an NPU the buffer is opaque.
MC2_DISPATCH = "npu_moe_distribute_dispatch_v2"
MC2_COMBINE = "npu_moe_distribute_combine_v2"
_MC2_DISPATCH_UNMODELLED = (
    "scales",
    "expert_scales",
    "elastic_info",
    "performance_info",
    "y_dtype",
    "x_dtype",
    "scales_dtype",
)
_MC2_COMBINE_UNMODELLED = (
    "shared_expert_x",
    "elastic_info",
    "ori_x",
    "const_expert_alpha_1",
    "const_expert_alpha_2",
    "const_expert_v",
    "performance_info",
)


def _mc2_group(op: str, a: dict):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    name = a["group_ep"]
    require(isinstance(name, str) and 1 <= len(name) < 128, op, "MC2.group", f"group_ep {name!r}")
    group = _resolve_process_group(name)
    require(
        dist.get_world_size(group) == a["ep_world_size"] and dist.get_rank(group) == a["ep_rank_id"],
        op,
        "MC2.group",
        f"ep_world_size={a['ep_world_size']} ep_rank_id={a['ep_rank_id']} for a group of "
        f"{dist.get_world_size(group)} where this rank is {dist.get_rank(group)}",
    )
    for arg in (
        "shared_expert_rank_num",
        "expert_shard_type",
        "global_bs",
        "zero_expert_num",
        "copy_expert_num",
        "const_expert_num",
    ):
        if a[arg]:
            raise unmodelled(op, f"{arg}={a[arg]}")
    if a["tp_world_size"] > 1:
        raise unmodelled(op, f"tp_world_size={a['tp_world_size']}")
    return group


def _mc2_soc() -> str:
    """The SoC the double plays (TORCH_NPU_DOUBLE_SOC = A2 | A3, default A2), read from the
    environment at each call as the npu runtime stub's ``get_soc_version`` does."""

    soc = os.environ.get("TORCH_NPU_DOUBLE_SOC", "A2").strip().upper() or "A2"
    if soc not in ("A2", "A3"):
        raise ValueError(f"TORCH_NPU_DOUBLE_SOC must be A2 or A3, got {soc!r}")
    return soc


def _mc2_algorithm(op: str, a: dict) -> tuple[str, str]:
    """(SoC, the algorithm ``comm_alg`` selects there), resolved as the docs do: on A2 ``""``
    follows HCCL_INTRA_PCIE_ENABLE / HCCL_INTRA_ROCE_ENABLE; on A3 it is fullmesh_v1.
    Hierarchy's documented exclusions are refused; its semantics are not modelled."""

    soc, alg = _mc2_soc(), a["comm_alg"]
    if soc == "A2":
        require(alg in ("", "fullmesh", "hierarchy"), op, "MC2.comm_alg_a2", f"comm_alg={alg!r} on A2")
        if alg == "":
            pcie, roce = os.environ.get("HCCL_INTRA_PCIE_ENABLE"), os.environ.get("HCCL_INTRA_ROCE_ENABLE")
            alg = "hierarchy" if (pcie, roce) == ("1", "0") else "fullmesh"
    elif op == MC2_DISPATCH:
        require(
            alg in ("", "fullmesh_v1", "fullmesh_v2", "hierarchy"), op, "MC2.comm_alg_a3", f"comm_alg={alg!r}"
        )
        alg = alg or "fullmesh_v1"
    else:
        require(alg in ("", "hierarchy"), op, "MC2.combine_comm_alg_a3", f"comm_alg={alg!r}")
        alg = alg or "fullmesh_v1"
    if alg == "hierarchy" and soc == "A2":
        how = (
            "comm_alg='' with HCCL_INTRA_PCIE_ENABLE=1, HCCL_INTRA_ROCE_ENABLE=0" if not a["comm_alg"] else ""
        )
        require(
            a["x_active_mask"] is None, op, "MC2.hierarchy_mask", f"x_active_mask given to hierarchy {how}"
        )
        require(
            a["ep_world_size"] in (16, 32, 64),
            op,
            "MC2.hierarchy_ep",
            f"ep_world_size={a['ep_world_size']} with hierarchy {how}",
        )
        if op == MC2_DISPATCH:
            require(
                a["expert_scales"] is not None,
                op,
                "MC2.hierarchy_expert_scales",
                f"hierarchy {how} sums a token's expert outputs inside a server: dispatch needs expert_scales",
            )
    if alg in ("hierarchy", "fullmesh_v2"):
        raise unmodelled(op, f"comm_alg resolving to {alg!r}")
    return soc, alg


def _mc2_buffer(op: str, a: dict, soc: str, bs: int, k: int, h: int) -> None:
    """The HCCL buffer (HCCL_BUFFSIZE, MB; 200 when unset) against the documented need of
    the resolved algorithm; with global_bs=0 every rank's BS is this BS (max_bs = BS)."""

    raw = os.environ.get("HCCL_BUFFSIZE", "").strip()
    buffsize = int(raw) if raw else 200  # MC2.buffsize_default
    mb = 1 << 20
    ep = a["ep_world_size"]
    local = a["moe_expert_num"] // ep

    def align(x, n):
        return (x + n - 1) // n * n

    if soc == "A2":
        need, rule = 2 * (bs * ep * min(local, k) * h * 2 + 2 * mb), "MC2.buffsize_a2"
    else:
        shared = a["shared_expert_num"]
        row = align(align(2 * h, 32) + 64, 512)
        need = 2 * (local * bs * ep * row + (k + shared) * bs * align(2 * h, 512))
        rule = "MC2.buffsize_a3"
    require(
        need <= buffsize * mb,
        op,
        rule,
        f"BS={bs}, ep_world_size={ep}, local experts={local}, K={k}, H={h} need {-(-need // mb)} MB of HCCL "
        f"buffer; HCCL_BUFFSIZE={raw or 'unset (200 MB, MC2.buffsize_default)'}",
    )


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    out = t.new_empty((dist.get_world_size(group) * t.shape[0], *t.shape[1:]))
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out.view(dist.get_world_size(group), *t.shape)


def npu_moe_distribute_dispatch_v2(**a):
    op = MC2_DISPATCH
    soc, _alg = _mc2_algorithm(op, a)
    _refuse_unmodelled(op, a, _MC2_DISPATCH_UNMODELLED)
    if a["quant_mode"] != 0 or a["shared_expert_num"] not in (0, 1):
        raise unmodelled(op, f"quant_mode={a['quant_mode']}, shared_expert_num={a['shared_expert_num']}")
    group = _mc2_group(op, a)
    x, ids, mask = a["x"], a["expert_ids"], a["x_active_mask"]
    experts, ep, rank = a["moe_expert_num"], a["ep_world_size"], a["ep_rank_id"]
    require(x.dtype in HALF_TYPES and x.dim() == 2, op, "MC2.dtype", f"x {x.dtype} rank {x.dim()}")
    require(
        ids.dtype == torch.int32 and ids.dim() == 2 and ids.shape[0] == x.shape[0],
        op,
        "MC2.expert_ids",
        f"expert_ids {ids.dtype} {tuple(ids.shape)} for x {tuple(x.shape)}",
    )
    bs, k = ids.shape
    require(0 < k <= 16, op, "MC2.top_k", f"K={k}")
    require(0 < bs <= 512, op, "MC2.batch", f"BS={bs}")
    _mc2_buffer(op, a, soc, bs, k, x.shape[1])
    flat = ids.to(torch.int64)
    require(
        bool(((flat >= 0) & (flat < experts)).all()), op, "MC2.expert_ids", "an expert id is out of range"
    )
    require(
        k == 1 or not bool((flat.sort(dim=1).values.diff(dim=1) == 0).any()),
        op,
        "MC2.expert_ids",
        "a row repeats an expert",
    )
    if mask is None:
        mask = torch.ones(bs, dtype=torch.bool)
    require(
        mask.dtype == torch.bool and tuple(mask.shape) == (bs,),
        op,
        "MC2.mask_order",
        f"x_active_mask {mask.dtype} {tuple(mask.shape)} (only the 1-D form is modelled)",
    )
    active = int(mask.sum())
    require(bool(mask[:active].all()), op, "MC2.mask_order", "a False precedes a True")
    sizes = _gather(torch.tensor([bs]), group).flatten()
    require(bool((sizes == bs).all()), op, "MC2.uniform_bs", f"BS per rank {sizes.tolist()} with global_bs=0")
    require(experts % ep == 0, op, "MC2.expert_ids", f"{experts} experts over {ep} ranks")
    all_x, all_ids, all_mask = _gather(x, group), _gather(flat, group), _gather(mask, group)
    local = experts // ep
    capacity = bs * ep * min(local, k)
    expand_x = x.new_zeros((capacity, x.shape[1]))
    assist = torch.zeros((capacity, 128), dtype=torch.int32)
    counts = torch.zeros((local, ep), dtype=torch.int64)
    row = 0
    for e in range(local):
        for src in range(ep):
            hit = (all_ids[src] == rank * local + e) & all_mask[src].unsqueeze(1)
            tokens, slots = torch.nonzero(hit, as_tuple=True)
            n = tokens.numel()
            expand_x[row : row + n] = all_x[src][tokens]
            assist[row : row + n, 0] = src
            assist[row : row + n, 1] = tokens.to(torch.int32)
            assist[row : row + n, 2] = slots.to(torch.int32)
            counts[e, src] = n
            row += n
    per_expert = counts.sum(1)
    token_nums = per_expert if a["expert_token_nums_type"] == 1 else per_expert.cumsum(0)
    ep_recv_counts = counts.flatten().cumsum(0).to(torch.int32)
    return (
        expand_x,
        torch.zeros(capacity, dtype=torch.float32),
        assist.flatten(),
        token_nums,
        ep_recv_counts,
        torch.zeros(a["tp_world_size"], dtype=torch.int32),
        torch.zeros(0, dtype=torch.float32),
    )


def npu_moe_distribute_combine_v2(**a):
    op = MC2_COMBINE
    soc, _alg = _mc2_algorithm(op, a)
    _refuse_unmodelled(op, a, _MC2_COMBINE_UNMODELLED)
    if a["comm_quant_mode"] != 0 or a["shared_expert_num"] not in (0, 1):
        raise unmodelled(
            op, f"comm_quant_mode={a['comm_quant_mode']}, shared_expert_num={a['shared_expert_num']}"
        )
    group = _mc2_group(op, a)
    expand_x, ids, scales, mask = a["expand_x"], a["expert_ids"], a["expert_scales"], a["x_active_mask"]
    bs, k = ids.shape
    require(
        scales.dtype == torch.float32 and tuple(scales.shape) == (bs, k),
        op,
        "MC2.expert_scales",
        f"expert_scales {scales.dtype} {tuple(scales.shape)} for expert_ids {tuple(ids.shape)}",
    )
    require(expand_x.dtype in HALF_TYPES, op, "MC2.dtype", f"expand_x {expand_x.dtype}")
    _mc2_buffer(op, a, soc, bs, k, expand_x.shape[1])
    rank = a["ep_rank_id"]
    all_rows = _gather(expand_x, group)
    all_assist = _gather(a["assist_info_for_combine"].view(-1, 128), group)
    valid = _gather(a["ep_send_counts"][-1:].to(torch.int64), group).flatten().tolist()
    out = torch.zeros((bs, expand_x.shape[1]), dtype=torch.float32)
    for src, n in enumerate(valid):
        info = all_assist[src][:n].to(torch.int64)
        mine = info[:, 0] == rank
        tokens, slots = info[mine, 1], info[mine, 2]
        out.index_add_(0, tokens, all_rows[src][:n][mine].float() * scales[tokens, slots].unsqueeze(1))
    if mask is not None:
        out[~mask] = 0
    return out.to(expand_x.dtype)
