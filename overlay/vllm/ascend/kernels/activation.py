"""SiLU-and-mul (SwiGLU): ``x [..., 2d]`` -> ``silu(x[..., :d]) * x[..., d:]`` in ``x``'s dtype,
computed in float32 and rounded once (in float32, exactly upstream's native form).

``npu_silu_and_mul``: ``torch_npu.npu_swiglu`` on the last dimension (one launch).

``reference_swigluoai_and_mul``: gpt-oss's clamped SwiGLU on interleaved gate/up columns
(the MoE experts' form; ``npu_clipped_swiglu`` is the NPU op, called in ``moe.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.ascend.kernels import pick, torch_npu


def reference_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float32)
    d = h.shape[-1] // 2
    return (F.silu(h[..., :d]) * h[..., d:]).to(x.dtype)


def npu_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return torch_npu().npu_swiglu(x, -1)


silu_and_mul = pick(reference_silu_and_mul, npu_silu_and_mul)


# gpt-oss's clamped SwiGLU (upstream's swigluoai_and_mul; npu_clipped_swiglu's defaults)
SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0


def reference_swigluoai_and_mul(
    x: torch.Tensor, alpha: float = SWIGLUOAI_ALPHA, limit: float = SWIGLUOAI_LIMIT
) -> torch.Tensor:
    """``x [..., 2d]`` with gate and up interleaved (gate at even columns): the gate is
    clamped above at ``limit``, the up part to ``[-limit, limit]``, and the result is
    ``gate * sigmoid(alpha * gate) * (up + 1)``, in float32 and rounded once."""
    h = x.to(torch.float32)
    gate = h[..., 0::2].clamp(max=limit)
    up = h[..., 1::2].clamp(min=-limit, max=limit)
    return (gate * torch.sigmoid(alpha * gate) * (up + 1)).to(x.dtype)
