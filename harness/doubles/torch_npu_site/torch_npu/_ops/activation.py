"""The contract double's CPU kernels for activations: npu_swiglu, npu_clipped_swiglu."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._rules import require, unmodelled
from ._common import HALF_TYPES


# -- npu_swiglu -----------------------------------------------------------------------------------
def npu_swiglu(input, dim):
    require(
        input.dtype in (*HALF_TYPES, torch.float32) and 1 <= input.dim() <= 8,
        "npu_swiglu",
        "SWIGLU.dtype",
        f"{input.dtype} rank {input.dim()}",
    )
    a, b = input.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(input.dtype)


# -- npu_clipped_swiglu ----------------------------------------------------------------------------
def npu_clipped_swiglu(x, group_index, dim, alpha, limit, bias, interleaved):
    op = "npu_clipped_swiglu"
    if group_index is not None:
        raise unmodelled(op, "group_index")
    require(
        x.dtype in (*HALF_TYPES, torch.float32)
        and x.is_contiguous()
        and x.dim() > 1
        and -x.dim() <= dim < x.dim()
        and x.shape[dim] % 2 == 0,
        op,
        "CSWIGLU.x",
        f"x {tuple(x.shape)} {x.dtype}, contiguous={x.is_contiguous()}, dim={dim}",
    )
    h = x.float().movedim(dim, -1)
    if interleaved:
        a_half, b_half = h[..., 0::2], h[..., 1::2]
    else:
        a_half, b_half = h.chunk(2, dim=-1)
    a_half = a_half.clamp(max=limit)
    b_half = b_half.clamp(min=-limit, max=limit)
    y = a_half * torch.sigmoid(alpha * a_half) * (b_half + bias)
    return y.movedim(-1, dim).contiguous().to(x.dtype)
