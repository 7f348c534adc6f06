"""The out-of-tree form of upstream's ``SiluAndMul``: one ``kernels.activation`` call."""

from __future__ import annotations

import torch

from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.activation import SiluAndMul

from vllm.ascend.kernels import activation


class AscendSiluAndMul(SiluAndMul):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        return activation.silu_and_mul(x)


def register() -> None:
    CustomOp.register_oot(AscendSiluAndMul, name="SiluAndMul")
    AscendSiluAndMul.name = SiluAndMul.name  # register_oot renames it; custom_ops uses upstream's name
