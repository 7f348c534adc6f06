"""The Ascend form of DeepSeek-V3.2's lightning indexer (``Platform.sparse_indexer_cls``,
the hook patch on ``deepseek_v2.py``): upstream's parameters under upstream's names
(``wq_b``, the fused ``wk_weights_proj``, ``k_norm``), so its weight loading is unchanged,
and an unquantized key cache (``attention/sparse_mla.py``) in place of upstream's fp8 one.

Per step: the query heads from the q-LoRA latent, the key and the per-head weights from the
hidden states, the key LayerNorm-ed, the rope part of both (the first ``rope_dim``) rotated
by the indexer's own rotary (NeoX unless the config says interleaved), the key written to
the cache, and each token's top-k positions (``kernels/dsa.py``) written into the model's
shared top-k buffer, which the sparse MLA layers of the step read.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.layernorm import LayerNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear

from vllm.ascend.attention.sparse_mla import AscendIndexerCache, AscendIndexerMetadata
from vllm.ascend.kernels import dsa


class AscendIndexer(nn.Module):
    def __init__(
        self,
        vllm_config,
        config,
        hidden_size: int,
        q_lora_rank: int,
        quant_config,
        cache_config,
        topk_indices_buffer: torch.Tensor | None,
        prefix: str = "",
        is_inplace_rope: bool = False,
    ) -> None:
        super().__init__()
        self.topk_tokens = config.index_topk
        self.n_head = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.wq_b = ReplicatedLinear(
            q_lora_rank,
            self.head_dim * self.n_head,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.wq_b",
        )
        self.wk_weights_proj = MergedColumnParallelLinear(
            hidden_size,
            [self.head_dim, self.n_head],
            bias=False,
            quant_config=None,
            disable_tp=True,
            prefix=f"{prefix}.wk_weights_proj",
        )
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6, dtype=torch.float32)
        # transformers' scaling: D^-1/2 inside the relu (a positive factor: outside), H^-1/2
        self.weight_scale = self.head_dim**-0.5 * self.n_head**-0.5
        self.topk_indices_buffer = topk_indices_buffer
        self.k_cache = AscendIndexerCache(
            self.head_dim, vllm_config.model_config.dtype, f"{prefix}.k_cache", cache_config
        )

    def forward(
        self, hidden_states: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rotary_emb
    ) -> None:
        q = self.wq_b(qr)[0].view(-1, self.n_head, self.head_dim)
        kw = self.wk_weights_proj(hidden_states)[0]
        k = self.k_norm(kw[:, : self.head_dim]).to(q.dtype)
        weights = kw[:, self.head_dim :].float() * self.weight_scale
        rope = self.rope_dim
        q_pe, k_pe = rotary_emb(positions, q[..., :rope].contiguous(), k[:, :rope].unsqueeze(1).contiguous())
        q = torch.cat([q_pe.reshape(-1, self.n_head, rope), q[..., rope:]], dim=-1)
        k = torch.cat([k_pe.reshape(-1, rope), k[:, rope:]], dim=-1)
        metadata = self._metadata()
        if metadata is None:  # a profile or dummy run: no cache, no selection
            return
        tokens = metadata.num_actual_tokens
        dsa.indexer_write(k[:tokens], self.k_cache.kv_cache, metadata.slot_mapping)
        assert self.topk_indices_buffer is not None
        self.topk_indices_buffer[:tokens] = dsa.indexer_topk(
            q[:tokens],
            weights[:tokens],
            self.k_cache.kv_cache,
            metadata.block_table,
            metadata.query_start_cpu,
            metadata.seq_lens_cpu,
            self.topk_tokens,
            device_lengths=metadata.device_lengths,
        )

    def _metadata(self) -> AscendIndexerMetadata | None:
        if not is_forward_context_available():
            return None
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict):
            return None
        found = metadata.get(self.k_cache.prefix)
        return found if isinstance(found, AscendIndexerMetadata) else None
