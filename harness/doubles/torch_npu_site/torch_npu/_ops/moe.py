"""The contract double's CPU kernels for MoE: npu_grouped_matmul, npu_moe_init_routing_v2 /
finalize_routing, the gating top-k ops."""

from __future__ import annotations

import torch

from .._rules import require, unmodelled
from ._common import HALF_TYPES, _refuse_unmodelled
from .norm import FLOAT_TYPES
from .quant import scalar_type

# -- npu_grouped_matmul --------------------------------------------------------------------------
_GMM_UNMODELLED = (
    "bias",
    "offset",
    "antiquant_scale",
    "antiquant_offset",
    "activation_input",
    "activation_quant_scale",
    "activation_quant_offset",
    "tuning_config",
    "x_dtype",
    "weight_dtype",
    "scale_dtype",
    "per_token_scale_dtype",
)


def npu_grouped_matmul(**a):
    op = "npu_grouped_matmul"
    if a["x"] and a["weight"] and a["x"][0].dtype == torch.int8 and a["weight"][0].dtype == torch.int32:
        return [_gmm_a8w4(op, a)]
    _refuse_unmodelled(op, a, _GMM_UNMODELLED)
    if a["act_type"] not in (0, None):
        raise unmodelled(op, f"act_type={a['act_type']}")
    group_type = a["group_type"]
    require(group_type in (-1, 0), op, "GMM.group_type", f"group_type={group_type}")
    if group_type != 0 or len(a["x"]) != 1 or len(a["weight"]) != 1:
        raise unmodelled(op, "anything but one x, one 3-D weight, group_type=0")
    [x], [weight] = a["x"], a["weight"]
    group_list, list_type = a["group_list"], a["group_list_type"]
    require(
        a["split_item"] in (2, 3) and weight.dim() == 3 and x.dim() == 2 and group_list is not None,
        op,
        "GMM.single_tensor",
        f"split_item={a['split_item']}, weight {tuple(weight.shape)}, x {tuple(x.shape)}",
    )
    require(x.is_contiguous(), op, "GMM.single_tensor", "x is transposed / not contiguous")
    k_dim, n_dim = weight.shape[1], weight.shape[2]
    transposed = weight.stride(1) == 1 and weight.stride(2) == k_dim and weight.stride(0) == k_dim * n_dim
    require(
        weight.is_contiguous() or transposed,
        op,
        "GMM.weight_transpose",
        f"weight strides {weight.stride()} are neither contiguous nor a transpose of the last two dims",
    )
    require(
        group_list.dtype == torch.int64 and group_list.dim() == 1,
        op,
        "GMM.group_list_dtype",
        f"group_list {group_list.dtype} rank {group_list.dim()}",
    )
    require(
        group_list.shape[0] == weight.shape[0] and group_list.shape[0] <= 1024,
        op,
        "GMM.single_tensor",
        f"{group_list.shape[0]} groups for {weight.shape[0]} weights",
    )
    values = group_list.tolist()
    if list_type == 0:
        require(
            all(v >= 0 for v in values) and all(b >= a_ for a_, b in zip(values, values[1:])),
            op,
            "GMM.group_list",
            f"cumulative group_list {values}",
        )
        ends = values
    else:
        require(all(v >= 0 for v in values), op, "GMM.group_list", f"group_list counts {values}")
        ends = list(torch.tensor(values).cumsum(0).tolist())
    # The docs ask for ends[-1] == rows; callers on NPUs pass more rows (GMM.rows_past_groups)
    # and the double leaves those rows NaN, so a caller that reads them fails its oracle.
    require(
        ends[-1] <= x.shape[0], op, "GMM.single_tensor", f"groups cover {ends[-1]} rows, x has {x.shape[0]}"
    )
    require(
        x.shape[1] == k_dim, op, "GMM.single_tensor", f"x {tuple(x.shape)} @ weight {tuple(weight.shape)}"
    )
    require(max(k_dim, n_dim) < 65536, op, "GMM.inner_limit", f"K={k_dim}, N={n_dim}")
    if x.dtype == torch.int8:
        return [_gmm_per_token(op, a, x, weight, ends)]
    _refuse_unmodelled(op, a, ("scale", "per_token_scale", "output_dtype"))
    require(
        x.dtype == weight.dtype and x.dtype in (*HALF_TYPES, torch.float32),
        op,
        "GMM.single_tensor",
        f"x {x.dtype}, weight {weight.dtype}",
    )
    out = torch.full((x.shape[0], n_dim), float("nan"), dtype=torch.float32)
    start = 0
    for e, end in enumerate(ends):
        out[start:end] = x[start:end].float() @ weight[e].float()
        start = end
    return [out.to(x.dtype)]


def _gmm_per_token(op, a, x, weight, ends):
    """Per-token quantized mode: int8 x and weight, int32 accumulation, then x weight
    scale [g, n] per group and x per-token scale [m] (the docstring's formula 3 prints
    ``+ pertokenscale``; the per-token mode multiplies, as its name and CANN's
    aclnnGroupedMatmul documentation say)."""
    scale, per_token = a["scale"], a["per_token_scale"]
    out_dtype = scalar_type(a["output_dtype"])
    require(
        weight.dtype == torch.int8
        and scale is not None
        and per_token is not None
        and len(scale) == 1
        and len(per_token) == 1,
        op,
        "GMM.pertoken_dtypes",
        f"int8 x needs int8 weight, one scale and one per_token_scale (weight {weight.dtype})",
    )
    [scale], [per_token] = scale, per_token
    allowed = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}
    require(
        out_dtype in allowed and scale.dtype == allowed[out_dtype] and per_token.dtype == torch.float32,
        op,
        "GMM.pertoken_dtypes",
        f"output {out_dtype}, scale {scale.dtype}, per_token_scale {per_token.dtype}",
    )
    require(
        tuple(scale.shape) == (weight.shape[0], weight.shape[2]) and tuple(per_token.shape) == (x.shape[0],),
        op,
        "GMM.pertoken_formula",
        f"scale {tuple(scale.shape)} for weight {tuple(weight.shape)}, per_token_scale "
        f"{tuple(per_token.shape)} for x {tuple(x.shape)}",
    )
    out = torch.full((x.shape[0], weight.shape[2]), float("nan"), dtype=torch.float32)
    start = 0
    for e, end in enumerate(ends):
        acc = torch.mm(x[start:end].to(torch.int32), weight[e].to(torch.int32)).float()
        out[start:end] = acc * scale[e].float() * per_token[start:end].unsqueeze(1)
        start = end
    return out.to(out_dtype)


def _gmm_a8w4(op, a):
    """A8W4 (aclnnGroupedMatmulV5): int8 x [M, K], int4 weight (E, K, N) held as int32
    [E, K, N/8] (eight int4 each, packed as ``npu_convert_weight_to_int4pack`` packs),
    uint64 scale [E, K/256, N] (float32 bits; the per-group and per-channel scales fused),
    float bias [E, N] = 8 * sum_k weight * scale, float per-token scale [M]; the group
    list is read as per-expert counts whatever ``group_list_type`` says. Computed as
    documented: ``((x - 8) @ weight * scale + bias) * per_token_scale``, so a bias that
    is not the offset term gives a visibly wrong result."""
    _refuse_unmodelled(op, a, tuple(n for n in _GMM_UNMODELLED if n != "bias") + ("tuning_config",))
    require(
        len(a["x"]) == 1 and len(a["weight"]) == 1 and a["group_type"] == 0 and a["act_type"] in (0, None),
        op,
        "GMM.a8w4_single",
        f"{len(a['x'])} x, {len(a['weight'])} weight, group_type {a['group_type']}, act_type {a['act_type']}",
    )
    [x], [weight] = a["x"], a["weight"]
    scale, bias, per_token = a["scale"], a["bias"], a["per_token_scale"]
    out_dtype = scalar_type(a["output_dtype"])
    require(
        scale is not None
        and bias is not None
        and per_token is not None
        and scale[0].dtype == torch.int64
        and bias[0].dtype == torch.float32
        and per_token[0].dtype == torch.float32
        and out_dtype in HALF_TYPES,
        op,
        "GMM.a8w4_dtypes",
        f"scale {None if scale is None else scale[0].dtype}, bias {None if bias is None else bias[0].dtype}, "
        f"per_token_scale {None if per_token is None else per_token[0].dtype}, output {out_dtype}",
    )
    [scale], [bias], [per_token] = scale, bias, per_token
    require(
        x.dim() == 2 and weight.dim() == 3 and x.is_contiguous() and weight.is_contiguous(),
        op,
        "GMM.a8w4_layout",
        f"x {tuple(x.shape)}, weight {tuple(weight.shape)} strides {weight.stride()}",
    )
    experts, k_dim, n_dim = weight.shape[0], weight.shape[1], weight.shape[2] * 8
    require(
        k_dim % 256 == 0 and k_dim <= 18432 and x.shape[1] == k_dim,
        op,
        "GMM.a8w4_k",
        f"x {tuple(x.shape)}, K={k_dim}",
    )
    require(
        tuple(scale.shape) == (experts, k_dim // 256, n_dim),
        op,
        "GMM.a8w4_scale_shape",
        f"scale {tuple(scale.shape)} for weight (E, K, N) = {(experts, k_dim, n_dim)}",
    )
    require(
        tuple(bias.shape) == (experts, n_dim) and tuple(per_token.shape) == (x.shape[0],),
        op,
        "GMM.a8w4_bias",
        f"bias {tuple(bias.shape)}, per_token_scale {tuple(per_token.shape)} for E={experts}, N={n_dim}, "
        f"M={x.shape[0]}",
    )
    counts = a["group_list"]
    require(
        counts is not None and counts.dtype == torch.int64 and tuple(counts.shape) == (experts,),
        op,
        "GMM.a8w4_counts",
        f"group_list {None if counts is None else (counts.dtype, tuple(counts.shape))} for {experts} experts",
    )
    values = counts.tolist()
    require(
        all(v >= 0 for v in values) and sum(values) <= x.shape[0], op, "GMM.a8w4_counts", f"counts {values}"
    )
    w = unpack_int4(weight.reshape(experts * k_dim, -1)).view(experts, k_dim, n_dim).to(torch.float64)
    s = (scale & 0xFFFFFFFF).to(torch.int32).view(torch.float32).to(torch.float64)
    s = s.repeat_interleave(256, dim=1)  # [E, K, N]
    out = torch.full((x.shape[0], n_dim), float("nan"), dtype=torch.float32)
    start = 0
    for e, count in enumerate(values):
        end = start + count
        shifted = x[start:end].to(torch.float64) - 8
        y = (shifted @ (w[e] * s[e]) + bias[e].double()) * per_token[start:end].double().unsqueeze(1)
        out[start:end] = y.float()
        start = end
    return out.to(out_dtype)


# -- npu_convert_weight_to_int4pack ----------------------------------------------------------------
INT4PACK = "npu_convert_weight_to_int4pack"


def npu_convert_weight_to_int4pack(**a):
    """int32 [rows, n] of int4 values -> int32 [rows, n/8], eight values per int32, the
    first in the lowest four bits (op-plugin's kernel source; the docs say only that the
    values are interleaved). What no caller reads: only ``_gmm_a8w4`` unpacks it."""
    op = INT4PACK
    w = a["weight"]
    if a["inner_k_tiles"] not in (0, None):
        raise unmodelled(op, f"inner_k_tiles={a['inner_k_tiles']}")
    require(
        w.dtype == torch.int32
        and w.dim() == 2
        and w.is_contiguous()
        and w.shape[-1] % 8 == 0
        and bool(((w >= -8) & (w <= 7)).all()),
        op,
        "I4P.weight",
        f"weight {w.dtype} {tuple(w.shape)} contiguous={w.is_contiguous()}",
    )
    nibbles = (w.to(torch.int64) & 0xF).view(w.shape[0], -1, 8)
    word = sum(nibbles[..., j] << (4 * j) for j in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``npu_convert_weight_to_int4pack``'s inverse: int32 [rows, n/8] -> int8 [rows, n]."""
    word = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(word >> (4 * j)) & 0xF for j in range(8)], dim=-1)
    return torch.where(nibbles >= 8, nibbles - 16, nibbles).reshape(packed.shape[0], -1).to(torch.int8)


# -- npu_moe_init_routing_v2 / npu_moe_finalize_routing ---------------------------------------------
INIT_ROUTING = "npu_moe_init_routing_v2"
FINALIZE_ROUTING = "npu_moe_finalize_routing"


def npu_moe_init_routing_v2(**a):
    """Dropless, unquantized, gather-type row index, per-expert counts: the one mode this
    project calls. Source row ``s = token * K + k`` (``expert_idx`` flattened); the rows of
    experts in ``active_expert_range`` are sorted by expert (stably, here) into the head of
    ``expanded_x``; the rest of ``expanded_x`` is undefined (NaN here, so a reader shows).
    A row outside the range keeps index -1: the op docs' equivalent logic starts the gather
    index at -1 everywhere and sets only the in-range (``availableIdxNum``) rows."""
    op = INIT_ROUTING
    x, ids = a["x"], a["expert_idx"]
    _refuse_unmodelled(op, a, ("scale", "offset", "x_dtype"))
    if a["quant_mode"] != -1 or a["row_idx_type"] != 0 or a["expert_tokens_num_type"] != 1:
        raise unmodelled(op, "a quantized mode, a scatter-type row index or cumsum/key-value counts")
    if a["active_num"] not in (-1, 0, ids.numel()):
        raise unmodelled(op, f"active_num {a['active_num']}")
    require(
        x.dim() == 2 and x.dtype in (*FLOAT_TYPES, torch.int8), op, "IR2.x", f"x {x.dtype} {tuple(x.shape)}"
    )
    num = a["expert_num"]
    require(0 < num <= 10240, op, "IR2.expert_num", f"expert_num {num}")
    require(
        ids.dim() == 2
        and ids.dtype == torch.int32
        and ids.shape[0] == x.shape[0]
        and bool(((ids >= 0) & (ids < num)).all()),
        op,
        "IR2.expert_idx",
        f"expert_idx {ids.dtype} {tuple(ids.shape)} for x {tuple(x.shape)}, {num} experts",
    )
    require(a["drop_pad_mode"] == 0, op, "IR2.drop_pad_mode", f"drop_pad_mode {a['drop_pad_mode']}")
    require(a["expert_tokens_num_flag"], op, "IR2.tokens_num_flag", "expert_tokens_num_flag False")
    span = list(a["active_expert_range"]) or [0, num]
    require(
        len(span) == 2 and 0 <= span[0] < span[1] <= num,
        op,
        "IR2.active_range",
        f"range {span}, {num} experts",
    )
    start, end = span
    flat = ids.flatten().to(torch.int64)
    active = (flat >= start) & (flat < end)
    order = torch.argsort(torch.where(active, flat, end), stable=True)
    available = int(active.sum())
    expanded_x = torch.full((flat.numel(), x.shape[1]), float("nan"), dtype=torch.float32).to(x.dtype)
    expanded_x[:available] = x[order[:available] // ids.shape[1]]
    row_idx = torch.full((flat.numel(),), -1, dtype=torch.int32)
    row_idx[order[:available]] = torch.arange(available, dtype=torch.int32)
    counts = torch.bincount(flat[active] - start, minlength=end - start).to(torch.int64)
    scale_out = torch.full((flat.numel(),), float("nan"), dtype=torch.float32)  # no scale given: undefined
    return expanded_x, row_idx, counts, scale_out


def npu_moe_finalize_routing(
    expanded_permuted_rows,
    skip1,
    skip2,
    bias,
    scales,
    expanded_src_to_dst_row,
    export_for_source_row,
    drop_pad_mode,
    k,
):
    op = FINALIZE_ROUTING
    rows, index = expanded_permuted_rows, expanded_src_to_dst_row
    if skip1 is not None or skip2 is not None or bias is not None or scales is None:
        raise unmodelled(op, "skip inputs, an expert bias or no scales")
    require(rows.dim() == 2 and rows.dtype in FLOAT_TYPES, op, "FR.rows", f"{rows.dtype} {tuple(rows.shape)}")
    num_rows, top_k = scales.shape if scales.dim() == 2 else (-1, -1)
    require(
        scales.dim() == 2 and scales.dtype == rows.dtype and rows.shape[0] == num_rows * top_k,
        op,
        "FR.scales",
        f"scales {scales.dtype} {tuple(scales.shape)} for rows {rows.dtype} {tuple(rows.shape)}",
    )
    require(
        drop_pad_mode == 0
        and index.dim() == 1
        and index.dtype == torch.int32
        and index.numel() == rows.shape[0]
        and bool(((index >= 0) & (index < rows.shape[0])).all()),
        op,
        "FR.index",
        f"index {index.dtype} {tuple(index.shape)} for {rows.shape[0]} rows",
    )
    # out[i] = sum_k scales[i, k] * rows[index[i + k * num_rows]]
    picked = rows.float()[index.to(torch.int64)].view(top_k, num_rows, -1)
    out = (scales.float().t().unsqueeze(-1) * picked).sum(dim=0)
    return out.to(rows.dtype)


# -- npu_moe_gating_top_k_softmax(_v2) / npu_moe_gating_top_k (MoE routing) ---------------------------
# Semantics beyond the wheel's parameter tables are CANN's aclnn docs (aclnnMoeGatingTopKSoftmax:
# "softmaxOut=softmax(x,axis=-1) yOut,expertIdxOut=topK(softmaxOut,k=k)" and the rowIdxOut formula;
# aclnnMoeGatingTopKSoftmaxV2: "renorm = 0 ... yOut,expertIdxOut=topK(softmaxOut,k=k); renorm = 1
# topkOut,expertIdxOut=topK(x, k=k) yOut = softmax(topkOut,axis=-1)", and its outputSoftmaxResultFlag
# "当renorm=1时,该参数不生效,不输出Softmax的结果"; aclnnMoeGatingTopK (ops-transformer
# moe/moe_gating_top_k/docs/aclnnMoeGatingTopK.md): normOut = SoftMax(x) or Sigmoid(x); normValue =
# normOut + bias; groups scored by ReduceMax or the sum of the top two, the kGroup best kept, the
# rest set to -inf; expertIdxOut = TopK(normValue, k); y the chosen experts' normOut; Step 5: "if
# (normType = 1) or (normType = 0 and renorm = 1): yOut = normOut/(ReduceSum(normOut)+eps)", then
# yOut * routedScalingFactor. The kernel agrees (moe_gating_top_k_without_group*.h: "bool needRenorm =
# (normType_ == 1) || (normType_ == 0 && renorm_ == 1);" before the Muls by routedScalingFactor_):
# a softmax router's weights are *not* renormalised (renorm must be 0), only scaled.
GTKS = "npu_moe_gating_top_k_softmax"
GTK = "npu_moe_gating_top_k"


def npu_moe_gating_top_k_softmax(x, finished, k):
    require(
        x.dim() in (2, 3) and x.dtype in (*HALF_TYPES, torch.float32),
        GTKS,
        "GTKS.x",
        f"x {x.dtype} rank {x.dim()}",
    )
    if finished is not None:
        require(
            finished.dtype == torch.bool and tuple(finished.shape) == tuple(x.shape[:-1]),
            GTKS,
            "GTKS.finished",
            f"finished {finished.dtype} {tuple(finished.shape)} for x {tuple(x.shape)}",
        )
        raise unmodelled(GTKS, "finished")
    require(0 < k <= x.shape[-1] and k <= 1024, GTKS, "GTKS.k", f"k={k} for {x.shape[-1]} experts")
    rows = x.reshape(-1, x.shape[-1])
    y, idx = torch.softmax(rows.float(), dim=-1).topk(k, dim=-1)
    n = rows.shape[0]
    row_idx = torch.arange(n * k, dtype=torch.int32).view(k, n).t()
    shape = (*x.shape[:-1], k)
    return y.to(x.dtype).view(shape), idx.to(torch.int32).view(shape), row_idx.contiguous().view(shape)


GTKS2 = "npu_moe_gating_top_k_softmax_v2"


def npu_moe_gating_top_k_softmax_v2(x, k, finished, renorm, output_softmax):
    require(
        x.dim() in (2, 3) and x.dtype in (*HALF_TYPES, torch.float32),
        GTKS2,
        "GTKS2.x",
        f"x {x.dtype} rank {x.dim()}",
    )
    if finished is not None:
        raise unmodelled(GTKS2, "finished")
    require(0 < k <= x.shape[-1] and k <= 1024, GTKS2, "GTKS2.k", f"k={k} for {x.shape[-1]} experts")
    require(renorm in (0, 1), GTKS2, "GTKS2.renorm", f"renorm={renorm}")
    rows = x.reshape(-1, x.shape[-1]).float()
    if renorm == 0:
        softmax = torch.softmax(rows, dim=-1)
        y, idx = softmax.topk(k, dim=-1)
    else:  # the top k of x, then a softmax over them: the renormalised top-k softmax
        top, idx = rows.topk(k, dim=-1)
        y, softmax = torch.softmax(top, dim=-1), None
    shape = (*x.shape[:-1], k)
    # the softmax output only for renorm 0 with output_softmax (the wheel's meta: [0] otherwise)
    if renorm == 0 and output_softmax:
        softmax_out = softmax.view(x.shape)
    else:
        softmax_out = torch.empty(0, dtype=torch.float32)
    return y.to(x.dtype).view(shape), idx.to(torch.int32).view(shape), softmax_out


def npu_moe_gating_top_k(**a):
    x, k, bias = a["x"], a["k"], a["bias"]
    _refuse_unmodelled(GTK, a, ("input_ids", "tid2eid"))
    require(
        x.dim() == 2 and x.dtype in (*HALF_TYPES, torch.float32) and x.shape[-1] <= 2048,
        GTK,
        "GTK.x",
        f"x {x.dtype} {tuple(x.shape)}",
    )
    experts = x.shape[-1]
    if bias is not None:
        require(
            bias.dim() == 1 and bias.shape[0] == experts and bias.dtype == x.dtype,
            GTK,
            "GTK.bias",
            f"bias {bias.dtype} {tuple(bias.shape)} for x {x.dtype} {tuple(x.shape)}",
        )
    groups, k_group = a["group_count"], a["k_group"]
    per_group = experts // groups if groups > 0 else 0
    require(
        groups > 0 and experts % groups == 0 and per_group > 2 and -(-per_group // 32) * 32 * groups <= 2048,
        GTK,
        "GTK.group_count",
        f"group_count={groups} for {experts} experts",
    )
    # k_group * per_group >= k, also in GTK.k_group's text, is checked as GTK.k below
    require(1 <= k_group <= groups, GTK, "GTK.k_group", f"k_group={k_group} of {groups} groups")
    require(
        1 <= k <= per_group * k_group, GTK, "GTK.k", f"k={k} for {k_group} of {groups} groups of {per_group}"
    )
    require(a["group_select_mode"] in (0, 1), GTK, "GTK.group_select_mode", f"{a['group_select_mode']}")
    require(a["renorm"] == 0, GTK, "GTK.renorm", f"renorm={a['renorm']}")
    require(a["norm_type"] in (0, 1), GTK, "GTK.norm_type", f"norm_type={a['norm_type']}")
    xf = x.float()
    norm = torch.softmax(xf, dim=-1) if a["norm_type"] == 0 else torch.sigmoid(xf)
    value = norm if bias is None else norm + bias.float()
    if groups > 1:
        grouped = value.view(-1, groups, per_group)
        if a["group_select_mode"] == 0:
            score = grouped.amax(dim=-1)
        else:
            score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(score, dtype=torch.bool).scatter_(
            1, score.topk(k_group, dim=-1).indices, True
        )
        value = value.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    idx = value.topk(k, dim=-1).indices
    y = norm.gather(1, idx)
    if a["norm_type"] == 1 or (a["norm_type"] == 0 and a["renorm"] == 1):  # Step 5's condition
        y = y / (y.sum(dim=-1, keepdim=True) + a["eps"])
    y = y * a["routed_scaling_factor"]
    # norm_out: the norm function's result when out_flag asks for it (undefined otherwise: NaN here)
    norm_out = norm if a["out_flag"] else torch.full_like(norm, float("nan"))
    return y.to(x.dtype), idx.to(torch.int32), norm_out
