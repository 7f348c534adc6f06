"""Multi-head latent attention (DeepSeek-V2/V3) on paged latent and rope planes.

Cache (``attention/kv_layout.py``): ``latent [num_blocks, block_size, 1, kv_lora_rank]``
holds each token's compressed KV ``c``; ``rope [num_blocks, block_size, 1, rope_dim]``
its rotary key ``k_pe``.

* ``write_latent_cache``: store ``c`` and ``k_pe`` at the tokens' slots.
* ``mla_decode``: absorbed decode. ``q_nope [B, H, L]`` is already multiplied by
  ``W_UK``; scores are ``q_nope . c + q_pe . k_pe``, output ``[B, H, L]`` is
  ``softmax . c`` (the caller applies ``W_UV``). ``seq_lens`` is a host list. With
  ``return_lse`` it also gives the log-sum-exp (context parallelism combines ranks by it).
* ``prefill_attention``: ordinary causal attention of the prefill queries over each
  request's expanded keys/values (``q [T, H, Dqk]``, ``k [S, H, Dqk]``, ``v [S, H, Dv]``,
  requests concatenated; query ``i`` of a request sees its first ``kv_len - q_len + i + 1``
  keys), which covers chunked prefill and prefix-cache hits. ``k``/``v`` may have fewer
  heads than ``q`` (grouped-query attention: the GQA backend's context-parallel prefill).
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import pick, torch_npu
from vllm.ascend.kernels.attention import (
    causal_attention,
    causal_mask,
    empty_rows_to_identity,
    npu_slots,
    valid_slots,
)

# torch_npu's FIA in its MLA form (query_rope/key_rope): latent 512, rope 64, and
# 32, 64 or 128 query heads (fewer heads are padded).
NPU_MLA_LATENT, NPU_MLA_ROPE, NPU_MLA_HEADS = 512, 64, (32, 64, 128)


def head_major(plane: torch.Tensor) -> torch.Tensor:
    """``[blocks, block_size, 1, D]`` as ``[blocks, 1, block_size, D]`` (same memory: one head)."""
    return plane.view(plane.shape[0], 1, plane.shape[1], plane.shape[3])


# -- reference --------------------------------------------------------------------------
def reference_write_latent_cache(kv_c, k_pe, latent, rope, slot_mapping) -> None:
    slots, valid = valid_slots(slot_mapping, kv_c.shape[0])
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    if valid is not None:
        kv_c, k_pe = kv_c[valid], k_pe[valid]
    latent.view(-1, latent.shape[-1])[slots] = kv_c.to(latent.dtype)
    rope.view(-1, rope.shape[-1])[slots] = k_pe.to(rope.dtype)


def _gather(plane, block_row, seq_len):
    from vllm.ascend.kernels.attention import gather_tokens

    return gather_tokens(head_major(plane), block_row, seq_len)[:, 0]  # [seq, D]


def reference_mla_decode(
    q_nope, q_pe, latent, rope, block_table, seq_lens: list[int], scale, return_lse: bool = False
):
    """With ``return_lse`` also the softmax log-sum-exp ``[B, H]`` (float32; -inf and a zero
    output for a row with no keys on this rank)."""
    out = q_nope.new_zeros(q_nope.shape)
    lse = torch.full(q_nope.shape[:2], float("-inf"), dtype=torch.float32, device=q_nope.device)
    for b, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            continue
        c = _gather(latent, block_table[b], seq_len).float()
        pe = _gather(rope, block_table[b], seq_len).float()
        scores = (q_nope[b].float() @ c.t() + q_pe[b].float() @ pe.t()) * scale  # [H, seq]
        lse[b] = torch.logsumexp(scores, dim=-1)
        out[b] = (torch.softmax(scores, dim=-1) @ c).to(out.dtype)
    return (out, lse) if return_lse else out


def reference_prefill_attention(q, k, v, q_lens: list[int], kv_lens: list[int], scale) -> torch.Tensor:
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each KV head serves a group of query heads
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    q_start = kv_start = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        if q_len:
            out[q_start : q_start + q_len] = causal_attention(
                q[q_start : q_start + q_len],
                k[kv_start : kv_start + kv_len],
                v[kv_start : kv_start + kv_len],
                kv_len - q_len,
                scale,
            )
        q_start, kv_start = q_start + q_len, kv_start + kv_len
    return out


# -- NPU (torch_npu; passes the contract double in CI, not verified on an NPU) ----------
def npu_write_latent_cache(kv_c, k_pe, latent, rope, slot_mapping) -> None:
    """ATB ReshapeAndCache with key = ``c`` and value = ``k_pe`` (their last dims may
    differ), one head each."""
    num_tokens = kv_c.shape[0]
    if num_tokens == 0:
        return
    torch_npu()._npu_reshape_and_cache(
        key=kv_c.reshape(num_tokens, 1, -1).to(latent.dtype),
        value=k_pe.reshape(num_tokens, 1, -1).to(rope.dtype),
        key_cache=latent,
        value_cache=rope,
        slot_indices=npu_slots(slot_mapping, num_tokens).to(torch.int32),
    )


def npu_padded_heads(num_heads: int) -> int:
    for n in NPU_MLA_HEADS:
        if num_heads <= n:
            return n
    raise ValueError(
        f"the NPU MLA decode kernel takes at most {NPU_MLA_HEADS[-1]} query heads per rank, "
        f"got {num_heads}; raise the tensor-parallel size"
    )


def npu_mla_decode(
    q_nope, q_pe, latent, rope, block_table, seq_lens: list[int], scale, return_lse: bool = False
):
    """``npu_fused_infer_attention_score`` in its MLA form: BNSD query ``c``-space parts
    (heads padded to 32/64/128), ``query_rope``/``key_rope`` the rotary parts, value = ``c``;
    ``softmax_lse_flag`` gives the log-sum-exp as ``[B, N, S, 1]``."""
    batch, heads, rank = q_nope.shape
    padded = npu_padded_heads(heads)
    query = q_nope.new_zeros(batch, padded, 1, rank)
    query[:, :heads, 0] = q_nope
    query_rope = q_pe.new_zeros(batch, padded, 1, q_pe.shape[-1])
    query_rope[:, :heads, 0] = q_pe
    latent_bnsd = head_major(latent)
    out, lse = torch_npu().npu_fused_infer_attention_score(
        query,
        latent_bnsd,
        latent_bnsd,
        query_rope=query_rope,
        key_rope=head_major(rope),
        num_heads=padded,
        num_key_value_heads=1,
        input_layout="BNSD",
        scale=scale,
        block_table=block_table,
        block_size=latent.shape[1],
        actual_seq_lengths_kv=seq_lens,
        softmax_lse_flag=return_lse,
    )
    if not return_lse:
        return out[:, :heads, 0]
    return empty_rows_to_identity(out[:, :heads, 0], lse[:, :heads, 0, 0], seq_lens)


def npu_prefill_attention(q, k, v, q_lens: list[int], kv_lens: list[int], scale) -> torch.Tensor:
    """``npu_fused_infer_attention_score`` in TND layout without page attention; key and
    value must have the same shape, so V is zero-padded to the query/key head size."""
    if not q_lens or sum(q_lens) == 0:
        return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    dv = v.shape[-1]
    if dv < k.shape[-1]:
        v = torch.nn.functional.pad(v, (0, k.shape[-1] - dv))
    q_cum = torch.tensor(q_lens).cumsum(0).tolist()
    kv_cum = torch.tensor(kv_lens).cumsum(0).tolist()
    out, _ = torch_npu().npu_fused_infer_attention_score(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        num_heads=q.shape[1],
        num_key_value_heads=k.shape[1],
        scale=scale,
        input_layout="TND",
        actual_seq_lengths=q_cum,
        actual_seq_lengths_kv=kv_cum,
        atten_mask=causal_mask(q.device),
        sparse_mode=3,
    )
    return out[..., :dv]


def check_npu_dims(kv_lora_rank: int, rope_dim: int) -> None:
    if (kv_lora_rank, rope_dim) != (NPU_MLA_LATENT, NPU_MLA_ROPE):
        raise ValueError(
            f"the NPU MLA decode kernel (torch_npu npu_fused_infer_attention_score, MLA form) needs "
            f"kv_lora_rank {NPU_MLA_LATENT} and qk_rope_head_dim {NPU_MLA_ROPE}; this model has "
            f"{kv_lora_rank} and {rope_dim}"
        )


write_latent_cache = pick(reference_write_latent_cache, npu_write_latent_cache)
mla_decode = pick(reference_mla_decode, npu_mla_decode)
prefill_attention = pick(reference_prefill_attention, npu_prefill_attention)
