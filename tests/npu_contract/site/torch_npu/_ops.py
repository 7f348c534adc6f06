"""CPU kernels of the contract double: documented preconditions, then documented semantics.

Each function receives every schema argument by name (defaults filled in). The
checks come first and each names the rule it enforces (``_rules.RULES``); then the
op's documented result is computed in plain torch, in float32 and cast to the output
dtype as the NPU kernels accumulate. Argument combinations the project does not use
are refused as unmodelled rather than guessed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._rules import require, unmodelled

FIA = "npu_fused_infer_attention_score"
HALF_TYPES = (torch.float16, torch.bfloat16)
MASK_SIZE = 2048
INT_MAX = 2147483647  # pre_tokens/next_tokens when unset


def _refuse_unmodelled(op: str, a: dict, names: tuple[str, ...]) -> None:
    """Optional arguments the double has no semantics for must be left unset."""
    for name in names:
        if a[name] is not None:
            raise unmodelled(op, name)


def _contiguous(t: torch.Tensor | None) -> bool:
    return t is None or t.is_contiguous()


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


# -- _npu_reshape_and_cache (ATB) --------------------------------------------------------------
def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    op = "_npu_reshape_and_cache"
    require(
        key.dim() == 3 and value.dim() == 3 and key.shape[:2] == value.shape[:2],
        op,
        "RAC.shapes",
        f"key {tuple(key.shape)} / value {tuple(value.shape)} must be [num_tokens, num_head, head_size]",
    )
    require(
        key_cache.dim() == 4
        and value_cache.dim() == 4
        and key_cache.shape[:3] == value_cache.shape[:3]
        and key_cache.shape[2:] == key.shape[1:]
        and value_cache.shape[2:] == value.shape[1:],
        op,
        "RAC.shapes",
        f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} must be "
        "[num_blocks, block_size, num_head, head_size] matching key/value",
    )
    require(
        slot_indices.dim() == 1
        and slot_indices.shape[0] == key.shape[0]
        and slot_indices.dtype == torch.int32,
        op,
        "RAC.shapes",
        f"slot_indices {tuple(slot_indices.shape)} {slot_indices.dtype}",
    )
    require(
        len({key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}) == 1
        and key.dtype in (*HALF_TYPES, torch.int8),
        op,
        "RAC.dtypes",
        f"{key.dtype}/{value.dtype}/{key_cache.dtype}/{value_cache.dtype}",
    )
    require(
        key_cache.is_contiguous() and value_cache.is_contiguous(),
        op,
        "RAC.cache_contiguous",
        "key_cache/value_cache must be contiguous",
    )
    capacity = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_indices.to(torch.int64)
    require(
        bool(((slots >= 0) & (slots < capacity)).all()),
        op,
        "PROJECT.valid_slots",
        f"slots outside [0, {capacity})",
    )
    key_cache.view(capacity, *key_cache.shape[2:])[slots] = key
    value_cache.view(capacity, *value_cache.shape[2:])[slots] = value
    return None


# -- npu_scatter_nd_update_ ----------------------------------------------------------------------
def npu_scatter_nd_update_(input, indices, updates):
    op = "npu_scatter_nd_update_"
    require(
        indices.dim() >= 2 and indices.shape[-1] <= input.dim(),
        op,
        "SNU.indices",
        f"indices {tuple(indices.shape)} for input of rank {input.dim()}",
    )
    require(
        indices.dtype in (torch.int32, torch.int64), op, "SNU.indices_dtype", f"indices are {indices.dtype}"
    )
    depth = indices.shape[-1]
    require(
        tuple(updates.shape) == tuple(indices.shape[:-1]) + tuple(input.shape[depth:]),
        op,
        "SNU.updates_shape",
        f"updates {tuple(updates.shape)} for indices {tuple(indices.shape)} into {tuple(input.shape)}",
    )
    require(
        updates.dtype == input.dtype and 1 <= input.dim() <= 8,
        op,
        "SNU.dtype",
        f"input {input.dtype} rank {input.dim()}, updates {updates.dtype}",
    )
    require(input.is_contiguous(), op, "PROJECT.no_hidden_cache_copy", "the updated tensor is not contiguous")
    flat = indices.reshape(-1, depth).to(torch.int64)
    bounds = torch.tensor(input.shape[:depth])
    require(bool(((flat >= 0) & (flat < bounds)).all()), op, "SNU.indices_dtype", "an index is out of range")
    input[tuple(flat.unbind(1))] = updates.reshape(-1, *input.shape[depth:])
    return input


# -- npu_grouped_matmul --------------------------------------------------------------------------
_GMM_UNMODELLED = (
    "bias",
    "offset",
    "antiquant_scale",
    "antiquant_offset",
    "activation_input",
    "activation_quant_scale",
    "activation_quant_offset",
    "tuning_config",
    "x_dtype",
    "weight_dtype",
    "scale_dtype",
    "per_token_scale_dtype",
)


def npu_grouped_matmul(**a):
    op = "npu_grouped_matmul"
    _refuse_unmodelled(op, a, _GMM_UNMODELLED)
    if a["act_type"] not in (0, None):
        raise unmodelled(op, f"act_type={a['act_type']}")
    group_type = a["group_type"]
    require(group_type in (-1, 0), op, "GMM.group_type", f"group_type={group_type}")
    if group_type != 0 or len(a["x"]) != 1 or len(a["weight"]) != 1:
        raise unmodelled(op, "anything but one x, one 3-D weight, group_type=0")
    [x], [weight] = a["x"], a["weight"]
    group_list, list_type = a["group_list"], a["group_list_type"]
    require(
        a["split_item"] in (2, 3) and weight.dim() == 3 and x.dim() == 2 and group_list is not None,
        op,
        "GMM.single_tensor",
        f"split_item={a['split_item']}, weight {tuple(weight.shape)}, x {tuple(x.shape)}",
    )
    require(x.is_contiguous(), op, "GMM.single_tensor", "x is transposed / not contiguous")
    k_dim, n_dim = weight.shape[1], weight.shape[2]
    transposed = weight.stride(1) == 1 and weight.stride(2) == k_dim and weight.stride(0) == k_dim * n_dim
    require(
        weight.is_contiguous() or transposed,
        op,
        "GMM.weight_transpose",
        f"weight strides {weight.stride()} are neither contiguous nor a transpose of the last two dims",
    )
    require(
        group_list.dtype == torch.int64 and group_list.dim() == 1,
        op,
        "GMM.group_list_dtype",
        f"group_list {group_list.dtype} rank {group_list.dim()}",
    )
    require(
        group_list.shape[0] == weight.shape[0] and group_list.shape[0] <= 1024,
        op,
        "GMM.single_tensor",
        f"{group_list.shape[0]} groups for {weight.shape[0]} weights",
    )
    values = group_list.tolist()
    if list_type == 0:
        require(
            all(v >= 0 for v in values) and all(b >= a_ for a_, b in zip(values, values[1:])),
            op,
            "GMM.group_list",
            f"cumulative group_list {values}",
        )
        ends = values
    else:
        require(all(v >= 0 for v in values), op, "GMM.group_list", f"group_list counts {values}")
        ends = list(torch.tensor(values).cumsum(0).tolist())
    # The docs ask for ends[-1] == rows; callers on NPUs pass more rows (GMM.rows_past_groups)
    # and the double leaves those rows NaN, so a caller that reads them fails its oracle.
    require(
        ends[-1] <= x.shape[0], op, "GMM.single_tensor", f"groups cover {ends[-1]} rows, x has {x.shape[0]}"
    )
    require(
        x.shape[1] == k_dim, op, "GMM.single_tensor", f"x {tuple(x.shape)} @ weight {tuple(weight.shape)}"
    )
    require(max(k_dim, n_dim) < 65536, op, "GMM.inner_limit", f"K={k_dim}, N={n_dim}")
    if x.dtype == torch.int8:
        return [_gmm_per_token(op, a, x, weight, ends)]
    _refuse_unmodelled(op, a, ("scale", "per_token_scale", "output_dtype"))
    require(
        x.dtype == weight.dtype and x.dtype in (*HALF_TYPES, torch.float32),
        op,
        "GMM.single_tensor",
        f"x {x.dtype}, weight {weight.dtype}",
    )
    out = torch.full((x.shape[0], n_dim), float("nan"), dtype=torch.float32)
    start = 0
    for e, end in enumerate(ends):
        out[start:end] = x[start:end].float() @ weight[e].float()
        start = end
    return [out.to(x.dtype)]


def _gmm_per_token(op, a, x, weight, ends):
    """Per-token quantized mode: int8 x and weight, int32 accumulation, then x weight
    scale [g, n] per group and x per-token scale [m] (the docstring's formula 3 prints
    ``+ pertokenscale``; the per-token mode multiplies, as its name and CANN's
    aclnnGroupedMatmul documentation say)."""
    scale, per_token = a["scale"], a["per_token_scale"]
    out_dtype = scalar_type(a["output_dtype"])
    require(
        weight.dtype == torch.int8
        and scale is not None
        and per_token is not None
        and len(scale) == 1
        and len(per_token) == 1,
        op,
        "GMM.pertoken_dtypes",
        f"int8 x needs int8 weight, one scale and one per_token_scale (weight {weight.dtype})",
    )
    [scale], [per_token] = scale, per_token
    allowed = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}
    require(
        out_dtype in allowed and scale.dtype == allowed[out_dtype] and per_token.dtype == torch.float32,
        op,
        "GMM.pertoken_dtypes",
        f"output {out_dtype}, scale {scale.dtype}, per_token_scale {per_token.dtype}",
    )
    require(
        tuple(scale.shape) == (weight.shape[0], weight.shape[2]) and tuple(per_token.shape) == (x.shape[0],),
        op,
        "GMM.pertoken_formula",
        f"scale {tuple(scale.shape)} for weight {tuple(weight.shape)}, per_token_scale "
        f"{tuple(per_token.shape)} for x {tuple(x.shape)}",
    )
    out = torch.full((x.shape[0], weight.shape[2]), float("nan"), dtype=torch.float32)
    start = 0
    for e, end in enumerate(ends):
        acc = torch.mm(x[start:end].to(torch.int32), weight[e].to(torch.int32)).float()
        out[start:end] = acc * scale[e].float() * per_token[start:end].unsqueeze(1)
        start = end
    return out.to(out_dtype)


# -- npu_swiglu -----------------------------------------------------------------------------------
def npu_swiglu(input, dim):
    require(
        input.dtype in (*HALF_TYPES, torch.float32) and 1 <= input.dim() <= 8,
        "npu_swiglu",
        "SWIGLU.dtype",
        f"{input.dtype} rank {input.dim()}",
    )
    a, b = input.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(input.dtype)


# -- npu_clipped_swiglu ----------------------------------------------------------------------------
def npu_clipped_swiglu(x, group_index, dim, alpha, limit, bias, interleaved):
    op = "npu_clipped_swiglu"
    if group_index is not None:
        raise unmodelled(op, "group_index")
    require(
        x.dtype in (*HALF_TYPES, torch.float32)
        and x.is_contiguous()
        and x.dim() > 1
        and -x.dim() <= dim < x.dim()
        and x.shape[dim] % 2 == 0,
        op,
        "CSWIGLU.x",
        f"x {tuple(x.shape)} {x.dtype}, contiguous={x.is_contiguous()}, dim={dim}",
    )
    h = x.float().movedim(dim, -1)
    if interleaved:
        a_half, b_half = h[..., 0::2], h[..., 1::2]
    else:
        a_half, b_half = h.chunk(2, dim=-1)
    a_half = a_half.clamp(max=limit)
    b_half = b_half.clamp(min=-limit, max=limit)
    y = a_half * torch.sigmoid(alpha * a_half) * (b_half + bias)
    return y.movedim(-1, dim).contiguous().to(x.dtype)


# -- npu_rms_norm / npu_add_rms_norm ----------------------------------------------------------------
FLOAT_TYPES = (*HALF_TYPES, torch.float32)


def _rms(x: torch.Tensor, gamma: torch.Tensor, epsilon: float):
    """RmsNorm over gamma's dimensions, in float32: (y in x's dtype, rstd float32)."""
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (h * rstd * gamma.float()).to(x.dtype), rstd


def npu_rms_norm(input, gamma, epsilon):
    op = "npu_rms_norm"
    require(
        input.dtype in FLOAT_TYPES and 2 <= input.dim() <= 8,
        op,
        "RMS.self",
        f"{input.dtype} rank {input.dim()}",
    )
    require(
        gamma.dtype == input.dtype and tuple(gamma.shape) == tuple(input.shape[input.dim() - gamma.dim() :]),
        op,
        "RMS.gamma",
        f"gamma {gamma.dtype} {tuple(gamma.shape)} for self {input.dtype} {tuple(input.shape)}",
    )
    return _rms(input, gamma, epsilon)


def npu_add_rms_norm(x1, x2, gamma, epsilon):
    op = "npu_add_rms_norm"
    for name, t in (("x1", x1), ("x2", x2)):
        require(
            t.dtype in FLOAT_TYPES and 1 <= t.dim() <= 8 and t.numel() > 0,
            op,
            "ADDRMS.x",
            f"{name} {t.dtype} {tuple(t.shape)}",
        )
    require(
        x1.shape == x2.shape and x1.dtype == x2.dtype,
        op,
        "ADDRMS.formula",
        f"x1 {x1.dtype} {tuple(x1.shape)}, x2 {x2.dtype} {tuple(x2.shape)}",
    )
    require(
        gamma.dtype == x1.dtype
        and 0 < gamma.dim() <= x1.dim()
        and tuple(gamma.shape) == tuple(x1.shape[x1.dim() - gamma.dim() :]),
        op,
        "ADDRMS.gamma",
        f"gamma {gamma.dtype} {tuple(gamma.shape)} for x1 {x1.dtype} {tuple(x1.shape)}",
    )
    s = x1.float() + x2.float()
    y, rstd = _rms(s, gamma, epsilon)
    return y.to(x1.dtype), rstd, s.to(x1.dtype)


# -- npu_moe_init_routing_v2 / npu_moe_finalize_routing ---------------------------------------------
INIT_ROUTING = "npu_moe_init_routing_v2"
FINALIZE_ROUTING = "npu_moe_finalize_routing"


def npu_moe_init_routing_v2(**a):
    """Dropless, unquantized, gather-type row index, per-expert counts: the one mode this
    project calls. Source row ``s = token * K + k`` (``expert_idx`` flattened); the rows of
    experts in ``active_expert_range`` are sorted by expert (stably, here) into the head of
    ``expanded_x``; the rest of ``expanded_x`` is undefined (NaN here, so a reader shows).
    A row outside the range keeps index -1: the op docs' equivalent logic starts the gather
    index at -1 everywhere and sets only the in-range (``availableIdxNum``) rows."""
    op = INIT_ROUTING
    x, ids = a["x"], a["expert_idx"]
    _refuse_unmodelled(op, a, ("scale", "offset", "x_dtype"))
    if a["quant_mode"] != -1 or a["row_idx_type"] != 0 or a["expert_tokens_num_type"] != 1:
        raise unmodelled(op, "a quantized mode, a scatter-type row index or cumsum/key-value counts")
    if a["active_num"] not in (-1, 0, ids.numel()):
        raise unmodelled(op, f"active_num {a['active_num']}")
    require(
        x.dim() == 2 and x.dtype in (*FLOAT_TYPES, torch.int8), op, "IR2.x", f"x {x.dtype} {tuple(x.shape)}"
    )
    num = a["expert_num"]
    require(0 < num <= 10240, op, "IR2.expert_num", f"expert_num {num}")
    require(
        ids.dim() == 2
        and ids.dtype == torch.int32
        and ids.shape[0] == x.shape[0]
        and bool(((ids >= 0) & (ids < num)).all()),
        op,
        "IR2.expert_idx",
        f"expert_idx {ids.dtype} {tuple(ids.shape)} for x {tuple(x.shape)}, {num} experts",
    )
    require(a["drop_pad_mode"] == 0, op, "IR2.drop_pad_mode", f"drop_pad_mode {a['drop_pad_mode']}")
    require(a["expert_tokens_num_flag"], op, "IR2.tokens_num_flag", "expert_tokens_num_flag False")
    span = list(a["active_expert_range"]) or [0, num]
    require(
        len(span) == 2 and 0 <= span[0] < span[1] <= num,
        op,
        "IR2.active_range",
        f"range {span}, {num} experts",
    )
    start, end = span
    flat = ids.flatten().to(torch.int64)
    active = (flat >= start) & (flat < end)
    order = torch.argsort(torch.where(active, flat, end), stable=True)
    available = int(active.sum())
    expanded_x = torch.full((flat.numel(), x.shape[1]), float("nan"), dtype=torch.float32).to(x.dtype)
    expanded_x[:available] = x[order[:available] // ids.shape[1]]
    row_idx = torch.full((flat.numel(),), -1, dtype=torch.int32)
    row_idx[order[:available]] = torch.arange(available, dtype=torch.int32)
    counts = torch.bincount(flat[active] - start, minlength=end - start).to(torch.int64)
    scale_out = torch.full((flat.numel(),), float("nan"), dtype=torch.float32)  # no scale given: undefined
    return expanded_x, row_idx, counts, scale_out


def npu_moe_finalize_routing(
    expanded_permuted_rows,
    skip1,
    skip2,
    bias,
    scales,
    expanded_src_to_dst_row,
    export_for_source_row,
    drop_pad_mode,
    k,
):
    op = FINALIZE_ROUTING
    rows, index = expanded_permuted_rows, expanded_src_to_dst_row
    if skip1 is not None or skip2 is not None or bias is not None or scales is None:
        raise unmodelled(op, "skip inputs, an expert bias or no scales")
    require(rows.dim() == 2 and rows.dtype in FLOAT_TYPES, op, "FR.rows", f"{rows.dtype} {tuple(rows.shape)}")
    num_rows, top_k = scales.shape if scales.dim() == 2 else (-1, -1)
    require(
        scales.dim() == 2 and scales.dtype == rows.dtype and rows.shape[0] == num_rows * top_k,
        op,
        "FR.scales",
        f"scales {scales.dtype} {tuple(scales.shape)} for rows {rows.dtype} {tuple(rows.shape)}",
    )
    require(
        drop_pad_mode == 0
        and index.dim() == 1
        and index.dtype == torch.int32
        and index.numel() == rows.shape[0]
        and bool(((index >= 0) & (index < rows.shape[0])).all()),
        op,
        "FR.index",
        f"index {index.dtype} {tuple(index.shape)} for {rows.shape[0]} rows",
    )
    # out[i] = sum_k scales[i, k] * rows[index[i + k * num_rows]]
    picked = rows.float()[index.to(torch.int64)].view(top_k, num_rows, -1)
    out = (scales.float().t().unsqueeze(-1) * picked).sum(dim=0)
    return out.to(rows.dtype)


# -- npu_rotary_mul ------------------------------------------------------------------------------
def npu_rotary_mul(input, r1, r2, rotary_mode, rotate):
    """BSND input only (the layout this project passes; the op cannot tell BSND from BNSD,
    so the tables' shapes are read as BSND's)."""
    op = "npu_rotary_mul"
    if rotate is not None:
        raise unmodelled(op, "rotate")
    require(
        input.dtype in FLOAT_TYPES and input.dim() == 4, op, "ROPE.input", f"{input.dtype} rank {input.dim()}"
    )
    b, s, n, d = input.shape
    if rotary_mode == "half":
        require(
            d < 896 and d % 2 == 0 and b < 1000 and n < 1000, op, "ROPE.half", f"input {tuple(input.shape)}"
        )
        allowed, rule = {(1, s, 1, d), (b, s, 1, d), (b, s, n, d)}, "ROPE.half_tables"
    elif rotary_mode == "interleave":
        require(d < 896 and d % 2 == 0 and b * n < 1000, op, "ROPE.interleave", f"input {tuple(input.shape)}")
        allowed, rule = {(1, s, 1, d)}, "ROPE.interleave_tables"
    else:
        raise unmodelled(op, f"rotary_mode {rotary_mode!r}")
    for name, t in (("r1", r1), ("r2", r2)):
        require(
            tuple(t.shape) in allowed,
            op,
            rule,
            f"{name} {tuple(t.shape)} for BSND input {tuple(input.shape)}",
        )
        require(bool(t.float().abs().le(1.0).all()), op, "ROPE.range", f"{name} has values outside [-1, 1]")
    x = input.float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        turned = torch.cat((-x2, x1), dim=-1)
    else:
        turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return (r1.float() * x + r2.float() * turned).to(input.dtype)


# -- npu_apply_rotary_pos_emb (query and key in one launch, in place) -----------------------------
APPLY_ROPE = "npu_apply_rotary_pos_emb"


def npu_apply_rotary_pos_emb(query, key, cos, sin, layout, rotary_mode):
    """The Atlas A2/A3 branch of its docs: "half" mode, TND (3-D) or BSND (4-D), D 64 or 128,
    cos/sin with one head; query and key updated in place and returned ("原地更新")."""
    op = APPLY_ROPE
    tensors = {"query": query, "key": key, "cos": cos, "sin": sin}
    require(rotary_mode == "half", op, "ARPE.mode", f"rotary_mode {rotary_mode!r}")
    require(layout in ("TND", "BSND"), op, "ARPE.layout", f"layout {layout!r}")
    rank = 3 if layout == "TND" else 4
    for name, t in tensors.items():
        require(
            t.dim() == rank and t.numel() > 0 and t.shape[-1] in (64, 128),
            op,
            "ARPE.d",
            f"{name} {tuple(t.shape)} in {layout}",
        )
    require(
        len({t.dtype for t in tensors.values()}) == 1 and query.dtype in FLOAT_TYPES,
        op,
        "ARPE.dtype",
        ", ".join(f"{n} {t.dtype}" for n, t in tensors.items()),
    )
    lead = rank - 2  # T, or B and S
    require(
        query.shape[-1] == key.shape[-1]
        and cos.shape == sin.shape
        and cos.shape[-2] == 1
        and all(t.shape[:lead] == query.shape[:lead] for t in tensors.values()),
        op,
        "ARPE.shapes",
        ", ".join(f"{n} {tuple(t.shape)}" for n, t in tensors.items()),
    )
    require(
        query.is_contiguous() and key.is_contiguous(),
        op,
        "PROJECT.in_place_contiguous",
        f"query contiguous={query.is_contiguous()}, key contiguous={key.is_contiguous()}",
    )
    c, s = cos.float(), sin.float()
    for x in (query, key):
        h = x.float()
        first, second = h.chunk(2, dim=-1)
        x.copy_(h * c + torch.cat((-second, first), dim=-1) * s)
    return query, key


# -- npu_kv_rmsnorm_rope_cache / npu_interleave_rope (MLA prolog) ----------------------------------
# Both rotate a GPT-J (interleaved) input and return it in the half layout: the docs' formula
# reshapes the rope part to [..., D/2, 2] and transposes before a rotate-half rotation.
KRRC = "npu_kv_rmsnorm_rope_cache"
IROPE = "npu_interleave_rope"


def _deinterleave_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h.reshape(*h.shape[:-1], h.shape[-1] // 2, 2).transpose(-1, -2).reshape(h.shape)
    first, second = h.chunk(2, dim=-1)
    return h * cos.float() + torch.cat((-second, first), dim=-1) * sin.float()


def npu_kv_rmsnorm_rope_cache(**a):
    kv, gamma, cos, sin, index = a["kv"], a["gamma"], a["cos"], a["sin"], a["index"]
    k_cache, ckv_cache = a["k_cache"], a["ckv_cache"]
    _refuse_unmodelled(KRRC, a, ("k_rope_scale", "c_kv_scale", "k_rope_offset", "c_kv_offset", "v"))
    if a["cache_mode"] not in ("PA", "PA_BNSD"):
        raise unmodelled(KRRC, f"cache_mode {a['cache_mode']!r}")
    require(
        kv.dim() == 4 and kv.shape[1] == 1 and kv.dtype in HALF_TYPES,
        KRRC,
        "KRRC.kv",
        f"kv {kv.dtype} {tuple(kv.shape)}",
    )
    batch, _, seq, hidden = kv.shape
    rms_size, rope_size = gamma.shape[-1], hidden - gamma.shape[-1]
    require((hidden, rms_size, rope_size) == (576, 512, 64), KRRC, "KRRC.sizes", f"kv {tuple(kv.shape)}")
    require(
        gamma.dim() == 1 and gamma.dtype in HALF_TYPES,
        KRRC,
        "KRRC.gamma",
        f"gamma {gamma.dtype} {tuple(gamma.shape)}",
    )
    for name, t in (("cos", cos), ("sin", sin)):
        require(
            tuple(t.shape) == (batch, 1, seq, rope_size) and t.dtype in HALF_TYPES,
            KRRC,
            "KRRC.cos_sin",
            f"{name} {t.dtype} {tuple(t.shape)} for kv {tuple(kv.shape)}",
        )
    require(
        index.dtype == torch.int64 and tuple(index.shape) == (batch * seq,),
        KRRC,
        "KRRC.index",
        f"index {index.dtype} {tuple(index.shape)} for kv {tuple(kv.shape)}",
    )
    require(
        k_cache.dim() == 4
        and ckv_cache.dim() == 4
        and tuple(k_cache.shape[2:]) == (1, rope_size)
        and tuple(ckv_cache.shape) == (*k_cache.shape[:2], 1, rms_size)
        and k_cache.dtype in HALF_TYPES
        and ckv_cache.dtype in HALF_TYPES,
        KRRC,
        "KRRC.cache",
        f"k_cache {k_cache.dtype} {tuple(k_cache.shape)}, ckv_cache {ckv_cache.dtype} {tuple(ckv_cache.shape)}",
    )
    require(
        k_cache.is_contiguous() and ckv_cache.is_contiguous(),
        KRRC,
        "PROJECT.no_hidden_cache_copy",
        "k_cache/ckv_cache must be contiguous",
    )
    slots = index.tolist()
    capacity = k_cache.shape[0] * k_cache.shape[1]
    require(
        all(0 <= i < capacity for i in slots), KRRC, "PROJECT.valid_slots", f"index outside [0, {capacity})"
    )
    require(len(set(slots)) == len(slots), KRRC, "KRRC.index_unique", "index has repeated values")
    rows = kv.reshape(batch * seq, hidden)
    y, _ = _rms(rows[:, :rms_size], gamma, a["epsilon"])
    k_embed = _deinterleave_rotate(rows[:, rms_size:], cos.reshape(-1, rope_size), sin.reshape(-1, rope_size))
    k_embed = k_embed.to(kv.dtype)
    k_cache.view(-1, rope_size)[index] = k_embed.to(k_cache.dtype)
    ckv_cache.view(-1, rms_size)[index] = y.to(ckv_cache.dtype)
    if not a["is_output_kv"]:  # the docs give no value for the outputs then: NaN here
        k_embed, y = torch.full_like(k_embed, float("nan")), torch.full_like(y, float("nan"))
    return k_cache, ckv_cache, k_embed.view(batch, 1, seq, rope_size), y.view(batch, 1, seq, rms_size)


def npu_interleave_rope(x, cos, sin):
    require(
        x.dim() == 4 and x.dtype in HALF_TYPES and x.is_contiguous(),
        IROPE,
        "IROPE.x",
        f"x {x.dtype} {tuple(x.shape)}, contiguous={x.is_contiguous()}",
    )
    b, _, s, d = x.shape
    require(
        cos.dim() == 4
        and cos.shape[0] == b
        and cos.shape[2] in (1, s)
        and cos.dtype == x.dtype
        and cos.is_contiguous()
        and sin.shape == cos.shape
        and sin.dtype == cos.dtype
        and sin.is_contiguous(),
        IROPE,
        "IROPE.cos_sin",
        f"cos {cos.dtype} {tuple(cos.shape)}, sin {sin.dtype} {tuple(sin.shape)} for x {x.dtype} {tuple(x.shape)}",
    )
    require(
        d == 64 and cos.shape[3] == 64 and cos.shape[1] == 1,
        IROPE,
        "IROPE.dims",
        f"x {tuple(x.shape)}, cos {tuple(cos.shape)}",
    )
    return _deinterleave_rotate(x, cos, sin).to(x.dtype)


# -- npu_moe_distribute_dispatch_v2 / combine_v2 (MC2) ------------------------------------------------
# The double computes the documented result by brute force: every rank all-gathers every
# rank's tokens, routing and mask, and keeps what its experts own. ``assist_info`` rows
# hold (source rank, token, k) here; on an NPU the buffer is opaque.
MC2_DISPATCH = "npu_moe_distribute_dispatch_v2"
MC2_COMBINE = "npu_moe_distribute_combine_v2"
_MC2_DISPATCH_UNMODELLED = (
    "scales",
    "expert_scales",
    "elastic_info",
    "performance_info",
    "y_dtype",
    "x_dtype",
    "scales_dtype",
)
_MC2_COMBINE_UNMODELLED = (
    "shared_expert_x",
    "elastic_info",
    "ori_x",
    "const_expert_alpha_1",
    "const_expert_alpha_2",
    "const_expert_v",
    "performance_info",
)


def _mc2_group(op: str, a: dict):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    name = a["group_ep"]
    require(isinstance(name, str) and 1 <= len(name) < 128, op, "MC2.group", f"group_ep {name!r}")
    group = _resolve_process_group(name)
    require(
        dist.get_world_size(group) == a["ep_world_size"] and dist.get_rank(group) == a["ep_rank_id"],
        op,
        "MC2.group",
        f"ep_world_size={a['ep_world_size']} ep_rank_id={a['ep_rank_id']} for a group of "
        f"{dist.get_world_size(group)} where this rank is {dist.get_rank(group)}",
    )
    for arg in (
        "shared_expert_rank_num",
        "expert_shard_type",
        "global_bs",
        "zero_expert_num",
        "copy_expert_num",
        "const_expert_num",
    ):
        if a[arg]:
            raise unmodelled(op, f"{arg}={a[arg]}")
    if a["tp_world_size"] > 1:
        raise unmodelled(op, f"tp_world_size={a['tp_world_size']}")
    return group


def _mc2_soc() -> str:
    """The SoC the double plays (TORCH_NPU_DOUBLE_SOC = A2 | A3, default A2), read from the
    environment at each call as the npu runtime stub's ``get_soc_version`` does."""
    import os

    soc = os.environ.get("TORCH_NPU_DOUBLE_SOC", "A2").strip().upper() or "A2"
    if soc not in ("A2", "A3"):
        raise ValueError(f"TORCH_NPU_DOUBLE_SOC must be A2 or A3, got {soc!r}")
    return soc


def _mc2_algorithm(op: str, a: dict) -> tuple[str, str]:
    """(SoC, the algorithm ``comm_alg`` selects there), resolved as the docs do: on A2 ``""``
    follows HCCL_INTRA_PCIE_ENABLE / HCCL_INTRA_ROCE_ENABLE; on A3 it is fullmesh_v1.
    Hierarchy's documented exclusions are refused; its semantics are not modelled."""
    import os

    soc, alg = _mc2_soc(), a["comm_alg"]
    if soc == "A2":
        require(alg in ("", "fullmesh", "hierarchy"), op, "MC2.comm_alg_a2", f"comm_alg={alg!r} on A2")
        if alg == "":
            pcie, roce = os.environ.get("HCCL_INTRA_PCIE_ENABLE"), os.environ.get("HCCL_INTRA_ROCE_ENABLE")
            alg = "hierarchy" if (pcie, roce) == ("1", "0") else "fullmesh"
    elif op == MC2_DISPATCH:
        require(
            alg in ("", "fullmesh_v1", "fullmesh_v2", "hierarchy"), op, "MC2.comm_alg_a3", f"comm_alg={alg!r}"
        )
        alg = alg or "fullmesh_v1"
    else:
        require(alg in ("", "hierarchy"), op, "MC2.combine_comm_alg_a3", f"comm_alg={alg!r}")
        alg = alg or "fullmesh_v1"
    if alg == "hierarchy" and soc == "A2":
        how = (
            "comm_alg='' with HCCL_INTRA_PCIE_ENABLE=1, HCCL_INTRA_ROCE_ENABLE=0" if not a["comm_alg"] else ""
        )
        require(
            a["x_active_mask"] is None, op, "MC2.hierarchy_mask", f"x_active_mask given to hierarchy {how}"
        )
        require(
            a["ep_world_size"] in (16, 32, 64),
            op,
            "MC2.hierarchy_ep",
            f"ep_world_size={a['ep_world_size']} with hierarchy {how}",
        )
        if op == MC2_DISPATCH:
            require(
                a["expert_scales"] is not None,
                op,
                "MC2.hierarchy_expert_scales",
                f"hierarchy {how} sums a token's expert outputs inside a server: dispatch needs expert_scales",
            )
    if alg in ("hierarchy", "fullmesh_v2"):
        raise unmodelled(op, f"comm_alg resolving to {alg!r}")
    return soc, alg


def _mc2_buffer(op: str, a: dict, soc: str, bs: int, k: int, h: int) -> None:
    """The HCCL buffer (HCCL_BUFFSIZE, MB; 200 when unset) against the documented need of
    the resolved algorithm; with global_bs=0 every rank's BS is this BS (max_bs = BS)."""
    import os

    raw = os.environ.get("HCCL_BUFFSIZE", "").strip()
    buffsize = int(raw) if raw else 200  # MC2.buffsize_default
    mb = 1 << 20
    ep = a["ep_world_size"]
    local = a["moe_expert_num"] // ep

    def align(x, n):
        return (x + n - 1) // n * n

    if soc == "A2":
        need, rule = 2 * (bs * ep * min(local, k) * h * 2 + 2 * mb), "MC2.buffsize_a2"
    else:
        shared = a["shared_expert_num"]
        row = align(align(2 * h, 32) + 64, 512)
        need = 2 * (local * bs * ep * row + (k + shared) * bs * align(2 * h, 512))
        rule = "MC2.buffsize_a3"
    require(
        need <= buffsize * mb,
        op,
        rule,
        f"BS={bs}, ep_world_size={ep}, local experts={local}, K={k}, H={h} need {-(-need // mb)} MB of HCCL "
        f"buffer; HCCL_BUFFSIZE={raw or 'unset (200 MB, MC2.buffsize_default)'}",
    )


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    out = t.new_empty((dist.get_world_size(group) * t.shape[0], *t.shape[1:]))
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out.view(dist.get_world_size(group), *t.shape)


def npu_moe_distribute_dispatch_v2(**a):
    op = MC2_DISPATCH
    soc, _alg = _mc2_algorithm(op, a)
    _refuse_unmodelled(op, a, _MC2_DISPATCH_UNMODELLED)
    if a["quant_mode"] != 0 or a["shared_expert_num"] not in (0, 1):
        raise unmodelled(op, f"quant_mode={a['quant_mode']}, shared_expert_num={a['shared_expert_num']}")
    group = _mc2_group(op, a)
    x, ids, mask = a["x"], a["expert_ids"], a["x_active_mask"]
    experts, ep, rank = a["moe_expert_num"], a["ep_world_size"], a["ep_rank_id"]
    require(x.dtype in HALF_TYPES and x.dim() == 2, op, "MC2.dtype", f"x {x.dtype} rank {x.dim()}")
    require(
        ids.dtype == torch.int32 and ids.dim() == 2 and ids.shape[0] == x.shape[0],
        op,
        "MC2.expert_ids",
        f"expert_ids {ids.dtype} {tuple(ids.shape)} for x {tuple(x.shape)}",
    )
    bs, k = ids.shape
    require(0 < k <= 16, op, "MC2.top_k", f"K={k}")
    require(0 < bs <= 512, op, "MC2.batch", f"BS={bs}")
    _mc2_buffer(op, a, soc, bs, k, x.shape[1])
    flat = ids.to(torch.int64)
    require(
        bool(((flat >= 0) & (flat < experts)).all()), op, "MC2.expert_ids", "an expert id is out of range"
    )
    require(
        k == 1 or not bool((flat.sort(dim=1).values.diff(dim=1) == 0).any()),
        op,
        "MC2.expert_ids",
        "a row repeats an expert",
    )
    if mask is None:
        mask = torch.ones(bs, dtype=torch.bool)
    require(
        mask.dtype == torch.bool and tuple(mask.shape) == (bs,),
        op,
        "MC2.mask_order",
        f"x_active_mask {mask.dtype} {tuple(mask.shape)} (only the 1-D form is modelled)",
    )
    active = int(mask.sum())
    require(bool(mask[:active].all()), op, "MC2.mask_order", "a False precedes a True")
    sizes = _gather(torch.tensor([bs]), group).flatten()
    require(bool((sizes == bs).all()), op, "MC2.uniform_bs", f"BS per rank {sizes.tolist()} with global_bs=0")
    require(experts % ep == 0, op, "MC2.expert_ids", f"{experts} experts over {ep} ranks")
    all_x, all_ids, all_mask = _gather(x, group), _gather(flat, group), _gather(mask, group)
    local = experts // ep
    capacity = bs * ep * min(local, k)
    expand_x = x.new_zeros((capacity, x.shape[1]))
    assist = torch.zeros((capacity, 128), dtype=torch.int32)
    counts = torch.zeros((local, ep), dtype=torch.int64)
    row = 0
    for e in range(local):
        for src in range(ep):
            hit = (all_ids[src] == rank * local + e) & all_mask[src].unsqueeze(1)
            tokens, slots = torch.nonzero(hit, as_tuple=True)
            n = tokens.numel()
            expand_x[row : row + n] = all_x[src][tokens]
            assist[row : row + n, 0] = src
            assist[row : row + n, 1] = tokens.to(torch.int32)
            assist[row : row + n, 2] = slots.to(torch.int32)
            counts[e, src] = n
            row += n
    per_expert = counts.sum(1)
    token_nums = per_expert if a["expert_token_nums_type"] == 1 else per_expert.cumsum(0)
    ep_recv_counts = counts.flatten().cumsum(0).to(torch.int32)
    return (
        expand_x,
        torch.zeros(capacity, dtype=torch.float32),
        assist.flatten(),
        token_nums,
        ep_recv_counts,
        torch.zeros(a["tp_world_size"], dtype=torch.int32),
        torch.zeros(0, dtype=torch.float32),
    )


def npu_moe_distribute_combine_v2(**a):
    op = MC2_COMBINE
    soc, _alg = _mc2_algorithm(op, a)
    _refuse_unmodelled(op, a, _MC2_COMBINE_UNMODELLED)
    if a["comm_quant_mode"] != 0 or a["shared_expert_num"] not in (0, 1):
        raise unmodelled(
            op, f"comm_quant_mode={a['comm_quant_mode']}, shared_expert_num={a['shared_expert_num']}"
        )
    group = _mc2_group(op, a)
    expand_x, ids, scales, mask = a["expand_x"], a["expert_ids"], a["expert_scales"], a["x_active_mask"]
    bs, k = ids.shape
    require(
        scales.dtype == torch.float32 and tuple(scales.shape) == (bs, k),
        op,
        "MC2.expert_scales",
        f"expert_scales {scales.dtype} {tuple(scales.shape)} for expert_ids {tuple(ids.shape)}",
    )
    require(expand_x.dtype in HALF_TYPES, op, "MC2.dtype", f"expand_x {expand_x.dtype}")
    _mc2_buffer(op, a, soc, bs, k, expand_x.shape[1])
    rank = a["ep_rank_id"]
    all_rows = _gather(expand_x, group)
    all_assist = _gather(a["assist_info_for_combine"].view(-1, 128), group)
    valid = _gather(a["ep_send_counts"][-1:].to(torch.int64), group).flatten().tolist()
    out = torch.zeros((bs, expand_x.shape[1]), dtype=torch.float32)
    for src, n in enumerate(valid):
        info = all_assist[src][:n].to(torch.int64)
        mine = info[:, 0] == rank
        tokens, slots = info[mine, 1], info[mine, 2]
        out.index_add_(0, tokens, all_rows[src][:n][mine].float() * scales[tokens, slots].unsqueeze(1))
    if mask is not None:
        out[~mask] = 0
    return out.to(expand_x.dtype)


# -- W8A8: npu_quant_matmul, npu_dynamic_quant, npu_quantize ------------------------------------
# Schema dtype arguments arrive as c10::ScalarType numbers.
_SCALAR_TYPES = {
    1: torch.int8,
    3: torch.int32,
    5: torch.float16,
    6: torch.float32,
    12: torch.qint8,
    15: torch.bfloat16,
    16: torch.quint4x2,
}
QMM = "npu_quant_matmul"


def scalar_type(value):
    if value is None or isinstance(value, torch.dtype):
        return value
    return _SCALAR_TYPES.get(value, value)


def npu_quant_matmul(**a):
    _refuse_unmodelled(
        QMM,
        a,
        ("offset", "x1_dtype", "x2_dtype", "pertoken_scale_dtype", "scale_dtype", "group_sizes", "y_scale"),
    )
    x1, x2, scale, per_token, bias = a["x1"], a["x2"], a["scale"], a["pertoken_scale"], a["bias"]
    out_dtype = scalar_type(a["output_dtype"])
    require(x1.dtype == torch.int8 and x2.dtype == torch.int8, QMM, "QMM.x1", f"x1 {x1.dtype}, x2 {x2.dtype}")
    if x1.dim() != 2 or x2.dim() != 2:
        raise unmodelled(QMM, "anything but 2-D x1 and x2")
    m, k = x1.shape
    n = x2.shape[1]
    require(x2.shape[0] == k, QMM, "QMM.x1", f"x1 {tuple(x1.shape)} @ x2 {tuple(x2.shape)}")
    require(max(k, n) <= 65535, QMM, "QMM.last_dim", f"k={k}, n={n}")
    require(
        scale.dim() == 1
        and scale.shape[0] in (1, n)
        and scale.dtype in (torch.float32, torch.int64, torch.bfloat16),
        QMM,
        "QMM.scale",
        f"scale {tuple(scale.shape)} {scale.dtype} for n={n}",
    )
    if scale.dtype == torch.int64:
        raise unmodelled(QMM, "an int64 (npu_trans_quant_param) scale")
    if out_dtype not in (torch.float16, torch.bfloat16):
        raise unmodelled(QMM, f"output_dtype {out_dtype}")
    if per_token is not None:
        require(
            per_token.dtype == torch.float32 and tuple(per_token.shape) == (m,),
            QMM,
            "QMM.pertoken",
            f"pertoken_scale {tuple(per_token.shape)} {per_token.dtype} for m={m}",
        )
    if bias is not None:
        require(tuple(bias.shape) in ((n,), (1, n)), QMM, "QMM.bias", f"bias {tuple(bias.shape)} for n={n}")
    # the documented dtype combinations (Atlas A2/A3 table)
    if out_dtype == torch.bfloat16:
        ok = scale.dtype in (torch.float32, torch.bfloat16) and (
            bias is None or bias.dtype in (torch.int32, torch.bfloat16, torch.float32)
        )
    elif per_token is None:
        ok = scale.dtype == torch.float32 and (bias is None or bias.dtype == torch.int32)
    else:
        ok = scale.dtype == torch.float32 and (
            bias is None or bias.dtype in (torch.int32, torch.float16, torch.float32)
        )
    require(
        ok,
        QMM,
        "QMM.combinations",
        f"output {out_dtype}, scale {scale.dtype}, bias {None if bias is None else bias.dtype}, "
        f"pertoken_scale {'set' if per_token is not None else 'None'}",
    )
    acc = torch.mm(x1.to(torch.int32), x2.to(torch.int32))
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.reshape(n)
    out = acc.float() * scale.float()
    if per_token is not None:
        out = out * per_token.unsqueeze(1)
    if bias is not None and bias.dtype != torch.int32:
        out = out + bias.reshape(n).float()
    return out.to(out_dtype)


def npu_dynamic_quant(**a):
    op = "npu_dynamic_quant"
    _refuse_unmodelled(op, a, ("smooth_scales", "group_index"))
    x = a["input"]
    require(x.dtype in HALF_TYPES and x.dim() > 1, op, "DQ.x", f"x {x.dtype} rank {x.dim()}")
    if (
        scalar_type(a["dst_type"]) not in (None, torch.int8)
        or a["quant_mode"] != "pertoken"
        or a["dst_type_max"] != 0.0
    ):
        raise unmodelled(op, "anything but per-token int8 output")
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127
    # rounding: half to even (CANN's quantization kernels round with CAST_RINT; not stated for this op)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.round(xf / safe.unsqueeze(-1)).clamp(-128, 127).to(torch.int8)
    return y, scale


def npu_quantize(input, scales, zero_points, dtype, axis, div_mode):
    op = "npu_quantize"
    if div_mode:
        raise unmodelled(op, "div_mode=True")
    require(scalar_type(dtype) == torch.qint8, op, "QZ.dtype", f"dtype {scalar_type(dtype)}")
    require(input.dtype in (torch.float32, *HALF_TYPES), op, "QZ.dtype", f"input {input.dtype}")
    if axis == -2 or scales.dim() != 1:
        raise unmodelled(op, "anything but 1-D scales along the last axis")
    require(
        scales.shape[0] in (1, input.shape[-1]),
        op,
        "QZ.scales_shape",
        f"scales {tuple(scales.shape)} for input {tuple(input.shape)}",
    )
    require(
        zero_points is None or (zero_points.shape == scales.shape and zero_points.dtype == scales.dtype),
        op,
        "QZ.zero_points",
        f"zero_points {None if zero_points is None else (tuple(zero_points.shape), zero_points.dtype)}"
        f" vs scales {tuple(scales.shape)} {scales.dtype}",
    )
    y = input.float() * scales.float()
    if zero_points is not None:
        y = y + zero_points.float()
    # rounded half to even in float32 and saturated (CANN AscendQuantV2: CAST_RINT on A2/A3)
    return torch.round(y).clamp(-128, 127).to(torch.int8)


# -- npu_moe_gating_top_k_softmax(_v2) / npu_moe_gating_top_k (MoE routing) ---------------------------
# Semantics beyond the wheel's parameter tables are CANN's aclnn docs (aclnnMoeGatingTopKSoftmax:
# "softmaxOut=softmax(x,axis=-1) yOut,expertIdxOut=topK(softmaxOut,k=k)" and the rowIdxOut formula;
# aclnnMoeGatingTopKSoftmaxV2: "renorm = 0 ... yOut,expertIdxOut=topK(softmaxOut,k=k); renorm = 1
# topkOut,expertIdxOut=topK(x, k=k) yOut = softmax(topkOut,axis=-1)", and its outputSoftmaxResultFlag
# "当renorm=1时,该参数不生效,不输出Softmax的结果"; aclnnMoeGatingTopK (ops-transformer
# moe/moe_gating_top_k/docs/aclnnMoeGatingTopK.md): normOut = SoftMax(x) or Sigmoid(x); normValue =
# normOut + bias; groups scored by ReduceMax or the sum of the top two, the kGroup best kept, the
# rest set to -inf; expertIdxOut = TopK(normValue, k); y the chosen experts' normOut; Step 5: "if
# (normType = 1) or (normType = 0 and renorm = 1): yOut = normOut/(ReduceSum(normOut)+eps)", then
# yOut * routedScalingFactor. The kernel agrees (moe_gating_top_k_without_group*.h: "bool needRenorm =
# (normType_ == 1) || (normType_ == 0 && renorm_ == 1);" before the Muls by routedScalingFactor_):
# a softmax router's weights are *not* renormalised (renorm must be 0), only scaled.
GTKS = "npu_moe_gating_top_k_softmax"
GTK = "npu_moe_gating_top_k"


def npu_moe_gating_top_k_softmax(x, finished, k):
    require(
        x.dim() in (2, 3) and x.dtype in (*HALF_TYPES, torch.float32),
        GTKS,
        "GTKS.x",
        f"x {x.dtype} rank {x.dim()}",
    )
    if finished is not None:
        require(
            finished.dtype == torch.bool and tuple(finished.shape) == tuple(x.shape[:-1]),
            GTKS,
            "GTKS.finished",
            f"finished {finished.dtype} {tuple(finished.shape)} for x {tuple(x.shape)}",
        )
        raise unmodelled(GTKS, "finished")
    require(0 < k <= x.shape[-1] and k <= 1024, GTKS, "GTKS.k", f"k={k} for {x.shape[-1]} experts")
    rows = x.reshape(-1, x.shape[-1])
    y, idx = torch.softmax(rows.float(), dim=-1).topk(k, dim=-1)
    n = rows.shape[0]
    row_idx = torch.arange(n * k, dtype=torch.int32).view(k, n).t()
    shape = (*x.shape[:-1], k)
    return y.to(x.dtype).view(shape), idx.to(torch.int32).view(shape), row_idx.contiguous().view(shape)


GTKS2 = "npu_moe_gating_top_k_softmax_v2"


def npu_moe_gating_top_k_softmax_v2(x, k, finished, renorm, output_softmax):
    require(
        x.dim() in (2, 3) and x.dtype in (*HALF_TYPES, torch.float32),
        GTKS2,
        "GTKS2.x",
        f"x {x.dtype} rank {x.dim()}",
    )
    if finished is not None:
        raise unmodelled(GTKS2, "finished")
    require(0 < k <= x.shape[-1] and k <= 1024, GTKS2, "GTKS2.k", f"k={k} for {x.shape[-1]} experts")
    require(renorm in (0, 1), GTKS2, "GTKS2.renorm", f"renorm={renorm}")
    rows = x.reshape(-1, x.shape[-1]).float()
    if renorm == 0:
        softmax = torch.softmax(rows, dim=-1)
        y, idx = softmax.topk(k, dim=-1)
    else:  # the top k of x, then a softmax over them: the renormalised top-k softmax
        top, idx = rows.topk(k, dim=-1)
        y, softmax = torch.softmax(top, dim=-1), None
    shape = (*x.shape[:-1], k)
    # the softmax output only for renorm 0 with output_softmax (the wheel's meta: [0] otherwise)
    if renorm == 0 and output_softmax:
        softmax_out = softmax.view(x.shape)
    else:
        softmax_out = torch.empty(0, dtype=torch.float32)
    return y.to(x.dtype).view(shape), idx.to(torch.int32).view(shape), softmax_out


def npu_moe_gating_top_k(**a):
    x, k, bias = a["x"], a["k"], a["bias"]
    _refuse_unmodelled(GTK, a, ("input_ids", "tid2eid"))
    require(
        x.dim() == 2 and x.dtype in (*HALF_TYPES, torch.float32) and x.shape[-1] <= 2048,
        GTK,
        "GTK.x",
        f"x {x.dtype} {tuple(x.shape)}",
    )
    experts = x.shape[-1]
    if bias is not None:
        require(
            bias.dim() == 1 and bias.shape[0] == experts and bias.dtype == x.dtype,
            GTK,
            "GTK.bias",
            f"bias {bias.dtype} {tuple(bias.shape)} for x {x.dtype} {tuple(x.shape)}",
        )
    groups, k_group = a["group_count"], a["k_group"]
    per_group = experts // groups if groups > 0 else 0
    require(
        groups > 0 and experts % groups == 0 and per_group > 2 and -(-per_group // 32) * 32 * groups <= 2048,
        GTK,
        "GTK.group_count",
        f"group_count={groups} for {experts} experts",
    )
    # k_group * per_group >= k, also in GTK.k_group's text, is checked as GTK.k below
    require(1 <= k_group <= groups, GTK, "GTK.k_group", f"k_group={k_group} of {groups} groups")
    require(
        1 <= k <= per_group * k_group, GTK, "GTK.k", f"k={k} for {k_group} of {groups} groups of {per_group}"
    )
    require(a["group_select_mode"] in (0, 1), GTK, "GTK.group_select_mode", f"{a['group_select_mode']}")
    require(a["renorm"] == 0, GTK, "GTK.renorm", f"renorm={a['renorm']}")
    require(a["norm_type"] in (0, 1), GTK, "GTK.norm_type", f"norm_type={a['norm_type']}")
    xf = x.float()
    norm = torch.softmax(xf, dim=-1) if a["norm_type"] == 0 else torch.sigmoid(xf)
    value = norm if bias is None else norm + bias.float()
    if groups > 1:
        grouped = value.view(-1, groups, per_group)
        if a["group_select_mode"] == 0:
            score = grouped.amax(dim=-1)
        else:
            score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(score, dtype=torch.bool).scatter_(
            1, score.topk(k_group, dim=-1).indices, True
        )
        value = value.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    idx = value.topk(k, dim=-1).indices
    y = norm.gather(1, idx)
    if a["norm_type"] == 1 or (a["norm_type"] == 0 and a["renorm"] == 1):  # Step 5's condition
        y = y / (y.sum(dim=-1, keepdim=True) + a["eps"])
    y = y * a["routed_scaling_factor"]
    # norm_out: the norm function's result when out_flag asks for it (undefined otherwise: NaN here)
    norm_out = norm if a["out_flag"] else torch.full_like(norm, float("nan"))
    return y.to(x.dtype), idx.to(torch.int32), norm_out


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


KERNELS = {
    "npu": {
        GTKS: npu_moe_gating_top_k_softmax,
        GTKS2: npu_moe_gating_top_k_softmax_v2,
        GTK: npu_moe_gating_top_k,
        FIA: npu_fused_infer_attention_score,
        FIA + ".out": npu_fused_infer_attention_score_out,
        FIA_V2: npu_fused_infer_attention_score_v2,
        FIA_V2 + ".out": npu_fused_infer_attention_score_v2_out,
        "_" + FIA_V2 + "_infer_output": fia_v2_infer_output,
        "_" + FIA_V2 + "_get_max_workspace": fia_max_workspace,
        "_" + FIA + "_infer_output": fia_infer_output,
        "_" + FIA + "_get_max_workspace": fia_max_workspace,
        "npu_scatter_nd_update_": npu_scatter_nd_update_,
        "npu_grouped_matmul": npu_grouped_matmul,
        "npu_swiglu": npu_swiglu,
        "npu_clipped_swiglu": npu_clipped_swiglu,
        "npu_rms_norm": npu_rms_norm,
        "npu_add_rms_norm": npu_add_rms_norm,
        "npu_rotary_mul": npu_rotary_mul,
        APPLY_ROPE: npu_apply_rotary_pos_emb,
        KRRC: npu_kv_rmsnorm_rope_cache,
        IROPE: npu_interleave_rope,
        INIT_ROUTING: npu_moe_init_routing_v2,
        FINALIZE_ROUTING: npu_moe_finalize_routing,
        MC2_DISPATCH: npu_moe_distribute_dispatch_v2,
        MC2_COMBINE: npu_moe_distribute_combine_v2,
        ATTENTION_UPDATE: npu_attention_update,
        QMM: npu_quant_matmul,
        "npu_dynamic_quant": npu_dynamic_quant,
        "npu_quantize": npu_quantize,
    },
    "atb": {
        "_npu_reshape_and_cache": _npu_reshape_and_cache,
    },
}
