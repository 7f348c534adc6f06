"""The Ascend forms of upstream's layer ops (overlay/vllm/ascend/ops): what upstream builds
once they are registered, and their results against upstream's own native forms (the
oracle: in float32 the reference kernels compute the same formula, so the values must be
identical), in host emulation with the reference kernels."""

from __future__ import annotations

import pytest
import torch

from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import DeepseekScalingRotaryEmbedding

from vllm.ascend.ops import register_layer_ops
from vllm.ascend.ops.norm import AscendRMSNorm
from vllm.ascend.ops.rotary import AscendRotaryForm
from vllm.ascend.step_cache import once_per_step

register_layer_ops()


def _config(custom_ops: list[str]) -> VllmConfig:
    return VllmConfig(compilation_config=CompilationConfig(custom_ops=custom_ops))


@pytest.fixture
def all_ops():
    config = _config(["all"])
    with set_current_vllm_config(config):
        yield config


def test_upstream_builds_the_ascend_forms_and_they_equal_its_native_forms(all_ops):
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5)
    norm.weight.data.normal_()
    assert isinstance(norm, AscendRMSNorm) and norm._forward_method == norm.forward_oot
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    assert torch.equal(norm(x), norm.forward_native(x))
    got, want = norm(x.clone(), residual.clone()), norm.forward_native(x.clone(), residual.clone())
    assert all(torch.equal(g, w) for g, w in zip(got, want))

    act = SiluAndMul()
    assert type(act).__name__ == "AscendSiluAndMul"
    h = torch.randn(5, 32)
    assert torch.equal(act(h), act.forward_native(h))

    positions = torch.tensor([0, 7, 3, 200, 9])
    for neox in (True, False):
        rope = get_rope(
            16, 256, is_neox_style=neox, rope_parameters={"rope_theta": 10000.0}, dtype=torch.float32
        )
        assert isinstance(rope, AscendRotaryForm)
        q, k = torch.randn(5, 4 * 16), torch.randn(5, 2 * 16)
        got, want = (
            rope(positions, q.clone(), k.clone()),
            rope.forward_native(positions, q.clone(), k.clone()),
        )
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-6)
        assert not torch.equal(got[0], q)  # it rotated


def test_scaled_rotary_variants_and_deepseek_yarn_have_the_ascend_form(all_ops):
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    rope = get_rope(16, 512, rope_parameters=llama3, dtype=torch.float32)
    assert isinstance(rope, AscendRotaryForm) and type(rope).__name__ == "AscendLlama3RotaryEmbedding"
    positions = torch.arange(300, 305)
    q = torch.randn(5, 32)
    torch.testing.assert_close(rope(positions, q.clone())[0], rope.forward_native(positions, q.clone())[0])
    yarn = {
        "rope_type": "deepseek_yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    deepseek = get_rope(16, 512, is_neox_style=False, rope_parameters=yarn, dtype=torch.float32)
    assert isinstance(deepseek, DeepseekScalingRotaryEmbedding) and isinstance(deepseek, AscendRotaryForm)
    q, k = torch.randn(5, 2, 16), torch.randn(5, 1, 16)  # its native form takes [T, N, D]
    got = deepseek(positions, q.clone(), k.clone())
    want = deepseek.forward_native(positions, q.clone(), k.clone())
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-6)
    assert not torch.equal(got[1], k)  # it rotated (with the YaRN cache's attention scaling)


def test_partial_rotary_keeps_the_native_form(all_ops):
    rope = get_rope(
        32, 128, rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5}, dtype=torch.float32
    )
    assert isinstance(rope, AscendRotaryForm) and rope.rotary_dim == 16
    positions = torch.arange(3)
    q = torch.randn(3, 64)
    assert torch.equal(rope(positions, q.clone())[0], rope.forward_native(positions, q.clone())[0])


def test_custom_ops_none_runs_upstreams_native_forms():
    with set_current_vllm_config(_config(["none"])):
        norm, act = RMSNorm(8), SiluAndMul()
        assert norm._forward_method == norm.forward_native and act._forward_method == act.forward_native
    with set_current_vllm_config(_config(["all", "-rms_norm"])):
        norm, act = RMSNorm(8), SiluAndMul()
        assert norm._forward_method == norm.forward_native and act._forward_method == act.forward_oot
    with set_current_vllm_config(_config(["none", "+silu_and_mul"])):
        norm, act = RMSNorm(8), SiluAndMul()
        assert norm._forward_method == norm.forward_native and act._forward_method == act.forward_oot


def test_once_per_step_computes_once_per_forward_context(all_ops):
    calls = []

    def compute():
        calls.append(1)
        return len(calls)

    assert once_per_step("k", compute) == 1 and once_per_step("k", compute) == 2  # no forward pass: no cache
    with set_forward_context(None, all_ops):
        assert once_per_step("k", compute) == 3 and once_per_step("k", compute) == 3
        assert once_per_step("other", compute) == 4
    with set_forward_context(None, all_ops):
        assert once_per_step("k", compute) == 5
