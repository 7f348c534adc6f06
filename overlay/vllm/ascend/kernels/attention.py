"""Paged KV-cache write and paged attention (prefill, chunked prefill, decode).

Cache layout (what vLLM hands the backend, viewed per layer): ``key_cache`` and
``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_size]`` views; token
slot ``s`` lives at block ``s // block_size``, offset ``s % block_size``.

Contract of ``paged_attention``: for request ``r`` with queries
``query[qsl[r]:qsl[r+1]]`` (the last ``q_len`` tokens of a sequence of ``seq_lens[r]``
tokens whose K/V are all in the cache), query ``i`` attends causally to cache
positions ``0 .. seq_lens[r] - q_len + i``. This one rule covers prefill, chunked
prefill, prefix-cache hits and decode.
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import pick


# -- reference (plain torch; the oracle and host emulation) --------------------------
def valid_slots(slot_mapping, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first ``num_tokens`` slots as int64, and a mask of the non-padding ones
    (None when every slot is real, the common case)."""
    slots = slot_mapping[:num_tokens].to(torch.int64)
    valid = slots >= 0
    return (slots, None) if bool(valid.all()) else (slots[valid], valid)


def gather_tokens(cache, block_row, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` token rows of one request from a ``[blocks, block_size, ...]`` cache."""
    block_size = cache.shape[1]
    blocks = block_row[: -(-seq_len // block_size)].to(torch.int64)
    return cache[blocks].flatten(0, 1)[:seq_len]


def causal_attention(q, k, v, context_len: int, scale: float) -> torch.Tensor:
    """``q [q_len, H, D]`` are the last ``q_len`` of the ``k/v [seq, H, D]`` positions;
    query ``i`` sees positions ``0 .. context_len + i``. Computed in float32."""
    q_len, seq_len = q.shape[0], k.shape[0]
    q_pos = torch.arange(q_len, device=q.device).unsqueeze(1) + context_len
    mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        attn_mask=mask, scale=scale)
    return out.transpose(0, 1).to(q.dtype)


def reference_write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    slots, valid = valid_slots(slot_mapping, key.shape[0])
    if valid is not None:
        key, value = key[valid], value[valid]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


def reference_paged_attention(query, key_cache, value_cache, block_table, query_start_loc,
                              seq_lens, scale, out) -> torch.Tensor:
    group = query.shape[1] // key_cache.shape[2]
    qsl = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[r], qsl[r + 1]
        if end == start:
            continue
        k = gather_tokens(key_cache, block_table[r], seq_len).repeat_interleave(group, dim=1)
        v = gather_tokens(value_cache, block_table[r], seq_len).repeat_interleave(group, dim=1)
        out[start:end] = causal_attention(query[start:end], k, v, seq_len - (end - start), scale)
    return out


# -- NPU (torch_npu; written against its documentation, not verified here) ------------
def npu_write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    import torch_npu  # only on NPU hosts; the device layer has loaded it already

    torch_npu._npu_reshape_and_cache(
        key=key, value=value, key_cache=key_cache, value_cache=value_cache,
        slot_indices=slot_mapping[: key.shape[0]].to(torch.int32))


def npu_paged_attention(query, key_cache, value_cache, block_table, query_start_loc,
                        seq_lens, scale, out) -> torch.Tensor:
    import torch_npu

    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    block_size = key_cache.shape[1]
    qsl = query_start_loc.to(torch.int64)
    result, _ = torch_npu.npu_fused_infer_attention_score(
        query[: int(qsl[-1])], key_cache.flatten(2), value_cache.flatten(2),
        num_heads=num_heads, num_key_value_heads=num_kv_heads, scale=scale,
        input_layout="TND", block_table=block_table.to(torch.int32), block_size=block_size,
        actual_seq_lengths=qsl[1:].tolist(), actual_seq_lengths_kv=seq_lens.tolist(),
        sparse_mode=3,  # causal, aligned to the end of each sequence
    )
    out[: result.shape[0]] = result
    return out


write_kv_cache = pick(reference_write_kv_cache, npu_write_kv_cache)
paged_attention = pick(reference_paged_attention, npu_paged_attention)
