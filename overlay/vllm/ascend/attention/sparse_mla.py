"""DeepSeek sparse attention (V3.2) for Ascend, on ``vllm.ascend.kernels.dsa``: the
indexer's key cache (its own small cache per layer, beside the latent cache in the same
KV-cache group, so one block table serves both) and the sparse MLA backend that attends
over each query's selected positions.

Upstream's V3.2 indexer keeps an fp8 key cache read by its own backend (Triton and CUDA
metadata kernels) and quantizes its query with a Triton fallback off CUDA; the platform
supplies its own indexer instead (``ops/dsa_indexer.py``, through the hook patch's
``Platform.sparse_indexer_cls``) with an unquantized cache of the model's dtype, as
transformers' indexer has it (equal tokens checked in float32). The indexer writes each
step's top-k positions (request-local; ``kernels/dsa.py`` says what follows the visible
ones in each form) into the model's shared buffer; the sparse MLA impl reads them for
every token, prefill and decode alike (upstream's MQA-only path).

Both kernel sets (with the NPU kernels: torch_npu's lightning indexer and sparse flash
attention over the same planes, their lengths in int32 device buffers the indexer's
metadata builder fills each step, so decode graphs capture both ops; the reference forms
read host lists and take no graphs). Speculative decoding, KV connectors and context
parallelism are refused at start-up (``platform/model_features.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.config import CacheConfig, VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import KVCacheSpec, MLAAttentionSpec, SparseCacheRole
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm.ascend.attention.backend import host_seq_lens
from vllm.ascend.attention.kv_layout import mla_planes
from vllm.ascend.attention.mla import AscendMLABackend, AscendMLAImpl, AscendMLAMetadata
from vllm.ascend.graph import host_params
from vllm.ascend.kernels import dsa, npu_kernels
from vllm.ascend.kernels import mla as mla_kernels
from vllm.ascend.kernels.attention import supported_block_sizes


class AscendIndexerCache(torch.nn.Module, AttentionLayerBase):
    """One indexer key per token (``[blocks, block_size, head_dim]``, the model's dtype),
    registered as a layer of its own so upstream's KV-cache manager allocates and binds it."""

    def __init__(self, head_dim: int, dtype: torch.dtype, prefix: str, cache_config: CacheConfig) -> None:
        super().__init__()
        self.kv_cache = torch.tensor([])
        self.head_dim = head_dim
        self.dtype = dtype
        self.prefix = prefix
        self.cache_config = cache_config
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        # upstream binds [blocks, 1 head, block_size, head_dim] (LBHNC): one head, dropped
        self.kv_cache = kv_cache.squeeze(1) if kv_cache.dim() == 4 else kv_cache

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return MLAAttentionSpec(
            block_size=self.cache_config.block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=self.head_dim,
            dtype=self.dtype,
            cache_role=SparseCacheRole.INDEXER,
        )

    def forward(self) -> None: ...

    def get_attn_backend(self) -> type[AttentionBackend]:
        return AscendIndexerBackend


@dataclass
class AscendIndexerMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    block_table: torch.Tensor  # every request's row
    query_start_cpu: list[int]  # a graph batch's padding requests given rows (pad_to_graph)
    seq_lens_cpu: list[int]
    # with the NPU kernels: the same per request in int32 device buffers that stay put
    # (cumulative query rows, KV lengths), read by the indexer and the layer's sparse MLA
    device_lengths: tuple[torch.Tensor, torch.Tensor] | None = None


class AscendIndexerMetadataBuilder(AttentionMetadataBuilder[AscendIndexerMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.max_model_len = vllm_config.model_config.max_model_len
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        if npu_kernels():  # a graph's ops read their lengths here at every replay
            scheduler = vllm_config.scheduler_config
            size = max(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
            self._buffers = (
                torch.zeros(size, dtype=torch.int32, device=device),
                torch.zeros(size, dtype=torch.int32, device=device),
            )

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # the NPU ops take device lengths (the buffers above); the reference forms host lists
        return AttentionCGSupport.UNIFORM_BATCH if npu_kernels() else AttentionCGSupport.NEVER

    def build_for_cudagraph_capture(self, common_attn_metadata) -> AscendIndexerMetadata:
        return self.build(0, common_attn_metadata)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> AscendIndexerMetadata:
        m = common_attn_metadata
        query_start, seq_lens = host_params.pad_to_graph(
            m.query_start_loc_cpu[: m.num_reqs + 1].tolist(),
            host_seq_lens(m, self.max_model_len),
            m.num_actual_tokens,
        )
        device_lengths = None
        if self._buffers is not None:
            requests = len(seq_lens)
            ends, lens = (buffer[:requests] for buffer in self._buffers)
            ends.copy_(torch.tensor(query_start[1:], dtype=torch.int32))
            lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
            device_lengths = (ends, lens)
        return AscendIndexerMetadata(
            num_actual_tokens=m.num_actual_tokens,
            slot_mapping=m.slot_mapping,
            block_table=m.block_table_tensor[: m.num_reqs],
            query_start_cpu=query_start,
            seq_lens_cpu=seq_lens,
            device_lengths=device_lengths,
        )


class AscendIndexerBackend(AttentionBackend):
    """The indexer cache's backend: metadata only (the indexer module runs the kernels)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "ASCEND_DSA_INDEXER"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("the Ascend indexer cache has no attention impl")

    @staticmethod
    def get_builder_cls() -> type[AscendIndexerMetadataBuilder]:
        return AscendIndexerMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        return (num_blocks, block_size, head_size)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        # the latent cache's (one KV-cache group, one block table)
        return supported_block_sizes(mla_kernels.NPU_MLA_BLOCK_SIZES)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)


class AscendSparseMLABackend(AscendMLABackend):
    @staticmethod
    def get_name() -> str:
        return "ASCEND_MLA_SPARSE"

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @staticmethod
    def get_impl_cls() -> type[AscendSparseMLAImpl]:
        return AscendSparseMLAImpl


class AscendSparseMLAImpl(AscendMLAImpl):
    """Every token (decodes and prefills) attends over its selected positions only."""

    is_sparse: ClassVar[bool] = True
    masked_mha_available: ClassVar[bool] = False  # prefill takes the top-k path too

    def __init__(self, *args, **mla_args) -> None:
        super().__init__(*args, **mla_args)
        # the indexer owns the buffer (a drafter may point it elsewhere): read it per call
        self._indexer = mla_args.get("indexer")
        self._topk_buffer = mla_args.get("topk_indices_buffer")

    @property
    def topk_indices_buffer(self) -> torch.Tensor:
        buffer = self._topk_buffer if self._indexer is None else self._indexer.topk_indices_buffer
        if buffer is None:
            raise RuntimeError("a sparse MLA layer without a top-k buffer")
        return buffer

    def record_logical_topk_ready(self) -> None:
        """Upstream's hand-off event for its side-stream conversion: nothing to record here."""

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata: AscendMLAMetadata, layer):
        q_nope, q_pe = (
            q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        )
        latent, rope = mla_planes(kv_c_and_k_pe_cache, self.kv_lora_rank)
        tokens = q_nope.shape[0]
        out = dsa.sparse_mla(
            q_nope,
            mla_kernels.rope_order(q_pe),
            latent,
            rope,
            attn_metadata.request_block_table,
            attn_metadata.query_start_cpu,
            self.topk_indices_buffer[:tokens],
            self.scale,
            seq_lens=attn_metadata.seq_lens_cpu,
            device_lengths=self._indexer_lengths(),
        )
        return out, None

    def _indexer_lengths(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's device lengths from this layer's indexer metadata (the same requests
        in the same KV-cache group): one set of buffers for both ops."""
        if self._indexer is None or not is_forward_context_available():
            return None
        metadata = get_forward_context().attn_metadata
        found = metadata.get(self._indexer.k_cache.prefix) if isinstance(metadata, dict) else None
        return found.device_lengths if isinstance(found, AscendIndexerMetadata) else None
