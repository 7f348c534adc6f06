"""Routed-expert computation of a MoE layer (routing weights/ids already chosen).

Contract: ``x [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``topk_weights/topk_ids
[T, k]``; returns ``sum_j w_j * down(act(gate_up))`` over each token's chosen experts.
``activation`` is ``silu`` (SwiGLU: gate rows then up rows) or ``swigluoai`` (gpt-oss's
clamped SwiGLU: gate and up rows interleaved, ``activation.reference_swigluoai_and_mul``);
``w13_bias [E, 2I]`` / ``w2_bias [E, H]`` are added to each expert's projections (gpt-oss's
biased experts). ``expert_map`` (global -> local id, -1 = not on this rank) lets expert
parallelism skip experts held elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm.ascend.kernels import pick, torch_npu
from vllm.ascend.kernels.activation import (
    SWIGLUOAI_ALPHA,
    SWIGLUOAI_LIMIT,
    reference_silu_and_mul,
    reference_swigluoai_and_mul,
)

ACTIVATIONS = ("silu", "swigluoai")


def activation_name(activation: object) -> str:
    """``silu`` or ``swigluoai`` from upstream's ``MoEActivation`` (or its string), or an
    error naming what the Ascend experts cannot run."""
    name = str(getattr(activation, "value", activation)).lower()
    if name not in ACTIVATIONS:
        raise NotImplementedError(
            f"Ascend MoE experts run {' and '.join(ACTIVATIONS)} activations, not {name}"
        )
    return name


def _local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    ids = topk_ids.to(torch.int64)
    if expert_map is None:
        return ids
    # A negative id (a row no expert should take) must not index the map from its end.
    return torch.where(ids >= 0, expert_map.to(torch.int64)[ids.clamp(min=0)], -1)


def _reference_experts(x, topk_weights, topk_ids, expert_map, apply_router_weight_on_input, expert_mlp):
    """The reference loop over this rank's experts: ``expert_mlp(expert, h)`` maps the
    float32 rows routed to an expert (router weight applied when on the input) to their
    float32 outputs; results are weighted and summed in float32."""
    ids = _local_ids(topk_ids, expert_map)
    weights = topk_weights.to(torch.float32)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(ids).tolist():
        if expert < 0:
            continue
        tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
        h = x[tokens].to(torch.float32)
        w = weights[tokens, slots].unsqueeze(1)
        if apply_router_weight_on_input:
            h = h * w
        y = expert_mlp(expert, h)
        out.index_add_(0, tokens, y if apply_router_weight_on_input else y * w)
    return out.to(x.dtype)


def reference_moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    activation: object = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    activate = {"silu": reference_silu_and_mul, "swigluoai": reference_swigluoai_and_mul}[
        activation_name(activation)
    ]

    def mlp(expert: int, h: torch.Tensor) -> torch.Tensor:
        gate_up = h @ w13[expert].to(torch.float32).t()
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert].to(torch.float32)
        y = activate(gate_up) @ w2[expert].to(torch.float32).t()
        return y if w2_bias is None else y + w2_bias[expert].to(torch.float32)

    return _reference_experts(x, topk_weights, topk_ids, expert_map, apply_router_weight_on_input, mlp)


def _rows_by_expert(
    x,
    topk_weights,
    topk_ids,
    expert_map,
    num_local: int,
    apply_router_weight_on_input: bool,
    cumulative: bool = True,
):
    """Every (token, k) row sorted by local expert, the rows held by other ranks last:
    row -> token index, the rows' inputs (router weight applied when asked), their float32
    router weights (zero for rows held elsewhere), whether each row is this rank's, and
    the int64 group list: cumulative (its last value: this rank's row count), or with
    ``cumulative=False`` the per-expert counts.

    The row count stays on the device: the grouped matmuls get all ``T * k`` rows and a
    group list that ends at the valid count, so nothing is read back to the host (a
    host read drains the NPU's launch queue and is not allowed in a captured graph).
    """
    ids = _local_ids(topk_ids, expert_map).flatten()
    key = torch.where(ids >= 0, ids, num_local)
    order = torch.argsort(key, stable=True)
    # scatter_add_ instead of bincount: bincount sizes its output from the data's max.
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    group_list = torch.cumsum(counts[:num_local], 0) if cumulative else counts[:num_local]
    mine = (key[order] < num_local).unsqueeze(1)
    tokens = order // topk_ids.shape[1]
    weights = topk_weights.flatten()[order].to(torch.float32).unsqueeze(1) * mine
    h = (x[tokens].float() * weights).to(x.dtype) if apply_router_weight_on_input else x[tokens]
    return tokens, h, weights, mine, group_list


def _scatter_rows(x, tokens, y, weights, mine, apply_router_weight_on_input: bool) -> torch.Tensor:
    """The expert rows back into ``x``'s shape, weighted (unless the weights went on the
    input) and summed per token in float32, as the reference sums. Rows past the group
    list's end are whatever the kernel left there: ``where`` drops them (0 * NaN is NaN)."""
    y = torch.where(mine, y.float(), 0.0)
    if not apply_router_weight_on_input:
        y = y * weights
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, y)
    return out.to(x.dtype)


def _sorted_by_expert(x, ids, expert_num: int, active: int):
    """``npu_moe_init_routing_v2``: the ``T * k`` rows of experts ``[0, active)`` sorted by
    expert at the head of the output, each source row ``token * k + slot``'s position in
    it (``-1`` for a row of an expert outside that range: the op's documented gather
    index), and the per-expert row counts."""
    rows, position, counts, _ = torch_npu().npu_moe_init_routing_v2(
        x,
        ids.to(torch.int32),
        active_num=ids.numel(),
        expert_num=expert_num,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        active_expert_range=[0, active],
        quant_mode=-1,
    )
    return rows, position, counts


class ExpertMlp:
    """What runs between and after the grouped matmuls: the activation and the biases."""

    def __init__(
        self,
        activation: object = "silu",
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ):
        self.activation = activation_name(activation)
        self.w13_bias, self.w2_bias = w13_bias, w2_bias

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        npu = torch_npu()
        if self.activation == "swigluoai":
            return npu.npu_clipped_swiglu(
                gate_up, alpha=SWIGLUOAI_ALPHA, limit=SWIGLUOAI_LIMIT, bias=1.0, interleaved=True
            )
        return npu.npu_swiglu(gate_up)


def _row_experts(ends: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert of each sorted row from the cumulative row counts (rows past the last
    end get the last expert: they are never read). No read back to the host."""
    row = torch.arange(rows, device=ends.device)
    return torch.searchsorted(ends.contiguous(), row, right=True).clamp(max=ends.numel() - 1)


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None, row_experts: torch.Tensor | None) -> torch.Tensor:
    # The grouped matmul's own bias is documented as 1-D per weight tensor; its form for
    # one 3-D weight of many experts is not, so the bias is gathered per row instead.
    return y if bias is None else y + bias[row_experts].to(y.dtype)


def _expert_mlps(rows, group_list, w13, w2, mlp: ExpertMlp, list_type: int = 1):
    """Both grouped matmuls with the activation between (``list_type`` 1: per-expert
    counts, 0: cumulative ends); rows past the groups' end are not computed and must not
    be read."""
    npu = torch_npu()
    row_experts = None
    if mlp.w13_bias is not None or mlp.w2_bias is not None:
        ends = group_list.cumsum(0) if list_type == 1 else group_list
        row_experts = _row_experts(ends, rows.shape[0])
    common = dict(group_list=group_list, split_item=2, group_type=0, group_list_type=list_type)
    gate_up = npu.npu_grouped_matmul([rows], [w13.transpose(1, 2)], **common)[0]
    act = mlp.activate(_add_bias(gate_up, mlp.w13_bias, row_experts))
    y = npu.npu_grouped_matmul([act], [w2.transpose(1, 2)], **common)[0]
    return _add_bias(y, mlp.w2_bias, row_experts)


def _routed_on_device(x, w13, w2, topk_weights, topk_ids, mlp: ExpertMlp) -> torch.Tensor:
    """Every row this rank's (no expert map): init sorts and counts, the expert MLPs run,
    ``npu_moe_finalize_routing`` weighs and sums each token's rows back. Init
    gives each source row ``token * k + slot`` its sorted position; finalize reads the
    position of ``token + slot * T``, hence the transpose."""
    num_tokens, top_k = topk_ids.shape
    rows, position, counts = _sorted_by_expert(x, topk_ids, w13.shape[0], w13.shape[0])
    y = _expert_mlps(rows, counts, w13, w2, mlp)
    slot_major = position.view(num_tokens, top_k).t().contiguous().view(-1)
    return torch_npu().npu_moe_finalize_routing(
        y, None, None, None, topk_weights.to(y.dtype), slot_major, topk_ids.to(torch.int32), 0, top_k
    )


def _routed_on_device_with_map(
    x, w13, w2, topk_weights, topk_ids, expert_map, mlp: ExpertMlp
) -> torch.Tensor:
    """With an expert map (EP): the ids become local ones, and another rank's expert
    becomes ``num_local``, outside init's active range, so init leaves its rows out
    (position ``-1``) and counts only this rank's. Finalize takes no such rows, so the
    weighted sum over each token's rows is taken here, with ``where`` (an unset row may
    hold anything, and 0 * NaN is NaN)."""
    num_tokens, top_k = topk_ids.shape
    num_local = w13.shape[0]
    local = _local_ids(topk_ids, expert_map)
    local = torch.where(local >= 0, local, num_local)
    rows, position, counts = _sorted_by_expert(x, local, num_local + 1, num_local)
    y = _expert_mlps(rows, counts, w13, w2, mlp)
    held = (position >= 0).view(num_tokens, top_k, 1)
    picked = y[position.clamp(min=0).to(torch.int64)].view(num_tokens, top_k, -1)
    weighted = torch.where(held, picked.float(), 0.0) * topk_weights.to(torch.float32).unsqueeze(-1)
    return weighted.sum(dim=1).to(x.dtype)


def npu_moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    activation: object = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """With the router weights on the output: routing, grouped matmuls and the weighted
    sum on device through ``npu_moe_init_routing_v2`` (``_routed_on_device``, and with an
    expert map ``_routed_on_device_with_map``). With the weights on the input: sort tokens
    by expert, two grouped matmuls (``npu_grouped_matmul``, one x, one 3-D weight used
    transposed, cumulative int64 group list) with the activation between (``npu_swiglu``,
    or ``npu_clipped_swiglu`` for swigluoai), scatter back; rows of other ranks' experts
    are dropped with ``where``. Expert biases are gathered per sorted row and added after
    each grouped matmul. Passes the contract double; not verified on an NPU."""
    mlp = ExpertMlp(activation, w13_bias, w2_bias)
    if not apply_router_weight_on_input and topk_ids.numel() > 0:
        if expert_map is None:
            return _routed_on_device(x, w13, w2, topk_weights, topk_ids, mlp)
        return _routed_on_device_with_map(x, w13, w2, topk_weights, topk_ids, expert_map, mlp)
    tokens, h, weights, mine, group_list = _rows_by_expert(
        x, topk_weights, topk_ids, expert_map, w13.shape[0], apply_router_weight_on_input
    )
    y = _expert_mlps(h, group_list, w13, w2, mlp, list_type=0)
    return _scatter_rows(x, tokens, y, weights, mine, apply_router_weight_on_input)


moe_experts = pick(reference_moe_experts, npu_moe_experts)


# -- W8A8 dynamic experts (msModelSlim W8A8_DYNAMIC) ------------------------------------
# w13 [E, 2I, H] and w2 [E, H, I] int8, per-channel scales w13_scale [E, 2I] and
# w2_scale [E, H] (float32). Each expert's input rows are quantized per token, multiplied
# in int32, dequantized (weight scale x token scale) into the activation dtype, SwiGLU'd,
# quantized per token again for the down projection, and dequantized.
def reference_moe_experts_w8a8_dynamic(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    from vllm.ascend.kernels.quant import reference_quantize_dynamic

    inter = w2.shape[-1]

    def mlp(expert: int, h: torch.Tensor) -> torch.Tensor:
        h_q, h_scale = reference_quantize_dynamic(h.to(x.dtype))  # the activation dtype, as on the device
        acc = torch.mm(h_q.to(torch.int32), w13[expert].to(torch.int32).t()).to(torch.float32)
        gate_up = (
            (acc * w13_scale[expert].to(torch.float32) * h_scale.unsqueeze(1)).to(x.dtype).to(torch.float32)
        )
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        a_q, a_scale = reference_quantize_dynamic(act)
        acc = torch.mm(a_q.to(torch.int32), w2[expert].to(torch.int32).t()).to(torch.float32)
        return (acc * w2_scale[expert].to(torch.float32) * a_scale.unsqueeze(1)).to(x.dtype).to(torch.float32)

    return _reference_experts(x, topk_weights, topk_ids, expert_map, apply_router_weight_on_input, mlp)


def npu_moe_experts_w8a8_dynamic(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """Tokens sorted by expert, ``npu_dynamic_quant``, two per-token quantized grouped
    matmuls (``npu_grouped_matmul`` with ``scale`` and ``per_token_scale``; the scale is
    bfloat16 for bfloat16 output and float32 for float16, as documented) with
    ``npu_swiglu`` and a second ``npu_dynamic_quant`` between. Passes the contract
    double; not verified on an NPU."""
    npu = torch_npu()
    tokens, h, weights, mine, group_list = _rows_by_expert(
        x, topk_weights, topk_ids, expert_map, w13.shape[0], apply_router_weight_on_input
    )
    scale_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    h_q, h_scale = npu.npu_dynamic_quant(h)
    gate_up = npu.npu_grouped_matmul(
        [h_q],
        [w13.transpose(1, 2)],
        scale=[w13_scale.to(scale_dtype)],
        per_token_scale=[h_scale],
        group_list=group_list,
        split_item=2,
        group_type=0,
        output_dtype=x.dtype,
    )[0]
    act = npu.npu_swiglu(gate_up)
    a_q, a_scale = npu.npu_dynamic_quant(act)
    y = npu.npu_grouped_matmul(
        [a_q],
        [w2.transpose(1, 2)],
        scale=[w2_scale.to(scale_dtype)],
        per_token_scale=[a_scale],
        group_list=group_list,
        split_item=2,
        group_type=0,
        output_dtype=x.dtype,
    )[0]
    return _scatter_rows(x, tokens, y, weights, mine, apply_router_weight_on_input)


moe_experts_w8a8_dynamic = pick(reference_moe_experts_w8a8_dynamic, npu_moe_experts_w8a8_dynamic)


# -- W4A8 dynamic experts (msModelSlim W4A8_DYNAMIC, per-channel) -----------------------
# int4 expert weights with one scale per output channel; activations quantized per token
# to int8 as in W8A8_DYNAMIC. The math is W8A8_DYNAMIC's with weights in [-8, 7]; what
# differs is the form the NPU's grouped matmul takes them in (``npu_w4a8_weights``).
A8W4_GROUP = 256  # aclnnGroupedMatmulV5, A8W4 without offset: "Currently, quantGroupSize=256 is supported."
A8W4_MAX_K = 18432


@dataclass(frozen=True)
class W4A8Weights:
    """One projection's experts as its kernel takes them. Reference: ``weight`` int8 int4
    values [E, out, in], ``scale`` float32 [E, out]. NPU: ``weight`` packed [E, in, out/8]
    (int32, eight int4 each), ``scale`` the per-channel scale repeated for every 256 inputs
    as float32 bits [E, in/256, out] (int64). Both: ``bias`` the offset term the A8W4 kernel
    adds back, ``8 * sum_k w * scale`` [E, out] float32 (msModelSlim's ``scale_bias``; the
    reference's math needs none, it keeps the term so both forms hold the same tensors)."""

    weight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]


def reference_w4a8_weights(
    values: torch.Tensor, scale: torch.Tensor, offset_term: torch.Tensor
) -> W4A8Weights:
    return W4A8Weights(
        values.contiguous(), scale.to(torch.float32).contiguous(), offset_term.to(torch.float32).contiguous()
    )


def npu_w4a8_weights(values: torch.Tensor, scale: torch.Tensor, offset_term: torch.Tensor) -> W4A8Weights:
    """Packed once at load (``npu_convert_weight_to_int4pack``: 2-D, eight int4 along the
    last dim per int32), in the layout the A8W4 grouped matmul documents: weight
    (E, K, N), scale [E, K/256, N] uint64, bias [E, N] float32."""
    experts, out, k = values.shape
    if k % A8W4_GROUP or k > A8W4_MAX_K or out % 8:
        raise ValueError(
            f"W4A8 experts of shape [{experts}, {out}, {k}] cannot run on the NPU's A8W4 grouped "
            f"matmul: its input size must be a multiple of {A8W4_GROUP} and at most {A8W4_MAX_K}, "
            "its output size a multiple of 8"
        )
    rows = values.transpose(1, 2).reshape(experts * k, out).to(torch.int32).contiguous()
    packed = torch_npu().npu_convert_weight_to_int4pack(rows).view(experts, k, out // 8)
    bits = scale.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    grouped = bits[:, None, :].expand(experts, k // A8W4_GROUP, out).contiguous()
    return W4A8Weights(packed, grouped, offset_term.to(torch.float32).contiguous())


w4a8_weights = pick(reference_w4a8_weights, npu_w4a8_weights)


def reference_moe_experts_w4a8_dynamic(
    x: torch.Tensor,
    w13: W4A8Weights,
    w2: W4A8Weights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    return reference_moe_experts_w8a8_dynamic(
        x,
        w13.weight,
        w2.weight,
        w13.scale,
        w2.scale,
        topk_weights,
        topk_ids,
        expert_map,
        apply_router_weight_on_input,
    )


def npu_moe_experts_w4a8_dynamic(
    x: torch.Tensor,
    w13: W4A8Weights,
    w2: W4A8Weights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """Tokens sorted by expert, then per projection ``npu_dynamic_quant`` and the A8W4
    grouped matmul (int8 rows, packed int4 weight, uint64 scale, the offset term as its
    float bias, per-token scale; per-expert counts, the only group list it reads), with
    ``npu_swiglu`` between. Passes the contract double; not verified on an NPU."""
    npu = torch_npu()
    tokens, h, weights, mine, counts = _rows_by_expert(
        x, topk_weights, topk_ids, expert_map, w13.num_experts, apply_router_weight_on_input, cumulative=False
    )

    def project(rows: torch.Tensor, w: W4A8Weights) -> torch.Tensor:
        rows_q, rows_scale = npu.npu_dynamic_quant(rows)
        return npu.npu_grouped_matmul(
            [rows_q],
            [w.weight],
            bias=[w.bias],
            scale=[w.scale],
            per_token_scale=[rows_scale],
            group_list=counts,
            group_list_type=1,
            split_item=2,
            group_type=0,
            output_dtype=x.dtype,
        )[0]

    y = project(npu.npu_swiglu(project(h, w13)), w2)
    return _scatter_rows(x, tokens, y, weights, mine, apply_router_weight_on_input)


moe_experts_w4a8_dynamic = pick(reference_moe_experts_w4a8_dynamic, npu_moe_experts_w4a8_dynamic)
