"""Linear methods for msModelSlim W8A8 layers (the math is in ``kernels/quant.py``).

Static W8A8 checkpoint tensors per layer: ``weight`` int8 ``[n, k]``, ``input_scale`` and
``input_offset`` (one value), ``deq_scale`` ``[n]`` (float32, or for float16 models the
float32 bits in an int64), ``quant_bias`` int32 ``[n]`` (the float bias is folded in).
Dynamic W8A8: ``weight`` int8, ``weight_scale`` and ``weight_offset`` ``[n, 1]``
(symmetric: offsets are zero); activations are quantized per token at run time and the
float ``bias`` is added after the scales.
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    RowParallelLinear,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.parameter import (
    ChannelQuantScaleParameter,
    ModelWeightParameter,
    PerTensorScaleParameter,
)

from vllm.ascend.kernels import quant as qk


def decode_deq_scale(loaded: torch.Tensor) -> torch.Tensor:
    """msModelSlim stores ``deq_scale`` of float16 models as int64 holding the float32 bit
    pattern in its low 32 bits; float32 values pass unchanged."""
    if loaded.dtype == torch.int64:
        return (loaded & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    return loaded.to(torch.float32)


def _decoding(weight_loader):
    def load(param, loaded_weight, *args, **kwargs):
        return weight_loader(param, decode_deq_scale(loaded_weight), *args, **kwargs)

    return load


def _int8_weight(output_partition_sizes, input_size_per_partition, weight_loader) -> ModelWeightParameter:
    return ModelWeightParameter(
        data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=torch.int8),
        input_dim=1,
        output_dim=0,
        weight_loader=weight_loader,
    )


def _per_channel(output_partition_sizes, dtype, weight_loader, columns: int | None = None):
    rows = sum(output_partition_sizes)
    shape = (rows,) if columns is None else (rows, columns)
    return ChannelQuantScaleParameter(
        data=torch.empty(shape, dtype=dtype), output_dim=0, weight_loader=weight_loader
    )


def _transposed_int8(layer) -> None:
    # [n, k] as loaded -> [k, n], the layout npu_quant_matmul takes
    layer.weight = torch.nn.Parameter(layer.weight.data.t().contiguous(), requires_grad=False)


@register_weight_loader_v2_supported_method
class AscendW8A8LinearMethod(LinearMethodBase):
    """Static W8A8: per-tensor activation scale and offset from calibration."""

    def create_weights(
        self,
        layer,
        input_size_per_partition,
        output_partition_sizes,
        input_size,
        output_size,
        params_dtype,
        **extra_weight_attrs,
    ):
        loader = extra_weight_attrs["weight_loader"]
        layer.logical_widths = output_partition_sizes
        layer.register_parameter(
            "weight", _int8_weight(output_partition_sizes, input_size_per_partition, loader)
        )
        # one slot per fused shard, so that shards calibrated apart are caught after loading
        for name in ("input_scale", "input_offset"):
            layer.register_parameter(
                name,
                PerTensorScaleParameter(
                    data=torch.full((len(output_partition_sizes),), float("nan"), dtype=torch.float32),
                    weight_loader=loader,
                ),
            )
        layer.register_parameter(
            "deq_scale", _per_channel(output_partition_sizes, torch.float32, _decoding(loader))
        )
        layer.register_parameter("quant_bias", _per_channel(output_partition_sizes, torch.int32, loader))

    def process_weights_after_loading(self, layer) -> None:
        name = getattr(layer, "prefix", "") or type(layer).__name__
        for param in ("input_scale", "input_offset"):
            values = getattr(layer, param).data
            if torch.isnan(values).any():
                raise ValueError(f"W8A8 layer {name}: the checkpoint has no {param}")
            if not torch.all(values == values[0]):
                raise ValueError(
                    f"W8A8 layer {name}: its fused shards were calibrated with different "
                    f"{param} values {values.tolist()}; one activation quantization per fused "
                    "layer is required (quantize the shards with one scale)"
                )
            setattr(layer, param, torch.nn.Parameter(values[:1].clone(), requires_grad=False))
        _transposed_int8(layer)
        layer.ascend_static_params = qk.static_params(
            layer.input_scale, layer.input_offset, layer.weight.shape[0]
        )
        # a row-parallel layer's partial sums are all-reduced: only one rank adds the bias
        layer.ascend_adds_quant_bias = not (isinstance(layer, RowParallelLinear) and layer.tp_rank > 0)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # ``bias`` is already in quant_bias; the output takes the activations' dtype (the
        # layers get float16/bfloat16 activations, never pre-quantized int8 ones)
        x_q = qk.quantize_static(x, *layer.ascend_static_params)
        quant_bias = layer.quant_bias if layer.ascend_adds_quant_bias else None
        return qk.matmul_static(x_q, layer.weight, layer.deq_scale, quant_bias, x.dtype)


@register_weight_loader_v2_supported_method
class AscendW8A8DynamicLinearMethod(LinearMethodBase):
    """Dynamic W8A8: per-channel symmetric weights, activations quantized per token."""

    def create_weights(
        self,
        layer,
        input_size_per_partition,
        output_partition_sizes,
        input_size,
        output_size,
        params_dtype,
        **extra_weight_attrs,
    ):
        loader = extra_weight_attrs["weight_loader"]
        layer.logical_widths = output_partition_sizes
        layer.register_parameter(
            "weight", _int8_weight(output_partition_sizes, input_size_per_partition, loader)
        )
        layer.register_parameter(
            "weight_scale", _per_channel(output_partition_sizes, torch.float32, loader, 1)
        )
        layer.register_parameter(
            "weight_offset", _per_channel(output_partition_sizes, torch.float32, loader, 1)
        )

    def process_weights_after_loading(self, layer) -> None:
        if torch.any(layer.weight_offset.data != 0):
            name = getattr(layer, "prefix", "") or type(layer).__name__
            raise ValueError(
                f"W8A8_DYNAMIC layer {name} has non-zero weight_offset values: asymmetric "
                "per-channel weights are not supported (msModelSlim writes zeros)"
            )
        layer.weight_scale = torch.nn.Parameter(
            layer.weight_scale.data.flatten().clone(), requires_grad=False
        )
        del layer.weight_offset
        _transposed_int8(layer)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x_q, token_scale = qk.quantize_dynamic(x)
        return qk.matmul_dynamic(x_q, layer.weight, layer.weight_scale, token_scale, bias, x.dtype)
