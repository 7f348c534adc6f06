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

from vllm.ascend.kernels import use_reference


# -- reference (plain torch; the oracle and host emulation) --------------------------
def reference_write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    slots = slot_mapping[: key.shape[0]].to(torch.int64)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[: valid.numel()][valid], value[: valid.numel()][valid]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


def reference_paged_attention(query, key_cache, value_cache, block_table, query_start_loc,
                              seq_lens, scale, out) -> torch.Tensor:
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    block_size = key_cache.shape[1]
    group = num_heads // num_kv_heads
    qsl = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[r], qsl[r + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[r, :num_blocks].to(torch.int64)
        k = key_cache[blocks].reshape(-1, num_kv_heads, key_cache.shape[-1])[:seq_len]
        v = value_cache[blocks].reshape(-1, num_kv_heads, value_cache.shape[-1])[:seq_len]
        q = query[start:end].transpose(0, 1).float()  # [H, q_len, D]
        k = k.transpose(0, 1).float().repeat_interleave(group, dim=0)  # [H, seq, D]
        v = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
        context = seq_len - q_len
        q_pos = torch.arange(q_len, device=query.device).unsqueeze(1) + context
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        mask = k_pos <= q_pos  # [q_len, seq]
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start:end] = attn.transpose(0, 1).to(out.dtype)
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


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    if use_reference():
        return reference_write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    return npu_write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                    scale, out) -> torch.Tensor:
    fn = reference_paged_attention if use_reference() else npu_paged_attention
    return fn(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, out)
