"""Routed-expert computation of a MoE layer (routing weights/ids already chosen).

Contract: ``x [T, H]``, ``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]``,
``topk_weights/topk_ids [T, k]``; returns ``sum_j w_j * down(silu(gate) * up)`` over each
token's chosen experts. ``expert_map`` (global -> local id, -1 = not on this rank) lets
expert parallelism skip experts held elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.ascend.kernels import pick, torch_npu


def _local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    ids = topk_ids.to(torch.int64)
    if expert_map is None:
        return ids
    # A negative id (a row no expert should take) must not index the map from its end.
    return torch.where(ids >= 0, expert_map.to(torch.int64)[ids.clamp(min=0)], -1)


def reference_moe_experts(x, w13, w2, topk_weights, topk_ids, expert_map=None,
                          apply_router_weight_on_input=False) -> torch.Tensor:
    ids = _local_ids(topk_ids, expert_map)
    weights = topk_weights.to(torch.float32)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[-1]
    for expert in torch.unique(ids).tolist():
        if expert < 0:
            continue
        tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
        h = x[tokens].to(torch.float32)
        w = weights[tokens, slots].unsqueeze(1)
        if apply_router_weight_on_input:
            h = h * w
        gate_up = h @ w13[expert].to(torch.float32).t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ w2[expert].to(torch.float32).t()
        out.index_add_(0, tokens, y if apply_router_weight_on_input else y * w)
    return out.to(x.dtype)


def npu_moe_experts(x, w13, w2, topk_weights, topk_ids, expert_map=None,
                    apply_router_weight_on_input=False) -> torch.Tensor:
    """Sort tokens by expert, two grouped matmuls (``npu_grouped_matmul``, one x, one
    3-D weight used transposed, cumulative int64 group list) with ``npu_swiglu`` between,
    scatter back. Passes the contract double; not verified on an NPU."""
    npu = torch_npu()
    ids = _local_ids(topk_ids, expert_map).flatten()
    k = topk_ids.shape[1]
    valid = ids >= 0
    num_rows = int(valid.sum())
    if num_rows == 0:  # every chosen expert lives on another rank
        return torch.zeros_like(x)
    order = torch.argsort(torch.where(valid, ids, w13.shape[0]), stable=True)
    order = order[:num_rows]
    tokens = order // k
    counts = torch.bincount(ids[order], minlength=w13.shape[0])
    group_list = torch.cumsum(counts, 0).to(torch.int64)
    h = x[tokens]
    weights = topk_weights.flatten()[order].to(x.dtype).unsqueeze(1)
    if apply_router_weight_on_input:
        h = h * weights
    gate_up = npu.npu_grouped_matmul([h], [w13.transpose(1, 2)], group_list=group_list,
                                       split_item=2, group_type=0)[0]
    act = npu.npu_swiglu(gate_up)
    y = npu.npu_grouped_matmul([act], [w2.transpose(1, 2)], group_list=group_list,
                                 split_item=2, group_type=0)[0]
    if not apply_router_weight_on_input:
        y = y * weights
    out = torch.zeros_like(x)
    out.index_add_(0, tokens, y)
    return out


moe_experts = pick(reference_moe_experts, npu_moe_experts)
