"""MoE experts of msModelSlim W8A8_DYNAMIC and W4A8_DYNAMIC checkpoints.

Same kernel shape as the unquantized Ascend MoE method (``vllm/ascend/moe/method.py``):
upstream's fused-MoE layer, the Ascend communication strategies as the modular kernel's
prepare/finalize (so AllGather, AllToAll and MC2 carry these layers too), and local
experts that run the int8 math (``kernels/moe.py``: ``moe_experts_w8a8_dynamic``).
Tokens travel between ranks unquantized; each expert quantizes its rows per token.

Checkpoint tensors per expert: ``gate_proj``/``up_proj``/``down_proj`` ``.weight`` int8 and
``.weight_scale`` / ``.weight_offset`` ``[rows, 1]`` (symmetric: offsets are zero), which
upstream's expert loader stacks into ``w13_*`` ``[E, 2I, ...]`` and ``w2_*`` ``[E, H, ...]``.

W4A8_DYNAMIC (msModelSlim's per-channel format, description version "1.0.0"): ``.weight``
int8 holding two int4 per byte along the output dim (row ``2j`` in the low nibble, ``2j+1``
in the high one: ``[out/2, in]``), ``.weight_scale`` / ``.weight_offset`` ``[out, 1]``, and
``.scale_bias``, the offset term ``8 * sum_k w * scale`` the NPU's A8W4 grouped matmul adds
back: ``[out, 1]`` for gate/up, ``[H, 16]`` for down (the input dim in 16 parts, so that a
tensor-parallel rank sums the parts of its own slice).
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.utils import set_weight_attrs

from vllm.ascend.kernels.moe import (
    W4A8Weights,
    moe_experts_w4a8_dynamic,
    moe_experts_w8a8_dynamic,
    w4a8_weights,
)
from vllm.ascend.moe.experts import AscendExperts
from vllm.ascend.moe.method import AscendMoEMethod, check_activation


def register_channel_quantized_experts(
    layer,
    num_experts: int,
    hidden_size: int,
    intermediate: int,
    extra_weight_attrs: dict,
    values_per_byte: int = 1,
) -> None:
    """``w13_*`` / ``w2_*``: the int8 weight (``values_per_byte`` int4 values packed along its
    rows), its per-channel ``weight_scale`` and ``weight_offset`` ``[E, rows, 1]``."""
    shapes = {"w13": (2 * intermediate, hidden_size), "w2": (hidden_size, intermediate)}
    channel = {**extra_weight_attrs, "quant_method": FusedMoeWeightScaleSupported.CHANNEL.value}
    for name, (rows, cols) in shapes.items():
        weight = torch.nn.Parameter(
            torch.empty(num_experts, rows // values_per_byte, cols, dtype=torch.int8), requires_grad=False
        )
        layer.register_parameter(f"{name}_weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        for suffix in ("weight_scale", "weight_offset"):
            param = torch.nn.Parameter(
                torch.empty(num_experts, rows, 1, dtype=torch.float32), requires_grad=False
            )
            layer.register_parameter(f"{name}_{suffix}", param)
            set_weight_attrs(param, channel)


def drop_zero_offsets(layer, name: str, scheme: str) -> None:
    """Symmetric weights only: refuse non-zero ``<name>_weight_offset``, then drop it."""
    if torch.any(getattr(layer, f"{name}_weight_offset").data != 0):
        raise ValueError(
            f"{scheme} experts of {getattr(layer, 'layer_name', 'a MoE layer')} have "
            "non-zero weight offsets: asymmetric expert weights are not supported"
        )
    delattr(layer, f"{name}_weight_offset")


class _LayerScaledExperts(AscendExperts):
    """Local experts whose scales (and offset terms) the layer holds."""

    def __init__(self, moe_config, quant_config, layer):
        super().__init__(moe_config, quant_config)
        self._layer = layer


class AscendW8A8DynamicExperts(_LayerScaledExperts):
    """The local experts with int8 weights; the per-channel scales come from the layer."""

    def run(self, x, w1, w2, topk_weights, topk_ids, expert_map, apply_router_weight_on_input, activation):
        layer = self._layer
        return moe_experts_w8a8_dynamic(
            x,
            w1,
            w2,
            layer.w13_weight_scale,
            layer.w2_weight_scale,
            topk_weights,
            topk_ids,
            expert_map=expert_map,
            apply_router_weight_on_input=apply_router_weight_on_input,
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
        register_channel_quantized_experts(
            layer, num_experts, hidden_size, intermediate_size_per_partition, extra_weight_attrs
        )

    def get_fused_moe_quant_config(self, layer):
        return FUSED_MOE_UNQUANTIZED_CONFIG  # activations cross ranks unquantized

    def process_weights_after_loading(self, layer) -> None:
        check_activation(layer, self.moe, ("silu",))  # moe_experts_w8a8_dynamic: SwiGLU
        for name in ("w13", "w2"):
            drop_zero_offsets(layer, name, "W8A8_DYNAMIC")
            scale = getattr(layer, f"{name}_weight_scale").data.squeeze(-1).contiguous()
            setattr(layer, f"{name}_weight_scale", torch.nn.Parameter(scale, requires_grad=False))
        self.set_up_kernel(
            layer, lambda quant_config: AscendW8A8DynamicExperts(self.moe, quant_config, layer)
        )


# -- W4A8_DYNAMIC -------------------------------------------------------------------------
DOWN_OFFSET_PARTS = 16  # msModelSlim writes the down projection's offset term in 16 parts of the input dim


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """msModelSlim's packed int4 ``[..., out/2, in]`` int8 -> the values ``[..., out, in]`` int8."""
    byte = packed.to(torch.int16) & 0xFF
    low, high = byte & 0xF, byte >> 4
    values = torch.stack([low, high], dim=-2)  # [..., out/2, 2, in]
    values = torch.where(values >= 8, values - 16, values).to(torch.int8)
    return values.flatten(-3, -2)


def down_offset_term(
    parts: torch.Tensor, tp_size: int, tp_rank: int, name: str = "a MoE layer"
) -> torch.Tensor:
    """The down projection's offset term for this rank's slice of the input dim: the sum of
    the checkpoint's parts ``[..., 16]`` that fall in it."""
    if DOWN_OFFSET_PARTS % tp_size:
        raise ValueError(
            f"W4A8_DYNAMIC experts of {name}: the checkpoint splits the down projection's offset "
            f"term in {DOWN_OFFSET_PARTS} parts, which {tp_size} tensor-parallel ranks over the "
            "experts cannot share; use a tensor-parallel size dividing 16 or expert parallelism"
        )
    per_rank = DOWN_OFFSET_PARTS // tp_size
    return parts[..., tp_rank * per_rank : (tp_rank + 1) * per_rank].sum(-1)


class AscendW4A8DynamicExperts(_LayerScaledExperts):
    """The local experts with int4 weights in the form the selected kernel takes
    (``kernels/moe.py``: ``w4a8_weights``); the scales and offset terms come from the layer."""

    def run(self, x, w1, w2, topk_weights, topk_ids, expert_map, apply_router_weight_on_input, activation):
        layer = self._layer
        return moe_experts_w4a8_dynamic(
            x,
            W4A8Weights(w1, layer.w13_weight_scale, layer.w13_scale_bias),
            W4A8Weights(w2, layer.w2_weight_scale, layer.w2_scale_bias),
            topk_weights,
            topk_ids,
            expert_map=expert_map,
            apply_router_weight_on_input=apply_router_weight_on_input,
        )


class AscendW4A8DynamicMoEMethod(AscendMoEMethod, FusedMoEMethodBase):  # set-up, routing: moe/method.py
    def create_weights(
        self,
        layer,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        name = getattr(layer, "layer_name", "a MoE layer")
        if self.moe.has_bias:
            raise ValueError("W4A8_DYNAMIC MoE experts with biases are not supported on Ascend")
        if intermediate_size_per_partition % 2 or hidden_size % 2:
            raise ValueError(
                f"W4A8_DYNAMIC experts of {name}: int4 pairs need even sizes per rank (intermediate "
                f"{intermediate_size_per_partition}, hidden {hidden_size})"
            )
        # int4 pairs along the output dim: half the rows of int8
        register_channel_quantized_experts(
            layer,
            num_experts,
            hidden_size,
            intermediate_size_per_partition,
            extra_weight_attrs,
            values_per_byte=2,
        )
        # ``scale_bias`` names go through the expert loader's bias branch: gate/up are split
        # per rank like their rows; down's 16 parts load whole, each rank sums its own
        offsets = {
            "w13_scale_bias": (num_experts, 2 * intermediate_size_per_partition, 1),
            "w2_scale_bias": (num_experts, hidden_size, DOWN_OFFSET_PARTS),
        }
        for param_name, shape in offsets.items():
            param = torch.nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
            layer.register_parameter(param_name, param)
            set_weight_attrs(param, extra_weight_attrs)

    def get_fused_moe_quant_config(self, layer):
        return FUSED_MOE_UNQUANTIZED_CONFIG  # activations cross ranks unquantized

    def process_weights_after_loading(self, layer) -> None:
        check_activation(layer, self.moe, ("silu",))  # moe_experts_w4a8_dynamic: SwiGLU
        name = getattr(layer, "layer_name", "a MoE layer")
        offset_terms = {
            "w13": layer.w13_scale_bias.data.squeeze(-1),
            "w2": down_offset_term(layer.w2_scale_bias.data, self.moe.tp_size, self.moe.tp_rank, name),
        }
        for proj in ("w13", "w2"):
            drop_zero_offsets(layer, proj, "W4A8_DYNAMIC")
            values = unpack_int4_rows(getattr(layer, f"{proj}_weight").data)
            scale = getattr(layer, f"{proj}_weight_scale").data.squeeze(-1)
            prepared = w4a8_weights(values, scale, offset_terms[proj])
            for suffix, tensor in (
                ("weight", prepared.weight),
                ("weight_scale", prepared.scale),
                ("scale_bias", prepared.bias),
            ):
                setattr(layer, f"{proj}_{suffix}", torch.nn.Parameter(tensor, requires_grad=False))
        self.set_up_kernel(
            layer, lambda quant_config: AscendW4A8DynamicExperts(self.moe, quant_config, layer)
        )
