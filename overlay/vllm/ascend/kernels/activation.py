"""SiLU-and-mul (SwiGLU): ``x [..., 2d]`` -> ``silu(x[..., :d]) * x[..., d:]`` in ``x``'s dtype,
computed in float32 and rounded once (in float32, exactly upstream's native form).

``npu_silu_and_mul``: ``torch_npu.npu_swiglu`` on the last dimension (one launch).
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
