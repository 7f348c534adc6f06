"""RMSNorm, alone and after a residual add.

Contract (upstream vLLM's ``rms_norm`` / ``fused_add_rms_norm`` IR ops, without the
``variance_size`` override): ``x [..., H]``, ``weight [H]`` of ``x``'s dtype;
``rms_norm`` returns ``weight * x / sqrt(mean(x^2) + eps)`` in ``x``'s dtype, computed in
float32; ``add_rms_norm`` first forms ``s = x + residual`` and returns
``(rms_norm(s), s)`` (the sum is the next layer's residual). Both forms round once, at
the end (upstream's native form also rounds before the weight multiply); in float32 the
two agree exactly.

``npu_*``: ``torch_npu.npu_rms_norm`` and ``torch_npu.npu_add_rms_norm`` (one launch each,
in place of the seven to nine the plain form takes).
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import pick, torch_npu


def _normed(s: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    h = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (h * weight.to(torch.float32)).to(dtype)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _normed(x.to(torch.float32), weight, eps, x.dtype)


def reference_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.to(torch.float32) + residual.to(torch.float32)
    return _normed(s, weight, eps, x.dtype), s.to(x.dtype)


def npu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch_npu().npu_rms_norm(x, weight, eps)[0]


def npu_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, s = torch_npu().npu_add_rms_norm(x, residual, weight, eps)
    return y, s


def takes(x: torch.Tensor, weight: torch.Tensor | None, variance_size: int | None) -> bool:
    """What both forms implement: a weight of ``x``'s dtype (torch_npu: "gamma ... 数据类型
    需要和self保持一致"), the whole last dimension in the variance, and a float dtype."""
    return (
        variance_size is None
        and weight is not None
        and weight.dtype == x.dtype
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and x.numel() > 0
    )


rms_norm = pick(reference_rms_norm, npu_rms_norm)
add_rms_norm = pick(reference_add_rms_norm, npu_add_rms_norm)
