"""GQA/MHA paged attention backend for Ascend, on vllm.ascend.kernels.attention.

Supports mixed prefill/decode batches, chunked prefill and prefix caching (the
kernel contract treats them alike). Decoder self-attention only. The cache is read
as K and V planes (``kv_layout.py``); host lists of the per-request query starts
and sequence lengths are built once per step in the metadata builder.
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

from vllm.ascend.attention.kv_layout import gqa_planes
from vllm.ascend.kernels import attention as kernels


class AscendAttentionBackend(AttentionBackend):
    # What the backend code handles; the platform narrows it to what the selected
    # kernels take (float16/bfloat16 for the torch_npu kernels).
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

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return kernels.supported_block_sizes()

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Layer-compact and unpadded: each layer's region is contiguous, so it splits
        # into the K and V planes without a copy.
        return (KVCacheLayout.LBHNC,)


@dataclass
class AscendAttentionMetadata(AttentionMetadata):
    num_actual_tokens: int
    query_start_loc: list[int]  # [num_reqs + 1], host
    seq_lens: list[int]  # [num_reqs], host
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, device


class AscendAttentionMetadataBuilder(AttentionMetadataBuilder[AscendAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        # Upstream declares __init__ abstract; the base class keeps everything needed.
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> AscendAttentionMetadata:
        m = common_attn_metadata
        return AscendAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc_cpu[: m.num_reqs + 1].tolist(),
            seq_lens=m.seq_lens[: m.num_reqs].cpu().tolist(),
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
            raise NotImplementedError(
                f"Ascend attention supports decoder self-attention only, not {attn_type}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def _planes(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gqa_planes(kv_cache, self.head_size, kv_cache.shape[-1] - self.head_size)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if kv_cache.numel() == 0:  # no cache bound yet (profiling without one)
            return
        k_plane, v_plane = self._planes(kv_cache)
        kernels.write_kv_cache(key, value, k_plane, v_plane, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported on Ascend")
        if attn_metadata is None:  # profiling run without a KV cache
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        k_plane, v_plane = self._planes(kv_cache)
        kernels.paged_attention(
            query[:n], k_plane, v_plane, attn_metadata.block_table,
            attn_metadata.query_start_loc, attn_metadata.seq_lens, self.scale, output[:n],
        )
        return output
