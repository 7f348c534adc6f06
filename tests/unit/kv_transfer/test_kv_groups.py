"""Which layers a P/D transfer moves, read from upstream's own KV-cache config types."""

from __future__ import annotations

import torch

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)

from vllm.ascend.kv_transfer.groups import TransferGroups


def _config(groups: list[KVCacheGroupSpec]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_deepseek_v32_indexer_keys_move_with_the_latent_group():
    latent = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    keys = MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=128, dtype=torch.bfloat16, cache_role=SparseCacheRole.INDEXER
    )
    specs = {}
    for layer in range(3):
        specs[f"model.layers.{layer}.self_attn.attn"] = latent
        specs[f"model.layers.{layer}.self_attn.indexer.k_cache"] = keys
    # upstream merges layers of one type with pages of two sizes into one group
    merged = UniformTypeKVCacheSpecs.from_specs(specs)
    assert merged is not None
    groups = TransferGroups.of(_config([KVCacheGroupSpec(list(specs), merged)]))
    assert groups.indexer_layers == {f"model.layers.{layer}.self_attn.indexer.k_cache" for layer in range(3)}
    assert set(groups.layer_group) == set(specs) and set(groups.layer_group.values()) == {0}
    assert groups.backoff == 0


def test_models_without_an_indexer_have_no_indexer_layers():
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=8
    )
    groups = TransferGroups.of(
        _config([KVCacheGroupSpec(["a.attn"], full), KVCacheGroupSpec(["b.attn", "c.attn"], window)])
    )
    assert groups.indexer_layers == frozenset()
    assert groups.layer_group == {"a.attn": 0, "b.attn": 1, "c.attn": 1}
    assert groups.backoff == 1  # a window group: the prefill leaves the last prompt token
