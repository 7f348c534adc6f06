"""GQA/MHA paged attention backend for Ascend, on vllm.ascend.kernels.attention.

Supports mixed prefill/decode batches, chunked prefill and prefix caching (the
kernel contract treats them alike). Decoder self-attention only. The cache is read
as K and V planes (``kv_layout.py``); host lists of the per-request query starts
and sequence lengths are built once per step in the metadata builder. Under context
parallelism decode requests come first in the batch; decode rows combine the ranks'
partial results and prefill runs attend over histories gathered from the group
(``context_parallel.py``).

Decode graphs (``vllm/ascend/graph``): with the NPU kernels the builder declares uniform
batches capturable; a padded graph step's host lists are completed to the captured shape
and published for the replay's update. The forward reads no per-step tensor that is not a
view of the runner's persistent buffers (a graph holds their addresses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from vllm.config import get_current_vllm_config
from vllm.config.vllm import get_current_vllm_config_or_none
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm.ascend import device as ascend_device
from vllm.ascend import envs
from vllm.ascend.attention import context_parallel as cp
from vllm.ascend.attention import prefill_chunks
from vllm.ascend.attention.cp_step import CPStep, build_step
from vllm.ascend.attention.kv_layout import gqa_planes, paged_rows, paged_slots
from vllm.ascend.graph import host_params
from vllm.ascend.kernels import attention as kernels
from vllm.ascend.kernels import npu_kernels
from vllm.ascend.step_cache import once_per_step


def platform_block_size(default_block_size: int) -> int:
    """The KV block size the platform set at config time (``check_and_update_config``,
    logged with its reason), for upstream's later pass that asks each attention backend
    for a preferred size: started from upstream's own default (64 since 0.34), that pass
    would otherwise move host emulation and the NPU MLA kernel (16 or 128) to 64."""
    config = get_current_vllm_config_or_none()
    if config is None or config.cache_config is None or config.cache_config.block_size is None:
        return default_block_size
    return config.cache_config.block_size


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
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return platform_block_size(default_block_size)

    @classmethod
    def supports_sink(cls) -> bool:
        return True  # gpt-oss's per-head sinks (kernels.attention: both forms)

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
    cp_step: CPStep | None = None  # context parallelism: this step's plan
    graph_batch: bool = False  # built for a graph capture (host_params.capture_lengths)


class AscendAttentionMetadataBuilder(AttentionMetadataBuilder[AscendAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.cp_rank = cp.rank_layout(vllm_config.parallel_config)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.prefill_chunk = envs.prefill_chunk_tokens(high=prefill_chunks.MAX_CALL_ROWS)
        if self.cp_rank is not None:
            self.reorder_batch_threshold = 1  # decode requests first: their rows combine across ranks

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # decode graphs of uniform batches (1 + k tokens per request with drafts) on the NPU
        # kernels; context parallelism keeps them off (graph/policy.py, graph_refusal)
        return AttentionCGSupport.UNIFORM_BATCH if npu_kernels() else AttentionCGSupport.NEVER

    def build_for_cudagraph_capture(self, common_attn_metadata) -> AscendAttentionMetadata:
        metadata = self.build(0, common_attn_metadata)
        metadata.graph_batch = True
        return metadata

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> AscendAttentionMetadata:
        m = common_attn_metadata
        query_start_loc, seq_lens = host_params.pad_to_graph(
            m.query_start_loc_cpu[: m.num_reqs + 1].tolist(),
            host_seq_lens(m, self.max_model_len),
            m.num_actual_tokens,
        )
        metadata = AscendAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=m.block_table_tensor[: m.num_reqs],
        )
        if npu_kernels():
            ends = query_start_loc[1:]
            host_params.publish(
                actual_seq_lengths=ends,
                actual_seq_lengths_kv=seq_lens,
                actual_seq_qlen=ends,
                actual_seq_kvlen=seq_lens,
            )
        if self.cp_rank is not None:
            num_decodes = split_decodes_and_prefills(m, decode_threshold=1)[0]
            metadata.cp_step = build_step(
                metadata.query_start_loc, metadata.seq_lens, num_decodes, self.cp_rank, self.prefill_chunk
            )
        return metadata


def host_seq_lens(m: CommonAttentionMetadata, max_model_len: int) -> list[int]:
    """Each request's sequence length from the host copy the runner already made
    (``seq_lens_cpu_upper_bound``), so building metadata reads nothing back from the
    device. It is exact here: the upper bound is optimistic only under asynchronous
    scheduling with speculative decoding, where the runner first copies the device's exact
    lengths over it (``worker/v2/seq_lens.py``). A drafter step past ``max_model_len``
    adds 1 on the host where the device clamps, hence the clamp."""
    host = m.seq_lens_cpu_upper_bound
    if host is None:
        raise RuntimeError(
            "CommonAttentionMetadata.seq_lens_cpu_upper_bound is not set: the Ascend attention "
            "backends take sequence lengths from the host copy and never read them from the device"
        )
    lengths = np.minimum(host.numpy()[: m.num_reqs], max_model_len).tolist()  # (numpy: no dispatch)
    if envs.check_host_seq_lens() and not ascend_device.current().is_capturing():
        device = m.seq_lens[: m.num_reqs].tolist()
        if lengths != device:
            raise RuntimeError(
                f"host sequence lengths {lengths} differ from the device's {device} "
                "(VLLM_ASCEND_CHECK_HOST_SEQ_LENS)"
            )
    return lengths


class AscendAttentionImpl(AttentionImpl[AscendAttentionMetadata]):
    # Decode returns the log-sum-exp and combines context-parallel ranks itself.
    can_return_lse_for_decode: bool = True
    supports_pcp: bool = True

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap=None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra,
    ) -> None:
        if alibi_slopes is not None:
            raise NotImplementedError("Ascend attention does not support alibi_slopes yet")
        vllm_config = get_current_vllm_config()
        self.cp_rank = cp.rank_layout(vllm_config.parallel_config)
        self.sinks = extra.get("sinks")
        if self.sinks is not None and self.cp_rank is not None:
            raise NotImplementedError("Ascend attention does not support sinks with context parallelism yet")
        if self.sinks is not None and npu_kernels() and head_size > kernels.NPU_SINK_MAX_HEAD_SIZE:
            raise NotImplementedError(
                f"Ascend attention sinks with the NPU kernels need a head size of at most "
                f"{kernels.NPU_SINK_MAX_HEAD_SIZE}, not {head_size} (npu_fused_infer_attention_score_v2's "
                "learnable_sink)"
            )
        if sliding_window is not None and self.cp_rank is not None:
            raise NotImplementedError(
                "Ascend attention does not support sliding_window with context parallelism yet"
            )
        self.soft_cap = logits_soft_cap or None  # (upstream's layers pass 0 or None for none)
        if self.soft_cap is not None and (npu_kernels() or self.cp_rank is not None):
            raise NotImplementedError(
                "Ascend attention does not support logits_soft_cap with the NPU kernels or "
                "context parallelism yet"
            )
        self.sliding_window = sliding_window
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"Ascend attention supports decoder self-attention only, not {attn_type}"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.need_to_return_lse_for_decode = self.cp_rank is not None
        # a hybrid model's attention pages are shared with its state layers (kv_layout.gqa_planes)
        model_config = vllm_config.model_config
        self.pages_shared = bool(model_config is not None and model_config.is_hybrid)

    def _planes(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gqa_planes(
            kv_cache, self.head_size, kv_cache.shape[-1] - self.head_size, within_blocks=self.pages_shared
        )

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if kv_cache.numel() == 0:  # no cache bound yet (profiling without one)
            return
        k_plane, v_plane = self._planes(kv_cache)
        if self.pages_shared:
            slot_mapping = once_per_step(
                ("paged-slots", slot_mapping.data_ptr(), slot_mapping.shape[0]),
                lambda: paged_slots(slot_mapping, k_plane.shape[2]),
            )
        if self.cp_rank is not None and self.cp_rank.pcp > 1:
            step = get_forward_context().attn_metadata[layer.layer_name].cp_step
            if step.split:  # every PCP rank's rows, in the order of the runner's PCP slot mapping
                rows = step.local_rows
                key, value = cp.pcp_gather_rows(key[:rows]), cp.pcp_gather_rows(value[:rows])
        shape = (key.shape[0], key.shape[1], k_plane.shape[2])  # tokens, KV heads, block size
        index = once_per_step(
            ("gqa-write-index", slot_mapping.data_ptr(), *shape),
            lambda: kernels.write_index(slot_mapping, *shape),
        )
        kernels.write_kv_cache(key, value, k_plane, v_plane, slot_mapping, index)

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported on Ascend")
        if attn_metadata is None:  # profiling run without a KV cache
            return output.fill_(0)
        k_plane, v_plane = self._planes(kv_cache)
        if attn_metadata.cp_step is not None:
            return self._context_parallel(query, k_plane, v_plane, attn_metadata, output)
        n = attn_metadata.num_actual_tokens
        seq_lens = attn_metadata.seq_lens
        block_table = attn_metadata.block_table
        if self.pages_shared:
            block_table = once_per_step(
                ("paged-rows", block_table.data_ptr(), *block_table.shape), lambda: paged_rows(block_table)
            )
        if attn_metadata.graph_batch:  # captured with the longest lengths its replays may bring
            starts = attn_metadata.query_start_loc
            seq_lens = host_params.capture_lengths(
                [b - a for a, b in zip(starts, starts[1:])],
                block_table.shape[1],
                k_plane.shape[2],
                k_plane.shape[0],
            )
        kernels.paged_attention(
            query[:n],
            k_plane,
            v_plane,
            block_table,
            attn_metadata.query_start_loc,
            seq_lens,
            self.scale,
            output[:n],
            self.sliding_window,
            self.soft_cap,
            self.sinks,
        )
        return output

    def _context_parallel(self, query, k_plane, v_plane, attn_metadata, output) -> torch.Tensor:
        step = attn_metadata.cp_step
        out = output.view(output.shape[0], self.num_heads, -1)
        out[: step.local_rows].zero_()  # padding rows (PCP) stay zero
        ndec = step.num_decode_tokens
        if ndec:
            q = cp.gather_dcp_heads(query[:ndec], step.rank)
            partial, lse = kernels.paged_decode(
                q, k_plane, v_plane, attn_metadata.block_table[:ndec], step.decode_lens, self.scale
            )
            out[:ndec] = cp.combine_decode(partial, lse, step.rank, self.num_heads)
        if step.prefill_plan is not None:

            def materialize(rnd):
                kv = cp.gather_round([k_plane, v_plane], attn_metadata.block_table, rnd)
                return kv.split([self.head_size, kv.shape[-1] - self.head_size], dim=-1)

            q = query.view(query.shape[0], self.num_heads, -1)
            prefill_chunks.attend(q, step.prefill_plan, materialize, self.scale, out, out.shape[-1])
        return output
