"""MoE experts of msModelSlim W8A8_DYNAMIC checkpoints.

Same kernel shape as the unquantized Ascend MoE method (``vllm/ascend/moe/method.py``):
upstream's fused-MoE layer, the Ascend communication strategies as the modular kernel's
prepare/finalize (so AllGather, AllToAll and MC2 carry these layers too), and local
experts that run the int8 math (``kernels/moe.py``: ``moe_experts_w8a8_dynamic``).
Tokens travel between ranks unquantized; each expert quantizes its rows per token.

Checkpoint tensors per expert: ``gate_proj``/``up_proj``/``down_proj`` ``.weight`` int8 and
``.weight_scale`` / ``.weight_offset`` ``[rows, 1]`` (symmetric: offsets are zero), which
upstream's expert loader stacks into ``w13_*`` ``[E, 2I, ...]`` and ``w2_*`` ``[E, H, ...]``.
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.utils import set_weight_attrs

from vllm.ascend.kernels.moe import moe_experts_w8a8_dynamic
from vllm.ascend.moe.experts import AscendExperts
from vllm.ascend.moe.method import AscendMoEMethod, check_activation


class AscendW8A8DynamicExperts(AscendExperts):
    """The local experts with int8 weights; the per-channel scales come from the layer."""

    def __init__(self, moe_config, quant_config, layer):
        super().__init__(moe_config, quant_config)
        self._layer = layer

    def apply(
        self,
        output,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        a1q_scale,
        a2_scale,
        workspace13,
        workspace2,
        expert_tokens_meta,
        apply_router_weight_on_input,
    ):
        output.copy_(
            moe_experts_w8a8_dynamic(
                hidden_states,
                w1,
                w2,
                self._layer.w13_weight_scale,
                self._layer.w2_weight_scale,
                topk_weights,
                topk_ids,
                expert_map=expert_map,
                apply_router_weight_on_input=apply_router_weight_on_input,
            )
        )


class AscendW8A8DynamicMoEMethod(AscendMoEMethod, FusedMoEMethodBase):  # set-up, routing: moe/method.py
    def create_weights(
        self,
        layer,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        if self.moe.has_bias:
            raise ValueError("W8A8_DYNAMIC MoE experts with biases are not supported on Ascend")
        gate_up = 2 * intermediate_size_per_partition
        shapes = {"w13": (gate_up, hidden_size), "w2": (hidden_size, intermediate_size_per_partition)}
        channel = {**extra_weight_attrs, "quant_method": FusedMoeWeightScaleSupported.CHANNEL.value}
        for name, (rows, cols) in shapes.items():
            weight = torch.nn.Parameter(
                torch.empty(num_experts, rows, cols, dtype=torch.int8), requires_grad=False
            )
            layer.register_parameter(f"{name}_weight", weight)
            set_weight_attrs(weight, extra_weight_attrs)
            for suffix in ("weight_scale", "weight_offset"):
                param = torch.nn.Parameter(
                    torch.empty(num_experts, rows, 1, dtype=torch.float32), requires_grad=False
                )
                layer.register_parameter(f"{name}_{suffix}", param)
                set_weight_attrs(param, channel)

    def get_fused_moe_quant_config(self, layer):
        return FUSED_MOE_UNQUANTIZED_CONFIG  # activations cross ranks unquantized

    def process_weights_after_loading(self, layer) -> None:
        check_activation(layer, self.moe, ("silu",))  # moe_experts_w8a8_dynamic: SwiGLU
        for name in ("w13", "w2"):
            if torch.any(getattr(layer, f"{name}_weight_offset").data != 0):
                raise ValueError(
                    f"W8A8_DYNAMIC experts of {getattr(layer, 'layer_name', 'a MoE layer')} have "
                    "non-zero weight offsets: asymmetric expert weights are not supported"
                )
            scale = getattr(layer, f"{name}_weight_scale").data.squeeze(-1).contiguous()
            setattr(layer, f"{name}_weight_scale", torch.nn.Parameter(scale, requires_grad=False))
            delattr(layer, f"{name}_weight_offset")
        self.set_up_kernel(
            layer, lambda quant_config: AscendW8A8DynamicExperts(self.moe, quant_config, layer)
        )
