"""MLA attention backend for Ascend (DeepSeek-V2/V3), on vllm.ascend.kernels.mla.

Upstream's MLA layer does the weight absorption and the batch split (decodes first);
this backend supplies the device-facing pieces: the latent-cache write, the absorbed
decode, and prefill. The cache is read as latent and rope planes (``kv_layout.py``).
Prefill reads each request's latent history from the cache (its new tokens were just
written), expands it with ``kv_b_proj`` and attends, so chunked prefill and prefix-cache
hits need no separate context path. The history is expanded a chunk of at most
``VLLM_ASCEND_PREFILL_CHUNK_TOKENS`` tokens at a time and the chunks' partial results are
merged by log-sum-exp (``prefill_chunks.py``), so the transient memory does not grow with
the context length. Under context parallelism the
history is gathered from the group's caches and decode combines the ranks' partial
results (``context_parallel.py``); upstream's layer-level DCP machinery stays off
(``dcp_world_size`` 1 on the impl, the builder opts out of its DCP workspace).

Draft verification (1 + k query tokens per decode request) runs the decode kernel with
k + 1 query rows per request (``decode_q_len``); under context parallelism every query
token is a decode row of its own instead (``decode_rows``).

The rope plane has one element order whatever wrote a token: with the NPU kernels the
latent prolog (``ops/mla.py``) writes the rotated key de-interleaved (even elements, then
odd) and rotates the query to match; a step that runs upstream's forward instead (a dummy
or padded step, a decode graph of more tokens than a block, a layer without the prolog)
brings its GPT-J-ordered key and query parts into that order here (``kernels.rope_order``)
before the cache write and the attention, so an eager prefill and a graph decode, or a P/D
prefill and decode instance, read the same plane alike.

Decode graphs (``vllm/ascend/graph``): as the GQA builder, the MLA builder completes a
padded graph step's host lists and publishes the decode requests' KV lengths for the
replay's update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm.ascend import envs
from vllm.ascend.attention import context_parallel as cp
from vllm.ascend.attention import prefill_chunks
from vllm.ascend.attention.backend import host_seq_lens, platform_block_size
from vllm.ascend.attention.cp_step import CPStep, build_step
from vllm.ascend.attention.kv_layout import mla_planes
from vllm.ascend.graph import host_params
from vllm.ascend.kernels import mla as kernels
from vllm.ascend.kernels import npu_kernels
from vllm.ascend.kernels.attention import gather_range, supported_block_sizes
from vllm.ascend.kernels.mla import head_major
from vllm.ascend.step_cache import once_per_step


@dataclass
class AscendMLAMetadata(MLACommonMetadata):
    # Host copies, built once per step (decodes come first, as upstream orders them).
    query_start_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # The decode kernel's block-table rows and KV lengths: one per decode request, each with
    # decode_q_len query rows; under CP one per decode query token (decode_rows), q_len 1.
    decode_block_rows: torch.Tensor | None = None
    decode_row_lens: list[int] = field(default_factory=list)  # under CP: the tokens this rank holds
    decode_q_len: int = 1
    cp_step: CPStep | None = None
    request_block_table: torch.Tensor | None = None  # every request's row (history reads and gathers)
    prefill_plan: prefill_chunks.ChunkPlan | None = None  # without CP (under CP: cp_step.prefill_plan)
    graph_batch: bool = False  # built for a graph capture (every row may be padding)


class AscendMLAMetadataBuilder(MLACommonMetadataBuilder[AscendMLAMetadata]):
    # Speculative verification (1 + k query tokens per request) takes the decode path:
    # every query token becomes a decode row of its own (decode_rows, once per step).
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM
    # Context parallelism is this backend's own (context_parallel.py), not the shared
    # builder's DCP workspace (a hook added by this distribution's patch).
    manages_context_parallel: ClassVar[bool] = True

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs) -> None:
        kwargs["metadata_cls"] = AscendMLAMetadata
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, **kwargs)
        self.cp_rank = cp.rank_layout(vllm_config.parallel_config)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.prefill_chunk = envs.prefill_chunk_tokens(high=prefill_chunks.MAX_CALL_ROWS)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return AttentionCGSupport.UNIFORM_BATCH if npu_kernels() else AttentionCGSupport.NEVER

    def build_for_cudagraph_capture(self, common_attn_metadata) -> AscendMLAMetadata:
        metadata = self.build(0, common_attn_metadata)
        metadata.graph_batch = True
        return metadata

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> AscendMLAMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        m = common_attn_metadata
        metadata.query_start_cpu, metadata.seq_lens_cpu = host_params.pad_to_graph(
            m.query_start_loc_cpu[: m.num_reqs + 1].tolist(),
            host_seq_lens(m, self.max_model_len),
            m.num_actual_tokens,
        )
        metadata.request_block_table = m.block_table_tensor[: m.num_reqs]
        if self.cp_rank is not None:
            metadata.cp_step = build_step(
                metadata.query_start_cpu,
                metadata.seq_lens_cpu,
                metadata.num_decodes,
                self.cp_rank,
                self.prefill_chunk,
            )
        elif metadata.prefill is not None:
            metadata.prefill_plan = prefill_plan(
                metadata.query_start_cpu, metadata.seq_lens_cpu, metadata.num_decodes, self.prefill_chunk
            )
        if metadata.decode is not None:
            n = metadata.num_decodes
            starts = metadata.query_start_cpu[: n + 1]
            if metadata.cp_step is not None:
                metadata.decode_block_rows, _ = decode_rows(
                    metadata.decode.block_table, starts, metadata.seq_lens_cpu[:n]
                )
                metadata.decode_row_lens = metadata.cp_step.decode_lens
            else:
                metadata.decode_q_len = starts[1] - starts[0]  # uniform (query_len_support)
                metadata.decode_block_rows = metadata.decode.block_table
                metadata.decode_row_lens = metadata.seq_lens_cpu[:n]
                if npu_kernels():
                    host_params.publish(actual_seq_lengths_kv=metadata.decode_row_lens)
        return metadata


def prefill_plan(
    query_start: list[int], seq_lens: list[int], first: int, chunk: int
) -> prefill_chunks.ChunkPlan:
    """The chunked prefill of requests ``first ..``: each runs its new tokens (rows counted
    from the first prefill token) over its whole history."""
    base = query_start[first]
    runs, lens = [], {}
    for r in range(first, len(seq_lens)):
        q_len = query_start[r + 1] - query_start[r]
        if q_len:
            runs.append(prefill_chunks.Run(query_start[r] - base, q_len, r, seq_lens[r] - q_len))
            lens[r] = seq_lens[r]
    return prefill_chunks.build_chunk_plan(runs, lens, chunk)


def decode_rows(block_table: torch.Tensor, query_start: list[int], seq_lens: list[int]):
    """One decode row per query token (context parallelism, whose ranks hold their own
    share of each row's keys). A request verifying k draft tokens has 1 + k query tokens;
    its token i attends to the first ``seq_len - q_len + i + 1`` keys, the same absorbed
    decode plain decoding runs for that position."""
    q_lens = [b - a for a, b in zip(query_start, query_start[1:])]
    if all(n == 1 for n in q_lens):
        return block_table, seq_lens
    rows = [r for r, n in enumerate(q_lens) for _ in range(n)]
    lens = [s - n + i + 1 for s, n in zip(seq_lens, q_lens) for i in range(n)]
    return block_table[torch.tensor(rows, device=block_table.device)], lens


class AscendMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "ASCEND_MLA"

    @staticmethod
    def get_impl_cls() -> type[AscendMLAImpl]:
        return AscendMLAImpl

    @staticmethod
    def get_builder_cls() -> type[AscendMLAMetadataBuilder]:
        return AscendMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return supported_block_sizes(kernels.NPU_MLA_BLOCK_SIZES)

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return platform_block_size(default_block_size)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)


class AscendMLAImpl(MLACommonImpl[AscendMLAMetadata]):
    # Decode returns the log-sum-exp and combines context-parallel ranks itself.
    can_return_lse_for_decode: bool = True
    supports_pcp: bool = True

    def __init__(
        self,
        num_heads,
        head_size,
        scale,
        num_kv_heads,
        alibi_slopes,
        sliding_window,
        kv_cache_dtype,
        logits_soft_cap,
        attn_type,
        kv_sharing_target_layer_name,
        **mla_args,
    ) -> None:
        # Upstream's MLACommonImpl.__init__ picks a CUDA prefill kernel; this backend runs
        # its own prefill, so only the attributes the shared MLA layer reads are set.
        if kv_sharing_target_layer_name is not None:
            raise NotImplementedError("KV sharing is not supported for MLA on Ascend")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError("Ascend MLA supports decoder self-attention only")
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap is not None:
            raise NotImplementedError("Ascend MLA does not support alibi, sliding window or soft cap")
        if mla_args.get("sinks") is not None:
            raise NotImplementedError("Ascend MLA does not support attention sinks")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        for key in (
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "qk_head_dim",
            "v_head_dim",
            "kv_b_proj",
        ):
            setattr(self, key, mla_args[key])
        from vllm.config import get_current_vllm_config

        self.cp_rank = cp.rank_layout(get_current_vllm_config().parallel_config)
        if npu_kernels():  # a DCP decode runs the DCP group's heads together
            kernels.check_npu_dims(self.kv_lora_rank, self.qk_rope_head_dim)
            kernels.npu_padded_heads(num_heads * (self.cp_rank.dcp if self.cp_rank else 1))
        self.indexer = mla_args.get("indexer")
        self.q_pad_num_heads = mla_args.get("q_pad_num_heads")
        self.supports_quant_query_input = False
        self._use_flashinfer_concat_mla_k = False
        self._pad_v = False
        # Upstream's MLA layer runs its own DCP path when the impl reports DCP > 1; this
        # impl does context parallelism itself, so the layer sees 1.
        self.dcp_world_size = 1
        self.cp_kv_cache_interleave_size = 1
        self.need_to_return_lse_for_decode = self.cp_rank is not None
        # Set by the Ascend MLA layer (ops/mla.py) for one call when its latent prolog has
        # written the cache and left the query's rope part unrotated: the step's rotary rows
        # (cos, sin) [1, T, 1, R].
        self.prolog_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def do_kv_cache_update(
        self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale, skip_scale=False
    ) -> None:
        # only 'auto' KV caches (supported_kv_cache_dtypes): no scales to skip
        if kv_cache.numel() and self.prolog_rows is None:
            latent, rope = mla_planes(kv_cache, self.kv_lora_rank)
            tokens = kv_c_normed.shape[0]
            slots = once_per_step(
                ("mla-write-slots", slot_mapping.data_ptr(), tokens),
                lambda: kernels.write_slots(slot_mapping, tokens),
            )
            k_pe = kernels.rope_order(k_pe)  # rotated by upstream's forward: the prolog's order
            kernels.write_latent_cache(kv_c_normed, k_pe, latent, rope, slot_mapping, slots)

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        q_nope, q_pe = (
            q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        )
        latent, rope = mla_planes(kv_c_and_k_pe_cache, self.kv_lora_rank)
        rows, lens = attn_metadata.decode_block_rows, attn_metadata.decode_row_lens
        step = attn_metadata.cp_step
        q_rope = None
        if self.prolog_rows is not None:  # decode tokens come first
            q_rope = tuple(r[:, : q_pe.shape[0]] for r in self.prolog_rows)
        else:  # rotated by upstream's forward: the prolog's order
            q_pe = kernels.rope_order(q_pe)
        if step is None:
            if attn_metadata.graph_batch:  # captured with the longest lengths its replays may bring
                q_len = attn_metadata.decode_q_len
                lens = host_params.capture_lengths(
                    [q_len] * len(lens), rows.shape[1], latent.shape[1], latent.shape[0]
                )
            out = kernels.mla_decode(
                q_nope,
                q_pe,
                latent,
                rope,
                rows,
                lens,
                self.scale,
                q_rope=q_rope,
                q_len=attn_metadata.decode_q_len,
            )
            return out, None
        heads = q_nope.shape[1]
        q_group = cp.gather_dcp_heads(torch.cat([q_nope, q_pe], dim=-1), step.rank)
        q_nope, q_pe = q_group.split([self.kv_lora_rank, q_pe.shape[-1]], dim=-1)
        out, lse = kernels.mla_decode(q_nope, q_pe, latent, rope, rows, lens, self.scale, return_lse=True)
        return cp.combine_decode(out, lse, step.rank, heads), None

    def forward_mha(
        self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output, output_scale=None
    ) -> None:
        if output_scale is not None:
            raise NotImplementedError("fused output quantization is not supported on Ascend")
        latent, rope = mla_planes(kv_c_and_k_pe_cache, self.kv_lora_rank)
        out = output.view(-1, self.num_heads, self.v_head_dim)
        q_pe = q[..., self.qk_nope_head_dim :]
        if self.prolog_rows is not None:  # the prefill rows follow the decode rows
            start = attn_metadata.num_decode_tokens
            rows = tuple(r[:, start : start + q.shape[0]] for r in self.prolog_rows)
            q[..., self.qk_nope_head_dim :] = kernels.rope_query(q_pe, rows)
        elif (ordered := kernels.rope_order(q_pe)) is not q_pe:  # upstream rotated it: the prolog's order
            q[..., self.qk_nope_head_dim :] = ordered
        if attn_metadata.cp_step is not None:
            return self._context_parallel_prefill(q, latent, rope, attn_metadata, out)
        table = attn_metadata.request_block_table
        planes = [head_major(latent), head_major(rope)]

        def materialize(rnd):
            c, pe = (
                torch.cat([gather_range(p, table[r], a, b) for r, a, b in rnd.chunks])[:, 0].to(q.dtype)
                for p in planes
            )
            return self._expand(c, pe)

        prefill_chunks.attend(q, attn_metadata.prefill_plan, materialize, self.scale, out, self.v_head_dim)

    def _expand(self, c, pe):
        """Latent ``c`` and rotary ``pe`` rows -> per-head keys and values (``kv_b_proj``)."""
        kv = self.kv_b_proj(c)[0].view(c.shape[0], self.num_heads, -1)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        return torch.cat([k_nope, pe.unsqueeze(1).expand(-1, self.num_heads, -1)], dim=-1), v

    def _context_parallel_prefill(self, q, latent, rope, attn_metadata, out) -> None:
        """This rank's prefill query runs over histories gathered from the CP group; ``q``
        and ``out`` are the local rows after the decode rows."""
        step = attn_metadata.cp_step
        out.zero_()  # padding rows (PCP) stay zero
        if step.prefill_plan is None:
            return
        planes = [head_major(latent), head_major(rope)]

        def materialize(rnd):
            history = cp.gather_round(planes, attn_metadata.request_block_table, rnd)
            return self._expand(
                history[:, 0, : self.kv_lora_rank].to(q.dtype), history[:, 0, self.kv_lora_rank :].to(q.dtype)
            )

        prefill_chunks.attend(
            q,
            step.prefill_plan,
            materialize,
            self.scale,
            out,
            self.v_head_dim,
            row_offset=step.num_decode_tokens,
        )
