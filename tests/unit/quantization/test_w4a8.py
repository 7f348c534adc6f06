"""msModelSlim's per-channel W4A8_DYNAMIC expert format: what the quantizer writes, what
the loader reads back, what the oracle reads back (each unpacks on its own), and the
checkpoints the description refuses."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.support.models import ROOT
from tests.support.quant_reference import int4_rows
from vllm.ascend.quantization.description import DescriptionError, QuantDescription
from vllm.ascend.quantization.moe import DOWN_OFFSET_PARTS, down_offset_term, unpack_int4_rows


@pytest.fixture(scope="module")
def quantizer():
    spec = importlib.util.spec_from_file_location(
        "quantize_tiny_model", ROOT / "examples" / "quantize_tiny_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("proj", ["gate_proj", "down_proj"])
def test_the_written_expert_reads_back_as_its_int4_values(quantizer, proj):
    torch.manual_seed(0)
    out, inner = 48, 64
    weight = torch.randn(out, inner)
    tensors = quantizer.quantize_w4a8(f"model.layers.1.mlp.experts.0.{proj}.weight", weight)
    packed, scale = tensors["weight"], tensors["weight_scale"]
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (out // 2, inner)  # two int4 a byte
    assert tuple(scale.shape) == (out, 1) and not tensors["weight_offset"].any()
    values = unpack_int4_rows(packed)
    assert values.dtype == torch.int8 and int(values.min()) >= -8 and int(values.max()) <= 7
    assert torch.equal(values.to(torch.int64), int4_rows(packed))  # loader and oracle agree
    # the values are the int4 rounding of the weight: within half a step of every entry
    assert (values.float() * scale - weight).abs().le(scale / 2 + 1e-6).all()
    total = 8 * (values.double() * scale.double()).sum(-1)
    parts = tensors["scale_bias"]
    assert tuple(parts.shape) == ((out, DOWN_OFFSET_PARTS) if proj == "down_proj" else (out, 1))
    torch.testing.assert_close(parts.double().sum(-1), total, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_each_tensor_parallel_rank_gets_the_offset_term_of_its_own_inputs(tp_size):
    """The down projection is split along its input dim over the ranks; the 16 parts of its
    offset term split along the same dim, so a rank's term is the sum over its slice."""
    torch.manual_seed(1)
    hidden, inner = 8, 64
    values = torch.randint(-8, 8, (hidden, inner)).double()
    scale = torch.rand(hidden, 1).double()
    parts = 8 * (values * scale).view(hidden, DOWN_OFFSET_PARTS, -1).sum(-1)
    width = inner // tp_size
    for rank in range(tp_size):
        mine = 8 * (values[:, rank * width : (rank + 1) * width] * scale).sum(-1)
        torch.testing.assert_close(down_offset_term(parts, tp_size, rank), mine)
    with pytest.raises(ValueError, match="16 parts, which 3 tensor-parallel ranks"):
        down_offset_term(parts, 3, 0)


@pytest.mark.parametrize(
    "meta, message",
    [
        ({"version": "1.0.0", "group_size": 64}, "group_size 64"),
        ({"version": "0.1.0", "group_size": 0}, "version '0.1.0'"),
    ],
)
def test_the_description_refuses_w4a8_formats_other_than_per_channel(meta, message):
    entries = {"model.layers.1.mlp.experts.0.gate_proj.weight": "W4A8_DYNAMIC"}
    assert (
        QuantDescription({"version": "1.0.0", "group_size": 0, **entries}).experts_scheme(
            "model.layers.1.mlp.experts"
        )
        == "W4A8_DYNAMIC"
    )
    with pytest.raises(DescriptionError, match=f"per-channel format.*{message}"):
        QuantDescription({**meta, **entries})
