"""The W8A8 layer methods against a plainly written dequantize-then-matmul reference in
float64, and the description's start-up errors.

Tolerances come from the int8 math: a static layer folds its float bias into an integer
``quant_bias``, so its output may differ from the dequantized reference by half a
``deq_scale`` step per channel; otherwise only float32 rounding of the output remains.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.ascend.kernels.moe import reference_moe_experts_w8a8_dynamic
from vllm.ascend.quantization.description import DescriptionError, QuantDescription
from vllm.ascend.quantization.linear import (
    AscendW8A8DynamicLinearMethod,
    AscendW8A8LinearMethod,
    decode_deq_scale,
)

FLOAT32_RELATIVE = 1e-5


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    """The methods here run the reference int8 kernels, whatever this process bound (a
    process without host emulation binds the NPU forms, which take half types; they are
    held to the reference forms in tests/unit/kernels/test_npu_kernels.py)."""
    from vllm.ascend.kernels import quant

    for name in ("static_params", "quantize_static", "quantize_dynamic", "matmul_static", "matmul_dynamic"):
        monkeypatch.setattr(quant, name, getattr(quant, f"reference_{name}"))


def _per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8), scale


def _layer(**params) -> torch.nn.Module:
    layer = torch.nn.Module()
    for name, value in params.items():
        layer.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))
    return layer


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 7),
    k=st.sampled_from([8, 40]),
    n=st.sampled_from([4, 24]),
    shards=st.sampled_from([1, 3]),
)
def test_static_w8a8_equals_dequantized_reference(seed, rows, k, n, shards):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 3
    w_q, w_scale = _per_channel(torch.randn(n, k, generator=g))
    bias = torch.randn(n, generator=g)
    in_scale, in_offset = 0.05, 7.0
    deq = (in_scale * w_scale).float()
    quant_bias = torch.round(bias.double() / deq.double() - in_offset * w_q.double().sum(1)).to(torch.int32)
    layer = _layer(
        weight=w_q,
        input_scale=torch.full((shards,), in_scale),
        input_offset=torch.full((shards,), in_offset),
        deq_scale=deq,
        quant_bias=quant_bias,
    )
    method = AscendW8A8LinearMethod()
    method.process_weights_after_loading(layer)
    got = method.apply(layer, x, bias).double()
    # reference: dequantize activations and weights, multiply in float64, add the float bias
    x_q = torch.clamp(torch.round(x / torch.tensor(in_scale) + in_offset), -128, 127).double()
    ref = ((x_q - in_offset) * in_scale) @ (w_q.double() * w_scale.double()[:, None]).t() + bias.double()
    tolerance = 0.5 * deq.double() + FLOAT32_RELATIVE * ref.abs()
    assert torch.all((got - ref).abs() <= tolerance), (got - ref).abs().max()


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 7),
    k=st.sampled_from([8, 40]),
    n=st.sampled_from([4, 24]),
    with_bias=st.booleans(),
)
def test_dynamic_w8a8_equals_dequantized_reference(seed, rows, k, n, with_bias):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 3
    x[0] = 0.0  # an all-zero token quantizes to zeros
    w_q, w_scale = _per_channel(torch.randn(n, k, generator=g))
    bias = torch.randn(n, generator=g) if with_bias else None
    layer = _layer(weight=w_q, weight_scale=w_scale[:, None].float(), weight_offset=torch.zeros(n, 1))
    method = AscendW8A8DynamicLinearMethod()
    method.process_weights_after_loading(layer)
    got = method.apply(layer, x, bias).double()
    token_scale = x.abs().amax(dim=1, keepdim=True) / 127
    x_q = torch.round(x / torch.where(token_scale > 0, token_scale, 1)).clamp(-128, 127)
    ref = (x_q.double() * token_scale.double()) @ (w_q.double() * w_scale.double()[:, None]).t()
    if bias is not None:
        ref = ref + bias.double()
    terms = (x_q.double().abs() * token_scale.double()) @ (w_q.double().abs() * w_scale.double()[:, None]).t()
    assert torch.all((got - ref).abs() <= FLOAT32_RELATIVE * (terms + ref.abs()) + 1e-12)
    assert torch.equal(got[0], bias.double() if bias is not None else torch.zeros(n, dtype=torch.float64))


def test_w8a8_dynamic_experts_equal_dequantized_reference():
    """Per expert: per-token quantization, dequantized gate/up, SwiGLU (in float32, as the
    layer's activations are), per-token quantization again, dequantized down projection,
    weighted sum. Where float32 and float64 put the SwiGLU output on different sides of a
    rounding boundary, one int8 step moves: the bound allows two such steps per expert."""
    g = torch.Generator().manual_seed(0)
    tokens, experts, top_k, hidden, inter = 12, 6, 2, 32, 16
    x = torch.randn(tokens, hidden, generator=g)
    w13, s13 = zip(*(_per_channel(torch.randn(2 * inter, hidden, generator=g)) for _ in range(experts)))
    w2, s2 = zip(*(_per_channel(torch.randn(hidden, inter, generator=g) * 0.3) for _ in range(experts)))
    w13, s13, w2, s2 = torch.stack(w13), torch.stack(s13), torch.stack(w2), torch.stack(s2)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    got = reference_moe_experts_w8a8_dynamic(x, w13, w2, s13, s2, weights, ids).double()

    def quantize(v):
        scale = v.abs().amax(dim=1, keepdim=True) / 127
        return torch.round(v / scale).clamp(-128, 127).double(), scale.double()

    ref = torch.zeros(tokens, hidden, dtype=torch.float64)
    bound = torch.zeros(tokens, 1, dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            h_q, h_s = quantize(x[t : t + 1])
            gate_up = (h_q * h_s) @ (w13[e].double() * s13[e].double()[:, None]).t()
            act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).float()
            a_q, a_s = quantize(act)
            down = w2[e].double() * s2[e].double()[:, None]
            ref[t] += weights[t, j].double() * ((a_q * a_s) @ down.t())[0]
            bound[t] += 2 * weights[t, j].double() * a_s[0, 0] * down.abs().max()
    assert torch.all((got - ref).abs() <= bound + FLOAT32_RELATIVE * ref.abs()), (got - ref).abs().max()


def test_static_layer_refuses_shards_calibrated_apart_and_missing_scales():
    base = dict(
        weight=torch.ones(4, 8, dtype=torch.int8),
        input_offset=torch.zeros(2),
        deq_scale=torch.ones(4),
        quant_bias=torch.zeros(4, dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="different input_scale"):
        AscendW8A8LinearMethod().process_weights_after_loading(
            _layer(input_scale=torch.tensor([0.1, 0.2]), **base)
        )
    with pytest.raises(ValueError, match="no input_scale"):
        AscendW8A8LinearMethod().process_weights_after_loading(
            _layer(input_scale=torch.tensor([float("nan"), 0.1]), **base)
        )
    with pytest.raises(ValueError, match="weight_offset"):
        AscendW8A8DynamicLinearMethod().process_weights_after_loading(
            _layer(
                weight=torch.ones(4, 8, dtype=torch.int8),
                weight_scale=torch.ones(4, 1),
                weight_offset=torch.ones(4, 1),
            )
        )


def test_float16_deq_scale_is_decoded_from_its_int64_bits():
    values = torch.tensor([0.5, 1.25e-3, 3.0e-7])
    encoded = values.view(torch.int32).to(torch.int64)  # msModelSlim's encoding for float16 models
    assert torch.equal(decode_deq_scale(encoded), values)
    assert torch.equal(decode_deq_scale(values), values)


DESCRIPTION = {
    "model_quant_type": "W8A8",
    "version": "1.0.0",
    "group_size": 0,
    "metadata": {"x": 1},
    "model.layers.0.self_attn.q_proj.weight": "W8A8",
    "model.layers.0.self_attn.k_proj.weight": "W8A8",
    "model.layers.0.self_attn.v_proj.weight": "W8A8",
    "model.layers.0.mlp.gate_proj.weight": "W8A8_DYNAMIC",
    "model.layers.0.mlp.up_proj.weight": "W8A8",
    "model.layers.0.mlp.down_proj.weight": "FLOAT",
    "model.layers.1.mlp.experts.0.gate_proj.weight": "W8A8_DYNAMIC",
    "model.layers.1.mlp.experts.1.down_proj.weight": "W8A8_DYNAMIC",
    "model.layers.2.mlp.experts.0.gate_proj.weight": "W8A8_DYNAMIC",
    "model.layers.2.mlp.experts.1.gate_proj.weight": "FLOAT",
    "model.layers.3.shared_head.head.weight": "FLOAT",
}
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_description_decides_each_layer_and_names_what_it_cannot():
    d = QuantDescription(DESCRIPTION)
    assert d.layer_scheme("model.layers.0.self_attn.qkv_proj", PACKED) == "W8A8"
    assert d.layer_scheme("model.layers.0.mlp.down_proj", PACKED) == "FLOAT"
    assert d.experts_scheme("model.layers.1.mlp.experts") == "W8A8_DYNAMIC"
    assert d.tensor_scheme("model.layers.3.head.weight") == "FLOAT"  # vLLM's prefix of the MTP head
    with pytest.raises(DescriptionError, match="gate_up_proj.*gate_proj: W8A8_DYNAMIC, up_proj: W8A8"):
        d.layer_scheme("model.layers.0.mlp.gate_up_proj", PACKED)
    with pytest.raises(DescriptionError, match="no entry for the layer model.layers.0.self_attn.o_proj"):
        d.layer_scheme("model.layers.0.self_attn.o_proj", PACKED)
    with pytest.raises(DescriptionError, match="experts of model.layers.2.mlp.experts mix schemes"):
        d.experts_scheme("model.layers.2.mlp.experts")
    with pytest.raises(DescriptionError, match="no entries for the experts of model.layers.9.mlp.experts"):
        d.experts_scheme("model.layers.9.mlp.experts")
    with pytest.raises(
        DescriptionError, match="model.layers.0.o_proj.weight uses the quantization scheme 'W8A16'"
    ):
        QuantDescription({**DESCRIPTION, "model.layers.0.o_proj.weight": "W8A16"})


def test_the_config_refuses_a_quantized_eh_proj():
    from vllm.ascend.quantization.config import AscendQuantConfig

    config = AscendQuantConfig.from_config(DESCRIPTION)
    assert config.get_name() == "ascend" and config.get_config_filenames() == ["quant_model_description.json"]
    with pytest.raises(DescriptionError, match="model.layers.3.eh_proj.weight is quantized"):
        AscendQuantConfig.from_config({**DESCRIPTION, "model.layers.3.eh_proj.weight": "W8A8_DYNAMIC"})


@pytest.mark.parametrize("projection", ["wk", "weights_proj"])
def test_the_config_refuses_quantized_indexer_key_projections(projection):
    """DeepSeek-V3.2's indexer: wq_b follows the description, wk and weights_proj are float."""
    from vllm.ascend.quantization.config import AscendQuantConfig

    indexer = "model.layers.0.self_attn.indexer"
    AscendQuantConfig.from_config({**DESCRIPTION, f"{indexer}.wq_b.weight": "W8A8_DYNAMIC"})
    with pytest.raises(DescriptionError, match=rf"{indexer}\.{projection}\.weight is quantized.*mark them"):
        AscendQuantConfig.from_config({**DESCRIPTION, f"{indexer}.{projection}.weight": "W8A8_DYNAMIC"})
