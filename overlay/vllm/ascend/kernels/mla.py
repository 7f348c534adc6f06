"""Multi-head latent attention (DeepSeek-V2/V3) on a paged latent cache.

Cache: ``[num_blocks, block_size, kv_lora_rank + rope_dim]``; each token row holds its
compressed KV ``c`` (first ``kv_lora_rank``) and its rotary key ``k_pe``.

* ``write_latent_cache``: store ``c`` and ``k_pe`` at the tokens' slots.
* ``mla_decode``: absorbed decode. ``q_nope [B, H, L]`` is already multiplied by
  ``W_UK``; scores are ``q_nope . c + q_pe . k_pe``, output ``[B, H, L]`` is
  ``softmax . c`` (the caller applies ``W_UV``).

Prefill (chunked or with prefix-cache hits) gathers a request's latent rows with
``attention.gather_tokens`` and attends with ``attention.causal_attention``.
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import pick
from vllm.ascend.kernels.attention import gather_tokens, valid_slots


def reference_write_latent_cache(kv_c, k_pe, cache, slot_mapping) -> None:
    rank = kv_c.shape[-1]
    flat = cache.view(-1, cache.shape[-1])
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    slots, valid = valid_slots(slot_mapping, kv_c.shape[0])
    if valid is not None:
        kv_c, k_pe = kv_c[valid], k_pe[valid]
    flat[slots, :rank] = kv_c.to(flat.dtype)
    flat[slots, rank:] = k_pe.to(flat.dtype)


def reference_mla_decode(q_nope, q_pe, cache, block_table, seq_lens, scale) -> torch.Tensor:
    rank = q_nope.shape[-1]
    out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        latent = gather_tokens(cache, block_table[b], seq_len).float()
        c, pe = latent[:, :rank], latent[:, rank:]
        scores = (q_nope[b].float() @ c.t() + q_pe[b].float() @ pe.t()) * scale  # [H, seq]
        out[b] = (torch.softmax(scores, dim=-1) @ c).to(out.dtype)
    return out


def npu_write_latent_cache(kv_c, k_pe, cache, slot_mapping) -> None:
    # Index writes are plain device ops; on an NPU they run as NPU kernels.
    reference_write_latent_cache(kv_c, k_pe, cache, slot_mapping)


def npu_mla_decode(q_nope, q_pe, cache, block_table, seq_lens, scale) -> torch.Tensor:
    """torch_npu.npu_fused_infer_attention_score in its MLA form (query/key ``c``,
    ``query_rope``/``key_rope`` the rotary parts, value = ``c``). Not verified here."""
    import torch_npu

    rank = q_nope.shape[-1]
    block_size = cache.shape[1]
    c_cache = cache[..., :rank].unsqueeze(2)
    pe_cache = cache[..., rank:].unsqueeze(2)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q_nope.unsqueeze(1), c_cache, c_cache, query_rope=q_pe.unsqueeze(1), key_rope=pe_cache,
        num_heads=q_nope.shape[1], num_key_value_heads=1, input_layout="BSND", scale=scale,
        block_table=block_table.to(torch.int32), block_size=block_size,
        actual_seq_lengths_kv=seq_lens.tolist(),
    )
    return out.squeeze(1)


write_latent_cache = pick(reference_write_latent_cache, npu_write_latent_cache)
mla_decode = pick(reference_mla_decode, npu_mla_decode)
