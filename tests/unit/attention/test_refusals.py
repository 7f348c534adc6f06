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


def _gqa(**feature):
    from vllm.config import VllmConfig, set_current_vllm_config

    args = dict(alibi_slopes=None, sliding_window=None, logits_soft_cap=None)
    args.update(feature)
    with set_current_vllm_config(VllmConfig()):  # the layer reads its parallel layout
        return AscendAttentionImpl(num_heads=2, head_size=16, scale=0.25, num_kv_heads=2, **args)


def _mla(**feature):
    args = dict(alibi_slopes=None, sliding_window=None, logits_soft_cap=None)
    args.update(feature)
    return AscendMLAImpl(
        2, 80, 0.1, 1, kv_cache_dtype="auto", attn_type="decoder", kv_sharing_target_layer_name=None, **args
    )


@pytest.mark.parametrize("build", [_gqa, _mla], ids=["gqa", "mla"])
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_each_unimplemented_feature_is_refused_when_the_layer_is_built(build, name, monkeypatch):
    if build is _gqa and name == "sliding_window":  # implemented by the reference kernels only
        monkeypatch.setenv("VLLM_ASCEND_KERNELS", "npu")
    with pytest.raises(NotImplementedError, match="does not support"):
        build(**{name: FEATURES[name]})


def test_the_reference_kernels_take_a_sliding_window(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_KERNELS", "reference")
    assert _gqa(sliding_window=64).sliding_window == 64
