"""The Ascend punica wrapper: upstream's PyTorch-native LoRA kernels (its CPU wrapper),
with prefill batches taking the per-token path as decode does.

Upstream's native prefill path expands each request's adapter index to its tokens with
``repeat_interleave`` over a device tensor of lengths, once per LoRA layer, which (by
torch's documentation) reads the output size back to the host: a synchronisation per
layer. The per-token adapter indices upstream already builds once per step
(``token_lora_indices``) give the same rows, so every shrink and expand here gathers by them. The ops are plain torch,
so host emulation, NPU-path mode and an NPU run the same code (on an NPU as torch ops on
the device; not run on an NPU here)."""

from __future__ import annotations

import torch

from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU


class PunicaWrapperNPU(PunicaWrapperCPU):
    def _shrink_prefill(self, y: torch.Tensor, x: torch.Tensor, w_t_all: torch.Tensor, scale: float):
        if not self.no_lora:
            self._shrink_decode(y, x, w_t_all, scale)

    def _expand_prefill(self, y: torch.Tensor, x: torch.Tensor, w_t_all: torch.Tensor, add_inputs: bool):
        if not self.no_lora:
            self._expand_decode(y, x, w_t_all, add_inputs)

    def _expand_slice_prefill(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        w_t_all: torch.Tensor,
        y_offset: int,
        y_slice_size: int,
        add_inputs: bool,
    ):
        if not self.no_lora:
            self._expand_slice_decode(y, x, w_t_all, y_offset, y_slice_size, add_inputs)
