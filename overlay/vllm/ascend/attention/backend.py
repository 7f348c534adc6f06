"""GQA/MHA paged attention backend for Ascend, on vllm.ascend.kernels.attention.

Supports mixed prefill/decode batches, chunked prefill and prefix caching (the
kernel contract treats them alike). Decoder self-attention only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm.ascend.kernels import attention as kernels


class AscendAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16", "float32"]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "ASCEND_ATTN"

    @staticmethod
    def get_impl_cls() -> type[AscendAttentionImpl]:
        return AscendAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AscendAttentionMetadataBuilder]:
        return AscendAttentionMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # [block, token-in-block, head, K|V]: blocks flatten to token rows without a copy.
        return (KVCacheLayout.LBNHC,)


@dataclass
class AscendAttentionMetadata(AttentionMetadata):
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1], host
    seq_lens: torch.Tensor  # [num_reqs], host
    block_table: torch.Tensor  # [num_reqs, max_blocks], device


class AscendAttentionMetadataBuilder(AttentionMetadataBuilder[AscendAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        # Upstream declares __init__ abstract; the base class keeps everything needed.
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> AscendAttentionMetadata:
        m = common_attn_metadata
        return AscendAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc_cpu[: m.num_reqs + 1],
            seq_lens=m.seq_lens[: m.num_reqs].cpu(),
            block_table=m.block_table_tensor[: m.num_reqs],
        )


class AscendAttentionImpl(AttentionImpl[AscendAttentionMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto",
                 logits_soft_cap=None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **extra) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
        }
        for name, value in unsupported.items():
            if value is not None:
                raise NotImplementedError(f"Ascend attention does not support {name} yet")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"Ascend attention supports decoder self-attention only, not {attn_type}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def _split_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [blocks, heads, block_size, K|V] with LBNHC strides -> two [blocks, block_size, heads, D]
        return kv_cache.transpose(1, 2).split(self.head_size, dim=-1)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = self._split_cache(kv_cache)
        kernels.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported on Ascend")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = self._split_cache(kv_cache)
        kernels.paged_attention(
            query[:n], key_cache, value_cache, attn_metadata.block_table,
            attn_metadata.query_start_loc, attn_metadata.seq_lens, self.scale, output[:n],
        )
        return output
