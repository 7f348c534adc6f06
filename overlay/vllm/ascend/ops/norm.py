"""The out-of-tree form of upstream's ``RMSNorm``: one ``kernels.norm`` call, with or
without the residual add. What the kernels do not take (a ``variance_size`` override, no
weight, a weight of another dtype) keeps upstream's native form."""

from __future__ import annotations

import torch

from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.layernorm import RMSNorm

from vllm.ascend.kernels import norm


class AscendRMSNorm(RMSNorm):
    def forward_oot(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        weight = self.weight.data if self.has_weight else None
        if not norm.takes(x, weight, self.variance_size_override) or (
            residual is not None and residual.shape != x.shape
        ):
            return self.forward_native(x, residual)
        if residual is None:
            return norm.rms_norm(x, weight, self.variance_epsilon)
        return norm.add_rms_norm(x, residual, weight, self.variance_epsilon)


def register() -> None:
    CustomOp.register_oot(AscendRMSNorm, name="RMSNorm")
    AscendRMSNorm.name = RMSNorm.name  # register_oot renames it; custom_ops uses upstream's name
