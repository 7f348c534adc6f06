"""The contract double's CPU kernels for attention: npu_fused_infer_attention_score (and
v2, and the graph forms), npu_attention_update."""

from __future__ import annotations

import torch

from .._rules import require, unmodelled
from ._common import FIA, HALF_TYPES, INT_MAX, MASK_SIZE, _refuse_unmodelled

# -- npu_fused_infer_attention_score -------------------------------------------------------
_FIA_UNMODELLED = (
    "pse_shift",
    "dequant_scale1",
    "quant_scale1",
    "dequant_scale2",
    "quant_scale2",
    "quant_offset2",
    "antiquant_scale",
    "antiquant_offset",
    "key_antiquant_scale",
    "key_antiquant_offset",
    "value_antiquant_scale",
    "value_antiquant_offset",
    "query_padding_size",
    "kv_padding_size",
    "key_shared_prefix",
    "value_shared_prefix",
    "actual_shared_prefix_len",
    "key_rope_antiquant_scale",
)


def _check_mask(mask: torch.Tensor | None, sparse_mode: int) -> None:
    if sparse_mode not in (2, 3, 4):
        return
    require(mask is not None, FIA, "FIA.mask_2048", f"sparse_mode={sparse_mode} needs atten_mask")
    require(
        mask.shape[-2:] == (MASK_SIZE, MASK_SIZE)
        and all(s == 1 for s in mask.shape[:-2])
        and mask.dim() in (2, 3, 4),
        FIA,
        "FIA.mask_2048",
        f"atten_mask for sparse_mode={sparse_mode} must be 2048x2048, got {tuple(mask.shape)}",
    )
    require(
        mask.dtype in (torch.bool, torch.int8, torch.uint8) and mask.is_contiguous(),
        FIA,
        "FIA.mask_dtype",
        f"atten_mask must be a contiguous bool/int8/uint8 tensor, got {mask.dtype}",
    )
    if sparse_mode in (3, 4):  # rightDownCausal and band take the same optimised mask
        square = mask.reshape(MASK_SIZE, MASK_SIZE)
        # Fully once per mask tensor (callers build it once), then a sample of rows on
        # every call (inference tensors carry no version counter to tell a rewrite).
        verdict = getattr(mask, "_contract_double_causal", None)  # lives and dies with the tensor
        if verdict is None:
            expected = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu(1)
            verdict = bool(torch.equal(square.to(torch.bool), expected))
            mask._contract_double_causal = verdict
        rows = torch.randint(0, MASK_SIZE, (16,))
        sample_ok = torch.equal(
            square[rows].to(torch.bool), torch.arange(MASK_SIZE).unsqueeze(0) > rows.unsqueeze(1)
        )
        require(
            verdict and sample_ok,
            FIA,
            f"FIA.sparse_{sparse_mode}",
            "the optimised mask must be 1 exactly above the diagonal (triu(ones(2048, 2048), 1))",
        )


def _visible_keys(sparse_mode, q_len, kv_len, pre_tokens, next_tokens):
    """[q_len, kv_len] bool, the keys each query row attends to (None: all of them).

    The optimised masks align query row i with key ``kv_len - q_len + i`` (rightDown): the
    doc's rows that are "not computed" under band are those with pre_tokens < 0 or
    next_tokens + KV_S - Q_S < 0 (FIA.band_rows)."""
    if sparse_mode == 0:
        return None
    diagonal = torch.arange(q_len).unsqueeze(1) + (kv_len - q_len)
    keys = torch.arange(kv_len).unsqueeze(0)
    if sparse_mode == 3:
        return keys <= diagonal
    if sparse_mode == 4:
        return (keys >= diagonal - pre_tokens) & (keys <= diagonal + next_tokens)
    raise unmodelled(FIA, f"sparse_mode={sparse_mode}")


def _attend(q, k, v, scale, visible, q_rope=None, k_rope=None, sink=None):
    """q [S, N, D], k/v [L, KVN, D] -> out [S, N, Dv] float32, lse [S, N]; ``visible``:
    [S, L] bool of the keys each query attends to (None: all). ``sink`` [N]: v2's
    learnable sink, one more logit per head in every row's softmax, with no value."""
    n, kvn = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(n // kvn, dim=1)
    v = v.float().repeat_interleave(n // kvn, dim=1)
    scores = torch.einsum("snd,lnd->nsl", q.float(), k)
    if q_rope is not None:
        k_rope = k_rope.float().repeat_interleave(n // kvn, dim=1)
        scores = scores + torch.einsum("snd,lnd->nsl", q_rope.float(), k_rope)
    scores = scores * scale
    if visible is not None:
        scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    keys = scores.shape[-1]
    if sink is not None:  # one more column per head, whose weight is dropped
        scores = torch.cat([scores, sink.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)  # [N, S]
    out = torch.einsum("nsl,lnd->snd", torch.softmax(scores, dim=-1)[..., :keys], v)
    return out, lse.transpose(0, 1)


def _paged_rows(
    cache: torch.Tensor, table_row: torch.Tensor, length: int, block_size: int, kv_heads: int
) -> torch.Tensor:
    """The first ``length`` token rows [L, KVN, D] of one sequence from a paged cache in
    either documented format: (blocknum, blocksize, H) or (blocknum, KV_N, blocksize, D)."""
    blocks = table_row[: -(-length // block_size)].to(torch.int64)
    if cache.dim() == 3:
        rows = cache[blocks].reshape(-1, kv_heads, cache.shape[-1] // kv_heads)
    else:
        rows = cache[blocks].transpose(1, 2).reshape(-1, kv_heads, cache.shape[-1])
    return rows[:length]


def _check_paged(op, key, block_table, block_size, kv_lengths, batch, kv_heads, strict_block):
    require(
        block_table.dtype == torch.int32, op, "FIA.block_table_dtype", f"block_table is {block_table.dtype}"
    )
    require(kv_lengths is not None, op, "FIA.pa_kv_lengths", "actual_seq_lengths_kv is missing")
    require(
        len(kv_lengths) == batch and all(n >= 0 for n in kv_lengths),
        op,
        "FIA.pa_kv_lengths_per_batch",
        f"need {batch} non-negative per-batch KV lengths, got {list(kv_lengths)}",
    )
    needed = [-(-n // block_size) for n in kv_lengths]
    require(
        block_table.dim() == 2
        and block_table.shape[0] == batch
        and block_table.shape[1] >= max(needed, default=0),
        op,
        "FIA.block_table_shape",
        f"block_table {tuple(block_table.shape)} for batch {batch} needing {max(needed, default=0)} blocks",
    )
    require(
        key.shape[0] >= sum(needed),
        op,
        "FIA.blocknum",
        f"{key.shape[0]} cache blocks < {sum(needed)} blocks the batch's KV lengths need",
    )
    if key.dim() == 4:
        require(
            key.shape[1] == kv_heads and key.shape[2] == block_size,
            op,
            "FIA.pa_kv_layout",
            f"4-D cache must be (blocknum, KV_N={kv_heads}, blocksize={block_size}, D), "
            f"got {tuple(key.shape)}",
        )
    else:
        require(
            key.dim() == 3 and key.shape[1] == block_size,
            op,
            "FIA.pa_kv_layout",
            f"3-D cache must be (blocknum, blocksize={block_size}, H), got {tuple(key.shape)}",
        )
    if strict_block:
        require(
            128 <= block_size <= 512 and block_size % 128 == 0,
            op,
            "FIA.pa_block_size",
            f"block_size {block_size} with query length > 1",
        )
    else:
        require(
            0 < block_size <= 512 and block_size % 16 == 0,
            op,
            "FIA.pa_block_size",
            f"block_size {block_size} (decode needs 16-aligned, at most 512)",
        )


def _tnd_cumulative(op, lengths, total, rule) -> list[int]:
    require(lengths is not None, op, rule, "TND needs cumulative sequence lengths")
    lengths = list(lengths)
    require(
        all(n >= 0 for n in lengths) and all(b >= a for a, b in zip(lengths, lengths[1:])),
        op,
        rule,
        f"cumulative lengths must be non-negative and non-decreasing, got {lengths}",
    )
    require(
        bool(lengths) and lengths[-1] == total,
        op,
        rule,
        f"the last cumulative length {lengths[-1] if lengths else None} must equal the {total} rows",
    )
    return lengths


def _check_dense_tnd(query, key, value, num_heads, kv_heads, sparse_mode, mask) -> None:
    """The combined limits of TND without page attention (the docs' "TND场景下query、key、value
    输入的综合限制")."""
    require(
        query.shape[0] <= 65536 and key.shape[0] <= 65536,
        FIA,
        "FIA.tnd_dense_t",
        f"T={query.shape[0]} (query), {key.shape[0]} (key/value)",
    )
    require(
        num_heads in (8, 16, 32, 64, 128)
        and kv_heads == num_heads
        and key.dim() == 3
        and value.dim() == 3
        and key.shape[1] == value.shape[1] == num_heads,
        FIA,
        "FIA.tnd_dense_heads",
        f"num_heads={num_heads}, num_key_value_heads={kv_heads}, key {tuple(key.shape)}, "
        f"value {tuple(value.shape)}",
    )
    require(
        query.shape[-1] == 192 and key.shape[-1] == 192 and value.shape[-1] in (128, 192),
        FIA,
        "FIA.tnd_dense_d",
        f"Q_D={query.shape[-1]}, K_D={key.shape[-1]}, V_D={value.shape[-1]}",
    )
    require(
        key.shape[0] == value.shape[0],
        FIA,
        "FIA.tnd_kv_lengths",
        f"key T={key.shape[0]}, value T={value.shape[0]}",
    )
    require(
        query.dtype == key.dtype == value.dtype == torch.bfloat16,
        FIA,
        "FIA.tnd_dense_dtype",
        f"query/key/value {query.dtype}/{key.dtype}/{value.dtype}",
    )
    require(
        (sparse_mode == 0 and mask is None) or (sparse_mode == 3 and mask is not None),
        FIA,
        "FIA.tnd_dense_sparse",
        f"sparse_mode={sparse_mode} with{'out' if mask is None else ''} atten_mask",
    )


def npu_fused_infer_attention_score(**a):
    _refuse_unmodelled(FIA, a, _FIA_UNMODELLED)
    if a["softmax_lse_flag"] and a["input_layout"] != "TND" and a["query_rope"] is None:
        raise unmodelled(FIA, "softmax_lse_flag outside TND and the MLA form")
    query, key, value = a["query"], a["key"], a["value"]
    num_heads, layout, sparse_mode = a["num_heads"], a["input_layout"], a["sparse_mode"]
    kv_heads = a["num_key_value_heads"] or num_heads
    block_table, q_rope, k_rope = a["block_table"], a["query_rope"], a["key_rope"]

    require(
        query.dtype in (*HALF_TYPES, torch.int8) and query.is_contiguous(),
        FIA,
        "FIA.query",
        f"query is {query.dtype}, contiguous={query.is_contiguous()}",
    )
    require(key.is_contiguous(), FIA, "FIA.key", "key is not contiguous")
    require(value.is_contiguous(), FIA, "FIA.value", "value is not contiguous")
    require(
        key.dtype in (*HALF_TYPES, torch.int8) and value.dtype == key.dtype,
        FIA,
        "FIA.kv_dtype",
        f"key/value are {key.dtype}/{value.dtype}",
    )
    dense_tnd = layout == "TND" and block_table is None and q_rope is None
    if not dense_tnd:  # the dense TND form allows V_D != K_D (FIA.tnd_dense_d)
        require(
            key.shape == value.shape, FIA, "FIA.kv_same_shape", f"{tuple(key.shape)} vs {tuple(value.shape)}"
        )
    require(sparse_mode in (0, 1, 2, 3, 4), FIA, "FIA.sparse_values", f"sparse_mode={sparse_mode}")
    require((q_rope is None) == (k_rope is None), FIA, "FIA.rope_pair", "query_rope and key_rope go together")
    _check_mask(a["atten_mask"], sparse_mode)
    if block_table is not None:
        require(query.dtype != torch.int8, FIA, "FIA.pa_no_int8_query", "int8 query with page attention")
    scale = a["scale"]

    if q_rope is not None:
        return _fia_mla_paged(a, query, key, value, q_rope, k_rope, num_heads, layout, sparse_mode, scale)
    if layout != "TND":
        raise unmodelled(FIA, f"input_layout={layout} without query_rope")
    # (The MLA form has its own head rule, 32/64/128 query heads over one KV head.)
    require(
        num_heads % kv_heads == 0 and num_heads // kv_heads <= 64,
        FIA,
        "FIA.heads",
        f"num_heads={num_heads}, num_key_value_heads={kv_heads}",
    )
    require(
        query.dim() == 3 and query.shape[1] == num_heads,
        FIA,
        "FIA.query",
        f"TND query must be [T, N={num_heads}, D], got {tuple(query.shape)}",
    )
    t, _, d = query.shape
    require(d % 16 == 0 or query.dtype == torch.int8, FIA, "FIA.d_align", f"D={d}")
    require(num_heads <= 256 and d <= 512, FIA, "FIA.n_d_limits", f"N={num_heads}, D={d}")
    if dense_tnd:
        _check_dense_tnd(query, key, value, num_heads, kv_heads, sparse_mode, a["atten_mask"])
    # TND's masks: none with sparse 0, the optimised one with 3 or 4 (the band: "sparse模式支持
    # sparse_mode=4且传入mask"); a defaultMask with sparse 0 is refused (vllm-ascend #15503: in paged
    # decode it is silently ignored past KV position 512)
    require(
        (sparse_mode, a["atten_mask"] is None) in ((0, True), (3, False), (4, False)),
        FIA,
        "FIA.tnd_sparse",
        f"sparse_mode={sparse_mode} with{'out' if a['atten_mask'] is None else ''} atten_mask in TND",
    )
    q_cum = _tnd_cumulative(FIA, a["actual_seq_lengths"], t, "FIA.tnd_seq_lengths")
    q_starts = [0] + q_cum[:-1]
    batch = len(q_cum)
    q_lens = [e - s for s, e in zip(q_starts, q_cum)]
    out = torch.empty(t, num_heads, value.shape[-1] if dense_tnd else d, dtype=torch.float32)
    lse = torch.empty(t, num_heads, 1, dtype=torch.float32)

    if block_table is not None:
        block_size = a["block_size"]
        kv_lens = list(a["actual_seq_lengths_kv"]) if a["actual_seq_lengths_kv"] is not None else None
        _check_paged(FIA, key, block_table, block_size, kv_lens, batch, kv_heads, max(q_lens, default=0) > 1)

        def kv_rows(b):
            return (
                _paged_rows(key, block_table[b], kv_lens[b], block_size, kv_heads),
                _paged_rows(value, block_table[b], kv_lens[b], block_size, kv_heads),
            )
    else:
        require(
            key.dim() == 3 and key.shape[1] == kv_heads,
            FIA,
            "FIA.key",
            f"TND key must be [S, KV_N={kv_heads}, D], got {tuple(key.shape)}",
        )
        kv_cum = _tnd_cumulative(FIA, a["actual_seq_lengths_kv"], key.shape[0], "FIA.tnd_kv_lengths")
        require(
            len(kv_cum) == batch, FIA, "FIA.tnd_kv_lengths", f"{len(kv_cum)} KV lengths for batch {batch}"
        )
        kv_starts = [0] + kv_cum[:-1]
        kv_lens = [e - s for s, e in zip(kv_starts, kv_cum)]

        def kv_rows(b):
            return key[kv_starts[b] : kv_cum[b]], value[kv_starts[b] : kv_cum[b]]

    mode, q_s = sparse_mode, max(q_lens, default=0)
    pre_tokens, next_tokens = a["pre_tokens"], a["next_tokens"]
    # One query row per batch: the doc's reading "Q_S为1且不带rope输入时该参数无效" (FIA.incremental_sparse)
    # is moot for rightDownCausal (a lone last row sees every key). The band is *not* dropped:
    # the incumbent's hardware runs contradict that reading in TND decode (vllm-ascend #8508 and
    # #8387 moved windowed decode to sparse_mode 4 with pre_tokens after outputs repeated; #15503:
    # a sparse-0 mask, the other route, is ignored past KV position 512), so the double applies it.
    if q_s <= 1 and mode == 3:
        mode = 0
    for b in range(batch):
        if q_lens[b] == 0:
            continue
        if sparse_mode == 3:
            # rightDownCausal with fewer keys than queries leaves rows with nothing to see.
            require(
                kv_lens[b] >= q_lens[b],
                FIA,
                "FIA.sparse_3",
                f"batch {b}: {q_lens[b]} queries but only {kv_lens[b]} keys",
            )
        if mode == 4:
            require(
                pre_tokens >= 0 and next_tokens + kv_lens[b] - q_lens[b] >= 0,
                FIA,
                "FIA.band_rows",
                f"batch {b}: pre_tokens={pre_tokens}, next_tokens={next_tokens}, "
                f"{q_lens[b]} queries over {kv_lens[b]} keys",
            )
        # (the rules above leave every row a key: rightDown rows see their diagonal, FIA.band_rows)
        visible = _visible_keys(mode, q_lens[b], kv_lens[b], pre_tokens, next_tokens)
        k, v = kv_rows(b)
        o, row_lse = _attend(query[q_starts[b] : q_cum[b]], k, v, scale, visible, sink=a.get("_sink"))
        out[q_starts[b] : q_cum[b]] = o
        lse[q_starts[b] : q_cum[b], :, 0] = row_lse
    result = out.to(query.dtype)
    if a["softmax_lse_flag"]:
        return result, lse
    return result, torch.zeros(1, dtype=torch.float32)


def _fia_mla_paged(a, query, key, value, q_rope, k_rope, num_heads, layout, sparse_mode, scale):
    """MLA form: query/key the latent parts (D=512), query_rope/key_rope the rotary parts (64)."""
    require(layout in ("BSH", "BSND", "BNSD"), FIA, "FIA.rope_layout", f"input_layout={layout}")
    if layout == "BSH":
        raise unmodelled(FIA, "BSH with query_rope")
    require(
        q_rope.is_contiguous() and q_rope.dtype in HALF_TYPES,
        FIA,
        "FIA.rope_contiguous",
        f"query_rope {q_rope.dtype} contiguous={q_rope.is_contiguous()}",
    )
    require(
        k_rope.is_contiguous() and k_rope.dtype in HALF_TYPES,
        FIA,
        "FIA.key_rope_contiguous",
        f"key_rope {k_rope.dtype} contiguous={k_rope.is_contiguous()}",
    )
    require(a["block_table"] is not None, FIA, "FIA.rope_block_size", "the MLA form needs page attention")
    bnsd = layout == "BNSD"
    require(
        query.dim() == 4, FIA, "FIA.rope_query", f"query must be 4-D in {layout}, got {tuple(query.shape)}"
    )
    batch, s_len = query.shape[0], query.shape[2] if bnsd else query.shape[1]
    n = query.shape[1] if bnsd else query.shape[2]
    require(
        1 <= s_len <= 16 and n in (32, 64, 128) and n == num_heads and query.shape[3] == 512,
        FIA,
        "FIA.rope_query",
        f"query {tuple(query.shape)} ({layout}), num_heads={num_heads}",
    )
    require(
        q_rope.shape[:3] == query.shape[:3] and q_rope.shape[3] == 64,
        FIA,
        "FIA.rope_query",
        f"query_rope {tuple(q_rope.shape)} for query {tuple(query.shape)}",
    )
    block_size = a["block_size"]
    kv_n = key.shape[1] if key.dim() == 4 else 1
    require(kv_n == 1 and key.shape[-1] == 512, FIA, "FIA.rope_key", f"key {tuple(key.shape)}")
    require(
        k_rope.shape[:-1] == key.shape[:-1] and k_rope.shape[-1] == 64,
        FIA,
        "FIA.rope_key",
        f"key_rope {tuple(k_rope.shape)} for key {tuple(key.shape)}",
    )
    require(block_size in (16, 128), FIA, "FIA.rope_block_size", f"block_size={block_size}")
    if s_len == 1:
        require(
            sparse_mode == 0 and a["atten_mask"] is None or sparse_mode == 4,
            FIA,
            "FIA.rope_sparse",
            f"Q_S=1 with sparse_mode={sparse_mode}",
        )
    else:
        require(
            sparse_mode in (3, 4) and a["atten_mask"] is not None,
            FIA,
            "FIA.rope_sparse",
            f"Q_S={s_len} with sparse_mode={sparse_mode}",
        )
    if sparse_mode == 4:
        raise unmodelled(FIA, "sparse_mode=4 in the MLA form")
    kv_lens = list(a["actual_seq_lengths_kv"]) if a["actual_seq_lengths_kv"] is not None else None
    block_table = a["block_table"]
    _check_paged(FIA, key, block_table, block_size, kv_lens, batch, 1, strict_block=False)
    q = query if not bnsd else query.transpose(1, 2)  # [B, S, N, D]
    qr = q_rope if not bnsd else q_rope.transpose(1, 2)
    out = torch.empty(q.shape, dtype=torch.float32)
    lse = torch.empty(batch, n, s_len, 1, dtype=torch.float32)  # [B, N, S, 1] outside TND
    for b in range(batch):
        latent = _paged_rows(key, block_table[b], kv_lens[b], block_size, 1)
        rope = _paged_rows(k_rope, block_table[b], kv_lens[b], block_size, 1)
        visible = None if s_len == 1 else _visible_keys(3, s_len, kv_lens[b], INT_MAX, INT_MAX)
        out[b], row_lse = _attend(q[b], latent, latent, scale, visible, q_rope=qr[b], k_rope=rope)
        lse[b, :, :, 0] = row_lse.transpose(0, 1)
    out = out.to(query.dtype)
    out = out.transpose(1, 2).contiguous() if bnsd else out
    return out, (lse if a["softmax_lse_flag"] else torch.zeros(1, dtype=torch.float32))


# -- npu_attention_update ------------------------------------------------------------------------
ATTENTION_UPDATE = "npu_attention_update"


def npu_attention_update(lse, local_out, update_type):
    """Merge per-rank partial attention outputs by their log-sum-exp (the documented formula)."""
    op = ATTENTION_UPDATE
    require(len(lse) == len(local_out), op, "AU.same_length", f"{len(lse)} lse vs {len(local_out)} local_out")
    require(1 <= len(lse) <= 16, op, "AU.sp", f"SP={len(lse)}")
    require(update_type in (0, 1), op, "AU.update_type", f"update_type={update_type}")
    rows = lse[0].shape[0] if lse[0].dim() == 1 else -1
    require(
        all(t.dim() == 1 and t.shape[0] == rows and t.dtype == torch.float32 for t in lse),
        op,
        "AU.lse",
        f"lse shapes {[tuple(t.shape) for t in lse]} dtypes {[t.dtype for t in lse]}",
    )
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    require(
        all(
            t.dim() == 2 and t.shape[0] == rows and t.shape == local_out[0].shape and t.dtype in dtypes
            for t in local_out
        ),
        op,
        "AU.local_out",
        f"local_out shapes {[tuple(t.shape) for t in local_out]} for {rows} lse rows",
    )
    head_dim = local_out[0].shape[1]
    require(8 <= head_dim <= 512 and head_dim % 8 == 0, op, "AU.head_dim", f"head_dim={head_dim}")
    stacked = torch.stack([t.float() for t in lse])  # [SP, N]
    lse_max = stacked.max(dim=0).values
    lse_m = lse_max + torch.log(torch.exp(stacked - lse_max).sum(dim=0))
    out = sum(o.float() * torch.exp(lse - lse_m).unsqueeze(1) for o, lse in zip(local_out, stacked))
    if update_type == 0:  # AU.lse_out_type1: lse_out is only valid with update_type 1
        lse_m = torch.full_like(lse_m, float("nan"))
    return out.to(local_out[0].dtype), lse_m


# -- npu_fused_infer_attention_score_v2 -----------------------------------------------------------
FIA_V2 = "npu_fused_infer_attention_score_v2"
# v2's names for v1's arguments; v2 documents the same layouts, masks and page attention.
_FIA_V2_RENAMED = {
    "num_query_heads": "num_heads",
    "softmax_scale": "scale",
    "actual_seq_qlen": "actual_seq_lengths",
    "actual_seq_kvlen": "actual_seq_lengths_kv",
    "return_softmax_lse": "softmax_lse_flag",
}
_FIA_V2_SAME = (
    "query",
    "key",
    "value",
    "query_rope",
    "key_rope",
    "pse_shift",
    "atten_mask",
    "block_table",
    "num_key_value_heads",
    "pre_tokens",
    "next_tokens",
    "input_layout",
    "sparse_mode",
    "block_size",
    "inner_precise",
)
_FIA_V2_DEFAULTS = {  # quantization and dtype arguments the project leaves at their defaults
    "query_quant_mode": 0,
    "key_quant_mode": 0,
    "value_quant_mode": 0,
}


def npu_fused_infer_attention_score_v2(**a):
    """v2 is v1 under new argument names, plus ``learnable_sink``; the double checks v2's
    sink rules here and runs v1's rules and semantics on the renamed arguments."""
    _refuse_unmodelled(
        FIA_V2, a, tuple(n for n in a if n.startswith(("dequant_", "quant_")) or n.endswith("_dtype"))
    )
    for name, default in _FIA_V2_DEFAULTS.items():
        if a[name] != default:
            raise unmodelled(FIA_V2, f"{name}={a[name]}")
    sink = a["learnable_sink"]
    if sink is not None:
        require(
            sink.dtype == torch.bfloat16 and tuple(sink.shape) == (a["num_query_heads"],),
            FIA_V2,
            "FIA2.sink",
            f"learnable_sink {tuple(sink.shape)} {sink.dtype} for {a['num_query_heads']} query heads",
        )
        require(
            a["input_layout"] in ("TND", "NTD_TND"),
            FIA_V2,
            "FIA2.sink_layout",
            f"input_layout={a['input_layout']}",
        )
        require(a["value"].shape[-1] <= 128, FIA_V2, "FIA2.sink_d", f"value D={a['value'].shape[-1]}")
    v1 = {name: a[name] for name in _FIA_V2_SAME}
    v1.update({old: a[new] for new, old in _FIA_V2_RENAMED.items()})
    v1.update({name: None for name in _FIA_UNMODELLED})
    v1["_sink"] = sink
    return npu_fused_infer_attention_score(**v1)


# -- the graph forms torch_npu's capture handler swaps in (npugraph_handlers/ifa_handler.py) --
def npu_fused_infer_attention_score_out(**a):
    """``.out``: the same attention, written into the caller's ``out`` pair."""
    out, _ = a.pop("out"), a.pop("workspace")
    require(
        len(out) == 2,
        FIA,
        "FIA.out_pair",
        f"out has {len(out)} tensors, expected [attention_out, softmax_lse]",
    )
    result = npu_fused_infer_attention_score(**a)
    require(
        out[0].shape == result[0].shape and out[0].dtype == result[0].dtype,
        FIA,
        "FIA.out_pair",
        f"out[0] is {tuple(out[0].shape)} {out[0].dtype}, the op gives {tuple(result[0].shape)} {result[0].dtype}",
    )
    out[0].copy_(result[0])
    if a["softmax_lse_flag"]:
        out[1].copy_(result[1])
    return out[0], out[1]


def fia_infer_output(
    query,
    value,
    input_layout,
    quant_scale2,
    block_table,
    num_heads,
    num_key_value_heads,
    softmax_lse_flag,
    query_rope,
):
    """Unwritten outputs shaped as the attention gives them (a host-side allocation)."""
    if quant_scale2 is not None:
        raise unmodelled(FIA, "infer_output with quant_scale2 (int8 output)")
    if softmax_lse_flag:
        shape = [*query.shape[:2], 1] if input_layout == "TND" else [*query.shape[:3], 1]
        lse = torch.empty(shape, dtype=torch.float32)
    else:
        lse = torch.zeros(1, dtype=torch.float32)
    return torch.empty_like(query), lse


def fia_max_workspace(**a):
    """The workspace the graph task keeps; the double's attention needs none."""
    return torch.empty(0, dtype=torch.uint8)


def npu_fused_infer_attention_score_v2_out(**a):
    """v2's ``.out`` (the same capture handler swaps it in): v2 written into ``out``."""
    out, _ = a.pop("out"), a.pop("workspace")
    require(
        len(out) == 2,
        FIA_V2,
        "FIA.out_pair",
        f"out has {len(out)} tensors, expected [attention_out, softmax_lse]",
    )
    result = npu_fused_infer_attention_score_v2(**a)
    require(
        out[0].shape == result[0].shape and out[0].dtype == result[0].dtype,
        FIA_V2,
        "FIA.out_pair",
        f"out[0] is {tuple(out[0].shape)} {out[0].dtype}, the op gives {tuple(result[0].shape)} {result[0].dtype}",
    )
    out[0].copy_(result[0])
    if a["return_softmax_lse"]:
        out[1].copy_(result[1])
    return out[0], out[1]


def fia_v2_infer_output(
    query,
    value,
    query_dtype,
    value_dtype,
    input_layout,
    quant_scale_out,
    block_table,
    num_query_heads,
    num_key_value_heads,
    return_softmax_lse,
    query_rope,
    out_dtype,
):
    """v2's unwritten outputs (a host-side allocation), as v1's."""
    if query_dtype is not None or value_dtype is not None or out_dtype is not None:
        raise unmodelled(FIA_V2, "infer_output with dtype codes")
    return fia_infer_output(
        query,
        value,
        input_layout,
        quant_scale_out,
        block_table,
        num_query_heads,
        num_key_value_heads,
        return_softmax_lse,
        query_rope,
    )
