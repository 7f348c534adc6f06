"""The contract double's CPU kernels for DeepSeek sparse attention: npu_lightning_indexer
(each query row's top-k key positions) and npu_sparse_flash_attention (MLA-absorb attention
over the selected positions), both over a paged cache (``PA_BSND``) with TND queries, the
only forms the double models.

The indexer scores a key as ``sum_h w_h relu(q_h . k)`` in float32 (op-plugin's page
formula and its test golden, ``test_npu_lightning_indexer.py``). Under ``sparse_mode`` 3
row ``i`` of a batch's ``S1`` rows sees keys ``< S2 - S1 + i + 1``; the golden ranks the
keys it does not see at -inf *after* the visible ones, within the first ``min(sparse_count,
S2)`` entries, and -1 fills the rest. The double does the same (masked positions in
ascending order; the kernel's order for them is not documented): a caller must not read
an entry as visible because it is not -1, and the attention's own ``sparse_mode`` 3
masks them. Ties in score go to the lower position (undocumented too).
"""

from __future__ import annotations

import torch

from .._rules import require, unmodelled
from ._common import HALF_TYPES

LI = "npu_lightning_indexer"
SFA = "npu_sparse_flash_attention"
INT64_MAX = (1 << 63) - 1
SPARSE_COUNTS = frozenset(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}
SFA_HEADS = frozenset(1 << i for i in range(8))  # 1..128, powers of two (A2/A3)


def _desc(t):
    return None if t is None else (t.dtype, tuple(t.shape))


def _query_ends(lengths, t: int, op: str, rule: str) -> list[int]:
    """TND: each batch's end row (a prefix sum), none past T."""
    require(
        lengths is not None and lengths.dtype == torch.int32 and lengths.dim() == 1 and lengths.numel() > 0,
        op,
        rule,
        f"actual_seq_lengths_query {_desc(lengths)}",
    )
    ends = lengths.tolist()
    require(
        all(e >= 0 for e in ends) and all(a <= b for a, b in zip(ends, ends[1:])) and ends[-1] <= t,
        op,
        rule,
        f"actual_seq_lengths_query {ends} (prefix sums, none past T={t})",
    )
    return ends


def _paged(cache, block_table, lengths, batch: int, op: str, lengths_rule: str, table_rule: str):
    """Each batch's keys gathered through its block table: ``[S2_b, D]`` per batch."""
    blocks, block_size = cache.shape[0], cache.shape[1]
    require(
        lengths is not None
        and lengths.dtype == torch.int32
        and tuple(lengths.shape) == (batch,)
        and bool(lengths.ge(0).all()),
        op,
        lengths_rule,
        f"{_desc(lengths)} for {batch} batches",
    )
    kv = lengths.tolist()
    most = -(-max(kv) // block_size)
    require(
        block_table is not None
        and block_table.dtype == torch.int32
        and block_table.dim() == 2
        and block_table.shape[0] == batch
        and block_table.shape[1] >= most,
        op,
        table_rule,
        f"block_table {_desc(block_table)}; wants int32 ({batch}, >= {most})",
    )
    out = []
    for b, n in enumerate(kv):
        ids = block_table[b, : -(-n // block_size)].long()
        require(
            bool(ids.ge(0).all() and ids.lt(blocks).all()),
            op,
            table_rule,
            f"batch {b} names blocks {ids.tolist()} of a {blocks}-block cache",
        )
        out.append(cache[ids].reshape(-1, cache.shape[-1])[:n].float())
    return out


def _visible(s1: int, s2: int, row: int, sparse_mode: int) -> int:
    return s2 if sparse_mode == 0 else max(0, min(s2, s2 - s1 + row + 1))


def npu_lightning_indexer(
    query,
    key,
    weights,
    actual_seq_lengths_query,
    actual_seq_lengths_key,
    block_table,
    layout_query,
    layout_key,
    sparse_count,
    sparse_mode,
    pre_tokens,
    next_tokens,
    return_value,
):
    op = LI
    if (layout_query, layout_key) != ("TND", "PA_BSND"):
        raise unmodelled(op, f"layout_query={layout_query!r}, layout_key={layout_key!r}")
    if return_value or pre_tokens != INT64_MAX or next_tokens != INT64_MAX:
        raise unmodelled(op, "return_value, pre_tokens or next_tokens set (training and sliding forms)")
    require(
        query.dtype in HALF_TYPES and query.is_contiguous() and query.dim() == 3,
        op,
        "LI.query",
        f"query {_desc(query)}, contiguous {query.is_contiguous()}",
    )
    require(
        key.dtype == query.dtype and key.is_contiguous() and key.dim() == 4,
        op,
        "LI.key",
        f"key {_desc(key)}, contiguous {key.is_contiguous()}; query {query.dtype}",
    )
    t, n1, d = query.shape
    block_size, n2, dk = key.shape[1:]
    require(
        n2 == 1 and d == dk == 128 and 0 < n1 <= 64 and block_size % 16 == 0 and 0 < block_size <= 1024,
        op,
        "LI.dims",
        f"query heads {n1}, key heads {n2}, D {d}/{dk}, block size {block_size}",
    )
    require(
        weights is not None
        and weights.dtype == query.dtype
        and weights.is_contiguous()
        and tuple(weights.shape) == (t, n1),
        op,
        "LI.weights",
        f"weights {_desc(weights)}; wants {query.dtype} ({t}, {n1})",
    )
    require(sparse_count in SPARSE_COUNTS, op, "LI.sparse_count", f"sparse_count {sparse_count}")
    require(sparse_mode in (0, 3), op, "LI.sparse_mode", f"sparse_mode {sparse_mode}")
    ends = _query_ends(actual_seq_lengths_query, t, op, "LI.lengths")
    keys = _paged(key, block_table, actual_seq_lengths_key, len(ends), op, "LI.key_lengths", "LI.block_table")
    out = torch.full((t, 1, sparse_count), -1, dtype=torch.int32)
    start = 0
    for end, k in zip(ends, keys):
        s1, s2 = end - start, k.shape[0]
        if s1 and s2:
            q, w = query[start:end].float(), weights[start:end].float()
            scores = (torch.einsum("shd,kd->shk", q, k).clamp_min(0) * w[..., None]).sum(1)  # [s1, s2]
            for row in range(s1):
                seen = _visible(s1, s2, row, sparse_mode)
                # stable descending sort: equal scores keep the lower position first
                ranked = torch.sort(scores[row, :seen], descending=True, stable=True).indices.tolist()
                picks = (ranked + list(range(seen, s2)))[:sparse_count]
                out[start + row, 0, : len(picks)] = torch.tensor(picks, dtype=torch.int32)
        start = end
    return out, torch.empty(0, dtype=query.dtype)


def npu_sparse_flash_attention(
    query,
    key,
    value,
    sparse_indices,
    scale_value,
    block_table,
    actual_seq_lengths_query,
    actual_seq_lengths_kv,
    query_rope,
    key_rope,
    sparse_block_size,
    layout_query,
    layout_kv,
    sparse_mode,
    pre_tokens,
    next_tokens,
    attention_mode,
    return_softmax_lse,
    sinks,
):
    op = SFA
    if (layout_query, layout_kv) != ("TND", "PA_BSND"):
        raise unmodelled(op, f"layout_query={layout_query!r}, layout_kv={layout_kv!r}")
    if return_softmax_lse or pre_tokens != INT64_MAX or next_tokens != INT64_MAX:
        raise unmodelled(op, "return_softmax_lse, pre_tokens or next_tokens set (training and sliding forms)")
    if value is None:
        raise unmodelled(op, "value=None (CANN 9.2's shared key/value form)")
    require(attention_mode == 2 and sinks is None, op, "SFA.modes", f"attention_mode {attention_mode}, sinks")
    if sparse_block_size != 1:
        raise unmodelled(op, f"sparse_block_size {sparse_block_size} (block-wise selection)")
    if sparse_mode not in (0, 3):
        raise unmodelled(op, f"sparse_mode {sparse_mode}")
    require(
        query.dtype in HALF_TYPES and query.is_contiguous() and query.dim() == 3,
        op,
        "SFA.query",
        f"query {_desc(query)}, contiguous {query.is_contiguous()}",
    )
    for name, cache in (("key", key), ("value", value), ("key_rope", key_rope)):
        require(
            cache is not None and cache.is_contiguous() and cache.dim() == 4,
            op,
            "SFA.kv",
            f"{name} {_desc(cache)}, contiguous {cache is not None and cache.is_contiguous()}",
        )
    t, n1, d = query.shape
    blocks, block_size, kv_n, dk = key.shape
    require(
        query_rope is not None
        and tuple(query_rope.shape) == (t, n1, 64)
        and query_rope.is_contiguous()
        and tuple(key_rope.shape) == (blocks, block_size, 1, 64)
        and tuple(value.shape) == tuple(key.shape)
        and d == dk == 512
        and kv_n == 1
        and n1 in SFA_HEADS
        and query.dtype == key.dtype == value.dtype == query_rope.dtype == key_rope.dtype,
        op,
        "SFA.dims",
        f"query {_desc(query)}, key {_desc(key)}, value {_desc(value)}, query_rope {_desc(query_rope)}, "
        f"key_rope {_desc(key_rope)}",
    )
    require(block_size % 16 == 0 and block_size <= 1024, op, "SFA.blocks", f"block size {block_size}")
    require(
        sparse_indices.dtype == torch.int32
        and sparse_indices.is_contiguous()
        and sparse_indices.dim() == 3
        and tuple(sparse_indices.shape[:2]) == (t, 1)
        and sparse_indices.shape[2] > 0,
        op,
        "SFA.indices",
        f"sparse_indices {_desc(sparse_indices)}; wants int32 ({t}, 1, sparse_size)",
    )
    ends = _query_ends(actual_seq_lengths_query, t, op, "SFA.lengths")
    batch = len(ends)
    keys = _paged(key, block_table, actual_seq_lengths_kv, batch, op, "SFA.kv_lengths", "SFA.block_table")
    values = _paged(value, block_table, actual_seq_lengths_kv, batch, op, "SFA.kv_lengths", "SFA.block_table")
    ropes = _paged(
        key_rope, block_table, actual_seq_lengths_kv, batch, op, "SFA.kv_lengths", "SFA.block_table"
    )
    out = torch.full((t, n1, d), float("nan"))  # rows past the last batch: never written
    start = 0
    for end, k, v, kr in zip(ends, keys, values, ropes):
        s1, s2 = end - start, k.shape[0]
        for row in range(s1):
            entries = sparse_indices[start + row, 0].tolist()
            valid = entries[: entries.index(-1)] if -1 in entries else entries
            require(
                all(e == -1 for e in entries[len(valid) :]) and all(0 <= e < s2 for e in valid),
                op,
                "SFA.indices",
                f"row {start + row}: entries {entries[:16]}... for {s2} keys (valid ones first, then -1)",
            )
            if len(set(valid)) != len(valid):
                raise unmodelled(op, f"a position selected twice in row {start + row}")
            seen = _visible(s1, s2, row, sparse_mode)
            picked = torch.tensor([e for e in valid if e < seen], dtype=torch.long)
            if picked.numel() == 0:
                raise unmodelled(op, f"row {start + row} with no visible selected position")
            q, qr = query[start + row].float(), query_rope[start + row].float()  # [N1, 512], [N1, 64]
            logits = (q @ k[picked].T + qr @ kr[picked].T) * scale_value
            out[start + row] = torch.softmax(logits, dim=-1) @ v[picked]
        start = end
    empty = torch.empty(0, dtype=torch.float32)
    return out.to(query.dtype), empty, empty.clone()
