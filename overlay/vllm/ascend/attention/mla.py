"""MLA attention backend for Ascend (DeepSeek-V2/V3), on vllm.ascend.kernels.mla.

Upstream's MLA layer does the weight absorption and the batch split (decodes first);
this backend supplies the three device-facing pieces: the latent-cache write, the
absorbed decode, and prefill. Prefill reads the request's whole latent history from
the cache (its new tokens were just written), so chunked prefill and prefix-cache
hits need no separate context path.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonImpl,
    MLACommonMetadata,
)
from vllm.v1.attention.backend import AttentionType

from vllm.ascend.kernels import mla as kernels
from vllm.ascend.kernels.attention import causal_attention, gather_tokens


class AscendMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "ASCEND_MLA"

    @staticmethod
    def get_impl_cls() -> type[AscendMLAImpl]:
        return AscendMLAImpl


class AscendMLAImpl(MLACommonImpl[MLACommonMetadata]):
    can_return_lse_for_decode: bool = False

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                 **mla_args) -> None:
        # Upstream's MLACommonImpl.__init__ picks a CUDA prefill kernel; this backend runs
        # its own prefill, so only the attributes the shared MLA layer reads are set.
        if kv_sharing_target_layer_name is not None:
            raise NotImplementedError("KV sharing is not supported for MLA on Ascend")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError("Ascend MLA supports decoder self-attention only")
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap is not None:
            raise NotImplementedError("Ascend MLA does not support alibi, sliding window or soft cap")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "qk_head_dim", "v_head_dim", "kv_b_proj"):
            setattr(self, key, mla_args[key])
        self.indexer = mla_args.get("indexer")
        self.q_pad_num_heads = mla_args.get("q_pad_num_heads")
        self.supports_quant_query_input = False
        self._use_flashinfer_concat_mla_k = False
        self._pad_v = False
        self.dcp_world_size = 1
        self.cp_kv_cache_interleave_size = 1

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                           k_scale) -> None:
        if kv_cache.numel():
            kernels.write_latent_cache(kv_c_normed, k_pe, kv_cache, slot_mapping)

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        q_nope, q_pe = q if isinstance(q, tuple) else q.split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        decode = attn_metadata.decode
        out = kernels.mla_decode(q_nope, q_pe, kv_c_and_k_pe_cache, decode.block_table,
                                 decode.seq_lens.cpu(), self.scale)
        return out, None

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale,
                    output, output_scale=None) -> None:
        if output_scale is not None:
            raise NotImplementedError("fused output quantization is not supported on Ascend")
        prefill = attn_metadata.prefill
        qsl = prefill.query_start_loc.cpu().tolist()
        num_reqs = len(qsl) - 1
        context = (prefill.chunked_context.context_lens_list if prefill.chunked_context is not None
                   else [0] * num_reqs)
        out = output.view(-1, self.num_heads, self.v_head_dim)
        rank, nope = self.kv_lora_rank, self.qk_nope_head_dim
        for r in range(num_reqs):
            start, end = qsl[r], qsl[r + 1]
            if end == start:
                continue
            context_len = int(context[r])
            seq_len = context_len + (end - start)
            latent = gather_tokens(kv_c_and_k_pe_cache, prefill.block_table[r], seq_len)
            kv = self.kv_b_proj(latent[:, :rank].to(q.dtype))[0].view(seq_len, self.num_heads, -1)
            k_nope, v = kv.split([nope, self.v_head_dim], dim=-1)
            k_rope = latent[:, rank:].to(q.dtype).unsqueeze(1).expand(-1, self.num_heads, -1)
            k = torch.cat([k_nope, k_rope], dim=-1)
            out[start:end] = causal_attention(q[start:end], k, v, context_len, self.scale)
