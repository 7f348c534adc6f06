"""The KV-cache groups a P/D transfer moves, read once from vLLM's ``KVCacheConfig`` (pure).

With upstream's hybrid KV-cache manager a model with several attention types keeps one
block table per group (Gemma 3: its sliding-window layers in one group, its full-attention
layers in another); the connector moves every group that takes part in KV transfer, each
layer by its own group's table.

A sliding-window group frees the blocks of tokens that fall out of the window of the next
token to compute. Prefill finishes with every prompt token computed, so it keeps the
window of token N (keys from N - W + 1); but the decode side recomputes the prompt's last
token N - 1 itself (upstream rewinds a fully loaded prompt by one to sample from it), whose
window starts a token earlier, at N - W. When that key is the last of its block, the
prefill side has freed the block. So with such a group the prefill side computes one token fewer
(``backoff``): it keeps the window of token N - 1, hands over N - 1 tokens, and the decode
side computes token N - 1 as upstream's NIXL connector arranges for its own back-off.

DeepSeek V3.2's indexer keys are layers of the latent cache's group (one block table) with
a cache of their own (``attention/sparse_mla.py``): they move with the latent, as one plane.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # upstream's type, for the annotations only
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class TransferGroups:
    ids: tuple[int, ...]  # the config's group ids that are transferred, in block-table order
    layer_group: dict  # layer name -> index into ``ids``
    windowed: bool  # some transferred group frees blocks before a window
    indexer_layers: frozenset = frozenset()  # layers holding indexer keys: one plane each

    @property
    def backoff(self) -> int:
        """Prompt tokens the prefill side leaves to the decode side."""
        return 1 if self.windowed else 0

    @classmethod
    def of(cls, kv_cache_config: KVCacheConfig | None) -> TransferGroups:
        from vllm.v1.kv_cache_interface import (
            ChunkedLocalAttentionSpec,
            SlidingWindowSpec,
            SparseCacheRole,
            UniformTypeKVCacheSpecs,
        )

        if kv_cache_config is None:
            raise ValueError(
                "AscendP2PConnector needs the engine's KV-cache config (upstream passes it to every "
                "connector it builds); it was built without one"
            )
        ids = tuple(kv_cache_config.transfer_group_ids)
        groups = [kv_cache_config.kv_cache_groups[g] for g in ids]
        sizes = {g.kv_cache_spec.block_size for g in groups}
        if len(sizes) > 1:
            raise ValueError(
                f"AscendP2PConnector moves KV-cache groups of one block size; this model's groups "
                f"have block sizes {sorted(sizes)}"
            )
        windowed = any(
            isinstance(g.kv_cache_spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)) for g in groups
        )
        layer_group = {name: index for index, g in enumerate(groups) for name in g.layer_names}

        def layer_specs(group) -> dict:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):  # layers of one type, pages of several sizes
                return spec.kv_cache_specs
            return dict.fromkeys(group.layer_names, spec)

        indexer = frozenset(
            name
            for g in groups
            for name, spec in layer_specs(g).items()
            if getattr(spec, "cache_role", None) == SparseCacheRole.INDEXER
        )
        return cls(ids, layer_group, windowed, indexer)
