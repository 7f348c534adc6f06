"""The contract double's CPU kernels for W8A8: npu_quant_matmul, npu_dynamic_quant, npu_quantize."""

from __future__ import annotations

import torch

from .._rules import require, unmodelled
from ._common import HALF_TYPES, _refuse_unmodelled

# -- W8A8: npu_quant_matmul, npu_dynamic_quant, npu_quantize ------------------------------------
# Schema dtype arguments arrive as c10::ScalarType numbers.
_SCALAR_TYPES = {
    1: torch.int8,
    3: torch.int32,
    5: torch.float16,
    6: torch.float32,
    12: torch.qint8,
    15: torch.bfloat16,
    16: torch.quint4x2,
}
QMM = "npu_quant_matmul"


def scalar_type(value):
    if value is None or isinstance(value, torch.dtype):
        return value
    return _SCALAR_TYPES.get(value, value)


def npu_quant_matmul(**a):
    _refuse_unmodelled(
        QMM,
        a,
        ("offset", "x1_dtype", "x2_dtype", "pertoken_scale_dtype", "scale_dtype", "group_sizes", "y_scale"),
    )
    x1, x2, scale, per_token, bias = a["x1"], a["x2"], a["scale"], a["pertoken_scale"], a["bias"]
    out_dtype = scalar_type(a["output_dtype"])
    require(x1.dtype == torch.int8 and x2.dtype == torch.int8, QMM, "QMM.x1", f"x1 {x1.dtype}, x2 {x2.dtype}")
    if x1.dim() != 2 or x2.dim() != 2:
        raise unmodelled(QMM, "anything but 2-D x1 and x2")
    m, k = x1.shape
    n = x2.shape[1]
    require(x2.shape[0] == k, QMM, "QMM.x1", f"x1 {tuple(x1.shape)} @ x2 {tuple(x2.shape)}")
    require(max(k, n) <= 65535, QMM, "QMM.last_dim", f"k={k}, n={n}")
    require(
        scale.dim() == 1
        and scale.shape[0] in (1, n)
        and scale.dtype in (torch.float32, torch.int64, torch.bfloat16),
        QMM,
        "QMM.scale",
        f"scale {tuple(scale.shape)} {scale.dtype} for n={n}",
    )
    if scale.dtype == torch.int64:
        raise unmodelled(QMM, "an int64 (npu_trans_quant_param) scale")
    if out_dtype not in (torch.float16, torch.bfloat16):
        raise unmodelled(QMM, f"output_dtype {out_dtype}")
    if per_token is not None:
        require(
            per_token.dtype == torch.float32 and tuple(per_token.shape) == (m,),
            QMM,
            "QMM.pertoken",
            f"pertoken_scale {tuple(per_token.shape)} {per_token.dtype} for m={m}",
        )
    if bias is not None:
        require(tuple(bias.shape) in ((n,), (1, n)), QMM, "QMM.bias", f"bias {tuple(bias.shape)} for n={n}")
    # the documented dtype combinations (Atlas A2/A3 table)
    if out_dtype == torch.bfloat16:
        ok = scale.dtype in (torch.float32, torch.bfloat16) and (
            bias is None or bias.dtype in (torch.int32, torch.bfloat16, torch.float32)
        )
    elif per_token is None:
        ok = scale.dtype == torch.float32 and (bias is None or bias.dtype == torch.int32)
    else:
        ok = scale.dtype == torch.float32 and (
            bias is None or bias.dtype in (torch.int32, torch.float16, torch.float32)
        )
    require(
        ok,
        QMM,
        "QMM.combinations",
        f"output {out_dtype}, scale {scale.dtype}, bias {None if bias is None else bias.dtype}, "
        f"pertoken_scale {'set' if per_token is not None else 'None'}",
    )
    acc = torch.mm(x1.to(torch.int32), x2.to(torch.int32))
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.reshape(n)
    out = acc.float() * scale.float()
    if per_token is not None:
        out = out * per_token.unsqueeze(1)
    if bias is not None and bias.dtype != torch.int32:
        out = out + bias.reshape(n).float()
    return out.to(out_dtype)


def npu_dynamic_quant(**a):
    op = "npu_dynamic_quant"
    _refuse_unmodelled(op, a, ("smooth_scales", "group_index"))
    x = a["input"]
    require(x.dtype in HALF_TYPES and x.dim() > 1, op, "DQ.x", f"x {x.dtype} rank {x.dim()}")
    if (
        scalar_type(a["dst_type"]) not in (None, torch.int8)
        or a["quant_mode"] != "pertoken"
        or a["dst_type_max"] != 0.0
    ):
        raise unmodelled(op, "anything but per-token int8 output")
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127
    # rounding: half to even (CANN's quantization kernels round with CAST_RINT; not stated for this op)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.round(xf / safe.unsqueeze(-1)).clamp(-128, 127).to(torch.int8)
    return y, scale


def npu_quantize(input, scales, zero_points, dtype, axis, div_mode):
    op = "npu_quantize"
    if div_mode:
        raise unmodelled(op, "div_mode=True")
    require(scalar_type(dtype) == torch.qint8, op, "QZ.dtype", f"dtype {scalar_type(dtype)}")
    require(input.dtype in (torch.float32, *HALF_TYPES), op, "QZ.dtype", f"input {input.dtype}")
    if axis == -2 or scales.dim() != 1:
        raise unmodelled(op, "anything but 1-D scales along the last axis")
    require(
        scales.shape[0] in (1, input.shape[-1]),
        op,
        "QZ.scales_shape",
        f"scales {tuple(scales.shape)} for input {tuple(input.shape)}",
    )
    require(
        zero_points is None or (zero_points.shape == scales.shape and zero_points.dtype == scales.dtype),
        op,
        "QZ.zero_points",
        f"zero_points {None if zero_points is None else (tuple(zero_points.shape), zero_points.dtype)}"
        f" vs scales {tuple(scales.shape)} {scales.dtype}",
    )
    y = input.float() * scales.float()
    if zero_points is not None:
        y = y + zero_points.float()
    # rounded half to even in float32 and saturated (CANN AscendQuantV2: CAST_RINT on A2/A3)
    return torch.round(y).clamp(-128, 127).to(torch.int8)
