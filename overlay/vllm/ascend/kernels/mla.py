"""Multi-head latent attention (DeepSeek-V2/V3) on a paged latent cache.

Cache: ``[num_blocks, block_size, kv_lora_rank + rope_dim]``; each token row holds its
compressed KV ``c`` (first ``kv_lora_rank``) and its rotary key ``k_pe``.

* ``write_latent_cache``: store ``c`` and ``k_pe`` at the tokens' slots.
* ``mla_decode``: absorbed decode. ``q_nope [B, H, L]`` is already multiplied by
  ``W_UK``; scores are ``q_nope . c + q_pe . k_pe``, output ``[B, H, L]`` is
  ``softmax . c`` (the caller applies ``W_UV``).
* ``gather_latent``: the first ``seq_len`` latent rows of one request (prefill with
  context: chunked prefill and prefix-cache hits).
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import use_reference


def reference_write_latent_cache(kv_c, k_pe, cache, slot_mapping) -> None:
    rank = kv_c.shape[-1]
    flat = cache.view(-1, cache.shape[-1])
    slots = slot_mapping[: kv_c.shape[0]].to(torch.int64)
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, kv_c, k_pe = slots[valid], kv_c[valid], k_pe[valid]
    flat[slots, :rank] = kv_c.to(flat.dtype)
    flat[slots, rank:] = k_pe.to(flat.dtype)


def gather_latent(cache, block_row, seq_len: int) -> torch.Tensor:
    block_size = cache.shape[1]
    blocks = block_row[: -(-seq_len // block_size)].to(torch.int64)
    return cache[blocks].reshape(-1, cache.shape[-1])[:seq_len]


def reference_mla_decode(q_nope, q_pe, cache, block_table, seq_lens, scale) -> torch.Tensor:
    rank = q_nope.shape[-1]
    out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        latent = gather_latent(cache, block_table[b], seq_len).float()
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


def write_latent_cache(kv_c, k_pe, cache, slot_mapping) -> None:
    fn = reference_write_latent_cache if use_reference() else npu_write_latent_cache
    fn(kv_c, k_pe, cache, slot_mapping)


def mla_decode(q_nope, q_pe, cache, block_table, seq_lens, scale) -> torch.Tensor:
    fn = reference_mla_decode if use_reference() else npu_mla_decode
    return fn(q_nope, q_pe, cache, block_table, seq_lens, scale)


def causal_attention(q, k, v, context_len: int, scale: float) -> torch.Tensor:
    """Queries are the last ``q.shape[0]`` of ``k.shape[0]`` positions. [T, H, D] layout.
    Plain torch on both device kinds (prefill is matmul-bound, SDPA maps to NPU ops)."""
    q_len, seq_len = q.shape[0], k.shape[0]
    q_pos = torch.arange(q_len, device=q.device).unsqueeze(1) + context_len
    mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        attn_mask=mask, scale=scale)
    return out.transpose(0, 1).to(q.dtype)
