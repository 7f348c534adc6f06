"""The contract double's CPU kernels for norms: npu_rms_norm, npu_add_rms_norm."""

from __future__ import annotations

import torch

from .._rules import require
from ._common import HALF_TYPES

# -- npu_rms_norm / npu_add_rms_norm ----------------------------------------------------------------
FLOAT_TYPES = (*HALF_TYPES, torch.float32)


def _rms(x: torch.Tensor, gamma: torch.Tensor, epsilon: float):
    """RmsNorm over gamma's dimensions, in float32: (y in x's dtype, rstd float32)."""
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (h * rstd * gamma.float()).to(x.dtype), rstd


def npu_rms_norm(input, gamma, epsilon):
    op = "npu_rms_norm"
    require(
        input.dtype in FLOAT_TYPES and 2 <= input.dim() <= 8,
        op,
        "RMS.self",
        f"{input.dtype} rank {input.dim()}",
    )
    require(
        gamma.dtype == input.dtype and tuple(gamma.shape) == tuple(input.shape[input.dim() - gamma.dim() :]),
        op,
        "RMS.gamma",
        f"gamma {gamma.dtype} {tuple(gamma.shape)} for self {input.dtype} {tuple(input.shape)}",
    )
    return _rms(input, gamma, epsilon)


def npu_add_rms_norm(x1, x2, gamma, epsilon):
    op = "npu_add_rms_norm"
    for name, t in (("x1", x1), ("x2", x2)):
        require(
            t.dtype in FLOAT_TYPES and 1 <= t.dim() <= 8 and t.numel() > 0,
            op,
            "ADDRMS.x",
            f"{name} {t.dtype} {tuple(t.shape)}",
        )
    require(
        x1.shape == x2.shape and x1.dtype == x2.dtype,
        op,
        "ADDRMS.formula",
        f"x1 {x1.dtype} {tuple(x1.shape)}, x2 {x2.dtype} {tuple(x2.shape)}",
    )
    require(
        gamma.dtype == x1.dtype
        and 0 < gamma.dim() <= x1.dim()
        and tuple(gamma.shape) == tuple(x1.shape[x1.dim() - gamma.dim() :]),
        op,
        "ADDRMS.gamma",
        f"gamma {gamma.dtype} {tuple(gamma.shape)} for x1 {x1.dtype} {tuple(x1.shape)}",
    )
    s = x1.float() + x2.float()
    y, rstd = _rms(s, gamma, epsilon)
    return y.to(x1.dtype), rstd, s.to(x1.dtype)
