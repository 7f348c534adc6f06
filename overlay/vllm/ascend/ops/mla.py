"""The Ascend form of upstream's multi-head latent attention layer (DeepSeek-V2/V3 MLA).

Registered with ``PluggableLayer.register_oot`` in place of
``MultiHeadLatentAttentionWrapper``. Its forward runs the layer's *latent prolog* as
one kernels-facade call (``kernels.mla.latent_prolog``: the ``kv_a`` RMSNorm, the key's
rotary and both cache-plane writes; one ``npu_kv_rmsnorm_rope_cache`` on the NPU path)
and leaves the query's rope part for the attention backend to rotate where it lays the
query out for its kernel (``npu_interleave_rope`` on the NPU path). Upstream's forward
runs instead, unchanged, where the fused prolog does not apply: rotary or RMSNorm custom
ops switched off (``custom_ops``), neox-style or partial rotary, q/kv RMSNorm fused by
upstream, a sparse indexer, Llama-4 scaling, DCP query replication, a backend other than
the Ascend MLA one, context parallelism, a runner's dummy run (memory profile, an idle DP
rank) or a step whose token count is padded (their slots are -1, and the NPU op leaves
repeated cache indices undefined). A decode graph of at most a block's tokens runs the
fused prolog with its padding rows on null-block slots of their own
(``kernels.mla.graph_padding_slots``); larger graphs capture upstream's forward. Where
upstream's forward runs, the backend brings its rotated key and query into the prolog's
rope order (``attention/mla.py``), so the cache has one layout whichever path wrote it.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.forward_context import is_forward_context_available
from vllm.logger import init_logger
from vllm.model_executor.custom_op import PluggableLayer
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

from vllm.ascend.attention.kv_layout import mla_planes
from vllm.ascend.kernels import mla as kernels
from vllm.ascend.ops.norm import AscendRMSNorm
from vllm.ascend.ops.rotary import AscendRotaryForm
from vllm.ascend.step_cache import in_dummy_run, once_per_step

logger = init_logger(__name__)


class AscendMultiHeadLatentAttention(MultiHeadLatentAttentionWrapper):
    _prolog_reason: str | None = None  # why the fused prolog does not apply ("" when it does)

    def _prolog_refusal(self) -> str:
        from vllm.ascend.attention.mla import AscendMLAImpl

        rotary, norm = self.rotary_emb, self.kv_a_layernorm
        if not _runs_ascend_form(rotary, AscendRotaryForm):
            return "the rotary_embedding custom op is off, or the rotary has no Ascend form"
        if rotary.is_neox_style or rotary.rotary_dim != rotary.head_size:
            return "neox-style or partial rotary (the fused ops rotate interleaved pairs of the whole part)"
        if not _runs_ascend_form(norm, AscendRMSNorm) or not norm.has_weight or norm.variance_size_override:
            return "the rms_norm custom op is off, or the latent norm has no weight or a partial variance"
        if self.fuse_qkv_rmsnorm or self.indexer is not None or self.is_sparse or self.dcp_q_replicate:
            return "fused q/kv RMSNorm, a sparse indexer or DCP query replication"
        impl = self.mla_attn.impl
        if not isinstance(impl, AscendMLAImpl) or impl.cp_rank is not None:
            return "another attention backend or context parallelism"
        return ""

    def _step_slots(self, num_tokens: int) -> torch.Tensor | None:
        """This layer's slot mapping when the step's tokens are all real (none padded), or a
        graph batch's slots with its padding rows on null-block slots (when they fit)."""
        if not is_forward_context_available() or in_dummy_run():
            return None
        metadata, _, kv_cache, slots = get_attention_context(self.mla_attn.layer_name)
        if metadata is None or slots is None or not kv_cache.numel() or slots.numel() < num_tokens:
            return None
        if getattr(metadata, "graph_batch", False):
            block_size = kv_cache.shape[1]
            if num_tokens > block_size:
                logger.info_once(
                    "Ascend MLA latent prolog not used in decode graphs of more than %d tokens (a "
                    "graph's padding rows need null-block slots of their own): upstream's forward "
                    "runs there, its rope part put in the prolog's order",
                    block_size,
                )
                return None
            return once_per_step(
                ("mla-graph-slots", slots.data_ptr(), num_tokens),
                lambda: kernels.graph_padding_slots(slots, num_tokens),
            )
        if metadata.num_actual_tokens != num_tokens:
            return None
        return slots

    def forward(self, positions, hidden_states, llama_4_scaling=None):
        if self._prolog_reason is None:
            self._prolog_reason = self._prolog_refusal()
            if self._prolog_reason:
                logger.info_once("Ascend MLA latent prolog not used: %s", self._prolog_reason)
        slots = None
        if not self._prolog_reason and llama_4_scaling is None:
            slots = self._step_slots(hidden_states.shape[0])
        if slots is None:
            return super().forward(positions, hidden_states, llama_4_scaling)

        if self.q_lora_rank is not None:
            q_c, kv_lora = self.fused_qkv_a_proj(hidden_states)[0].split(
                [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1
            )
            q = self.q_b_proj(self.q_a_layernorm(q_c))[0]
        else:
            kv_lora = self.kv_a_proj_with_mqa(hidden_states)[0]
            q = self.q_proj(hidden_states)[0]
        q = q.view(-1, self.num_heads, self.qk_head_dim)
        # every layer shares the rotary module, so the rows are gathered once per step
        rows = self.rotary_emb.step_tables(positions, kv_lora, neox=kernels.prolog_neox_tables())
        latent, rope = mla_planes(self.mla_attn.kv_cache, self.kv_lora_rank)
        norm = self.kv_a_layernorm
        kv_c_normed, k_pe = kernels.latent_prolog(
            kv_lora, norm.weight.data, norm.variance_epsilon, rows, latent, rope, slots
        )
        impl = self.mla_attn.impl
        impl.prolog_rows = rows  # the cache is written; the backend rotates the query's rope part
        try:
            attn_out = self.mla_attn(
                q, kv_c_normed, k_pe, output_shape=(hidden_states.shape[0], self.num_heads * self.v_head_dim)
            )
        finally:
            impl.prolog_rows = None
        if self.g_proj is not None:
            attn_out = attn_out * self.g_proj(hidden_states)[0].sigmoid()
        return self.o_proj(attn_out)[0]


def _runs_ascend_form(op: Any, form: type) -> bool:
    """The custom op is on and dispatches to its Ascend form (not upstream's native one)."""
    return isinstance(op, form) and getattr(op, "_forward_method", None) == getattr(op, "forward_oot", None)


def register() -> None:
    PluggableLayer.register_oot(AscendMultiHeadLatentAttention, name="MultiHeadLatentAttentionWrapper")
