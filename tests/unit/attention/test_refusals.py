"""The attention backends refuse, when a layer is built, every feature they do not
implement; none is accepted and ignored (a model the start-up check misses still stops)."""

from __future__ import annotations

import pytest
import torch

from vllm.ascend.attention.backend import AscendAttentionImpl
from vllm.ascend.attention.mla import AscendMLAImpl

FEATURES = {
    "alibi_slopes": [0.5, 0.25],
    "sliding_window": 64,
    "logits_soft_cap": 30.0,
    "sinks": torch.zeros(2),
}


def _gqa(head_size=16, **feature):
    from vllm.config import VllmConfig, set_current_vllm_config

    args = dict(alibi_slopes=None, sliding_window=None, logits_soft_cap=None)
    args.update(feature)
    with set_current_vllm_config(VllmConfig()):  # the layer reads its parallel layout
        return AscendAttentionImpl(num_heads=2, head_size=head_size, scale=0.25, num_kv_heads=2, **args)


def _mla(**feature):
    args = dict(alibi_slopes=None, sliding_window=None, logits_soft_cap=None)
    args.update(feature)
    return AscendMLAImpl(
        2, 80, 0.1, 1, kv_cache_dtype="auto", attn_type="decoder", kv_sharing_target_layer_name=None, **args
    )


# GQA layers take sliding windows (test_both_kernel_sets_take_a_sliding_window), sinks
# (test_both_kernel_sets_take_sinks) and, with the reference kernels, soft-capping
# (test_soft_capping_needs_the_reference_kernels)
TAKEN = {(_gqa, "sliding_window"), (_gqa, "logits_soft_cap"), (_gqa, "sinks")}
REFUSED = [(b, n) for b in (_gqa, _mla) for n in sorted(FEATURES) if (b, n) not in TAKEN]


@pytest.mark.parametrize("build, name", REFUSED, ids=[f"{b.__name__[1:]}-{n}" for b, n in REFUSED])
def test_each_unimplemented_feature_is_refused_when_the_layer_is_built(build, name):
    with pytest.raises(NotImplementedError, match="does not support"):
        build(**{name: FEATURES[name]})


@pytest.mark.parametrize("kernels", ["reference", "npu"])
def test_both_kernel_sets_take_a_sliding_window(kernels, monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_KERNELS", kernels)
    assert _gqa(sliding_window=64).sliding_window == 64


def test_soft_capping_needs_the_reference_kernels(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_KERNELS", "reference")
    assert _gqa(logits_soft_cap=30.0).soft_cap == 30.0
    assert _gqa(logits_soft_cap=0).soft_cap is None  # upstream's "no cap"
    monkeypatch.setenv("VLLM_ASCEND_KERNELS", "npu")
    with pytest.raises(NotImplementedError, match="logits_soft_cap with the NPU kernels"):
        _gqa(logits_soft_cap=30.0)


@pytest.mark.parametrize("kernels", ["reference", "npu"])
def test_both_kernel_sets_take_sinks(kernels, monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_KERNELS", kernels)
    sinks = torch.zeros(2)
    assert _gqa(sinks=sinks).sinks is sinks
    if kernels == "npu":  # the fused attention's learnable_sink: value head size at most 128
        with pytest.raises(NotImplementedError, match="head size of at most 128, not 256"):
            _gqa(head_size=256, sinks=sinks)
    else:
        assert _gqa(head_size=256, sinks=sinks).sinks is sinks
