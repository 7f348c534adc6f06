"""The contract double's semantics equal brute-force computations that share no code with
it: attention forms, cache writes, grouped matmuls, W8A8, norms, rotary, routing, the MLA
prolog."""

from __future__ import annotations

import math

import pytest
import torch

from tests.npu_contract.contract_cases import BF16, MASK, a8w4, gmm

torch_npu = pytest.importorskip("torch_npu")
if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
    pytest.skip("the real torch_npu is active on this host", allow_module_level=True)

from torch_npu._rules import ContractViolation  # noqa: E402


def _brute_attention(q, k, v, scale, visible):
    """q [S, N, D], k/v [L, KVN, D]: softmax over the ``visible(i)`` first keys, head by head."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for i in range(q.shape[0]):
        for h in range(q.shape[1]):
            n = visible(i)
            scores = k[:n, h // group].double() @ q[i, h].double() * scale
            out[i, h] = torch.softmax(scores, 0) @ v[:n, h // group].double()
    return out


@pytest.mark.parametrize("cache_format", ["blocknum,KV_N,blocksize,D", "blocknum,blocksize,H"])
def test_paged_gqa_attention_semantics(cache_format):
    torch.manual_seed(0)
    nb, kvn, bs, d, n = 6, 2, 128, 16, 4
    seqs = [(130, 3), (5, 1), (257, 2)]  # (kv_len, q_len): chunked prefill, decode, prefix hit
    table = torch.tensor([[4, 1, 0], [2, 0, 0], [3, 5, 0]], dtype=torch.int32)
    keys = [torch.randn(L, kvn, d, dtype=BF16) for L, _ in seqs]
    vals = [torch.randn(L, kvn, d, dtype=BF16) for L, _ in seqs]
    kc = torch.zeros(nb, kvn, bs, d, dtype=BF16)
    vc = torch.zeros_like(kc)
    for r, (L, _) in enumerate(seqs):
        for p in range(L):
            kc[table[r, p // bs], :, p % bs] = keys[r][p]
            vc[table[r, p // bs], :, p % bs] = vals[r][p]
    if cache_format == "blocknum,blocksize,H":
        kc, vc = kc.transpose(1, 2).reshape(nb, bs, kvn * d), vc.transpose(1, 2).reshape(nb, bs, kvn * d)
    qs = [torch.randn(q, n, d, dtype=BF16) for _, q in seqs]
    cum = torch.tensor([q for _, q in seqs]).cumsum(0).tolist()
    # two more blocks than the batch needs are in the cache, so table rows may be short
    out, _ = torch_npu.npu_fused_infer_attention_score(
        torch.cat(qs),
        kc,
        vc,
        num_heads=n,
        num_key_value_heads=kvn,
        input_layout="TND",
        block_table=table,
        block_size=bs,
        actual_seq_lengths=cum,
        actual_seq_lengths_kv=[L for L, _ in seqs],
        atten_mask=MASK,
        sparse_mode=3,
        scale=0.3,
    )
    start = 0
    for r, (L, q_len) in enumerate(seqs):
        expected = _brute_attention(
            qs[r], keys[r], vals[r], 0.3, lambda i, L=L, q_len=q_len: L - q_len + i + 1
        )
        torch.testing.assert_close(out[start : start + q_len].double(), expected, rtol=2e-2, atol=2e-2)
        start += q_len


def test_mla_form_semantics():
    torch.manual_seed(1)
    nb, bs, heads, seq = 3, 128, 32, 150
    latent = torch.randn(nb, 1, bs, 512, dtype=BF16)
    rope = torch.randn(nb, 1, bs, 64, dtype=BF16)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    q, q_rope = torch.randn(1, heads, 1, 512, dtype=BF16), torch.randn(1, heads, 1, 64, dtype=BF16)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q,
        latent,
        latent,
        query_rope=q_rope,
        key_rope=rope,
        num_heads=heads,
        num_key_value_heads=1,
        input_layout="BNSD",
        scale=0.05,
        block_table=table,
        block_size=bs,
        actual_seq_lengths_kv=[seq],
    )
    rows = torch.cat([latent[2, 0], latent[0, 0]])[:seq].double()
    rope_rows = torch.cat([rope[2, 0], rope[0, 0]])[:seq].double()
    for h in range(heads):
        scores = (rows @ q[0, h, 0].double() + rope_rows @ q_rope[0, h, 0].double()) * 0.05
        expected = torch.softmax(scores, 0) @ rows
        torch.testing.assert_close(out[0, h, 0].double(), expected, rtol=2e-2, atol=2e-2)


def _paged_batch(seqs, kvn=2, n=4, d=16, bs=128, seed=3):
    """(query, key cache, value cache, block table, per-request keys and values) for
    ``seqs`` of (kv_len, q_len), each request's blocks laid out from block 1 on."""
    torch.manual_seed(seed)
    per = max(-(-kv // bs) for kv, _ in seqs)
    table = torch.arange(1, 1 + per * len(seqs), dtype=torch.int32).view(len(seqs), per)
    kc = torch.zeros(1 + per * len(seqs), kvn, bs, d, dtype=BF16)
    vc = torch.zeros_like(kc)
    keys = [torch.randn(kv, kvn, d, dtype=BF16) for kv, _ in seqs]
    vals = [torch.randn(kv, kvn, d, dtype=BF16) for kv, _ in seqs]
    for r, (kv, _) in enumerate(seqs):
        for p in range(kv):
            kc[table[r, p // bs], :, p % bs], vc[table[r, p // bs], :, p % bs] = keys[r][p], vals[r][p]
    query = torch.randn(sum(q for _, q in seqs), n, d, dtype=BF16)
    return query, kc, vc, table, keys, vals


def _windowed_brute(q, k, v, scale, kv_len, window, sinks=None):
    """Each query row (the last rows of a kv_len sequence) over its last ``window`` keys;
    ``sinks``: one more logit per head in the softmax, with no value."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for i in range(q.shape[0]):
        p = kv_len - q.shape[0] + i
        lo = max(0, p - window + 1) if window else 0
        for h in range(q.shape[1]):
            scores = k[lo : p + 1, h // group].double() @ q[i, h].double() * scale
            if sinks is not None:
                scores = torch.cat([scores, sinks[h : h + 1].double()])
            out[i, h] = torch.softmax(scores, 0)[: p + 1 - lo] @ v[lo : p + 1, h // group].double()
    return out


def _check_rows(out, seqs, query, keys, vals, window, sinks=None):
    start = 0
    for r, (kv, q_len) in enumerate(seqs):
        expected = _windowed_brute(query[start : start + q_len], keys[r], vals[r], 0.3, kv, window, sinks)
        torch.testing.assert_close(out[start : start + q_len].double(), expected, rtol=2e-2, atol=2e-2)
        start += q_len


def test_sliding_window_forms_semantics():
    """Band (sparse_mode 4) aligns query row i with key KV_S - Q_S + i and keeps
    [that - pre_tokens, that + next_tokens], with one query row per request too (the
    incumbent's hardware fixes, vllm-ascend #8508: the doc's "Q_S为1...该参数无效" does not
    hold for the band in TND decode); a decode step's window as a defaultMask with sparse 0
    is refused (vllm-ascend #15503: ignored past KV position 512). One row per request without
    a mask (sparse 0) sees every key."""
    window = 7
    common = dict(num_heads=4, num_key_value_heads=2, input_layout="TND", block_size=128, scale=0.3)

    mixed = [(130, 3), (5, 1), (257, 2)]
    query, kc, vc, table, keys, vals = _paged_batch(mixed)
    cum = torch.tensor([q for _, q in mixed]).cumsum(0).tolist()
    out, _ = torch_npu.npu_fused_infer_attention_score(
        query,
        kc,
        vc,
        block_table=table,
        actual_seq_lengths=cum,
        actual_seq_lengths_kv=[kv for kv, _ in mixed],
        atten_mask=MASK,
        sparse_mode=4,
        pre_tokens=window - 1,
        next_tokens=0,
        **common,
    )
    _check_rows(out, mixed, query, keys, vals, window)

    decode = [(130, 1), (5, 1), (700, 1)]  # past window + 512 keys too
    query, kc, vc, table, keys, vals = _paged_batch(decode)
    lens = dict(
        block_table=table, actual_seq_lengths=[1, 2, 3], actual_seq_lengths_kv=[kv for kv, _ in decode]
    )
    banded, _ = torch_npu.npu_fused_infer_attention_score(
        query, kc, vc, atten_mask=MASK, sparse_mode=4, pre_tokens=window - 1, next_tokens=0, **lens, **common
    )
    _check_rows(banded, decode, query, keys, vals, window)
    plain, _ = torch_npu.npu_fused_infer_attention_score(query, kc, vc, sparse_mode=0, **lens, **common)
    _check_rows(plain, decode, query, keys, vals, None)
    width = table.shape[1] * 128
    before = torch.arange(width).unsqueeze(0) < torch.tensor([kv - window for kv, _ in decode]).unsqueeze(1)
    with pytest.raises(ContractViolation, match="FIA.tnd_sparse"):
        torch_npu.npu_fused_infer_attention_score(
            query, kc, vc, atten_mask=before.view(3, 1, 1, width), sparse_mode=0, **lens, **common
        )


def test_v2_learnable_sink_semantics():
    """v2 is v1 under new names; its learnable_sink adds one logit per query head to every
    row's softmax and attends to nothing (prompt rows with the band, and decode rows)."""
    window = 7
    common = dict(
        num_query_heads=4, num_key_value_heads=2, input_layout="TND", block_size=128, softmax_scale=0.3
    )
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0], dtype=BF16)
    for seqs, band in (([(130, 3), (5, 1), (257, 2)], True), ([(130, 1), (5, 1)], False)):
        query, kc, vc, table, keys, vals = _paged_batch(seqs)
        masks = dict(atten_mask=MASK, sparse_mode=3)
        if band:
            masks = dict(atten_mask=MASK, sparse_mode=4, pre_tokens=window - 1, next_tokens=0)
        out, _ = torch_npu.npu_fused_infer_attention_score_v2(
            query,
            kc,
            vc,
            block_table=table,
            actual_seq_qlen=torch.tensor([q for _, q in seqs]).cumsum(0).tolist(),
            actual_seq_kvlen=[kv for kv, _ in seqs],
            learnable_sink=sinks,
            **masks,
            **common,
        )
        _check_rows(out, seqs, query, keys, vals, window if band else None, sinks)
        with pytest.raises(AssertionError):  # the sinks took weight
            _check_rows(out, seqs, query, keys, vals, window if band else None)


def test_clipped_swiglu_semantics():
    """Interleaved (gate at even columns) and halved splits; the gate clamped above at
    ``limit``, the linear part to [-limit, limit], y = A * sigmoid(alpha * A) * (B + bias)."""
    x = (torch.randn(5, 12) * 6).to(BF16)
    for interleaved in (True, False):
        y = torch_npu.npu_clipped_swiglu(x, alpha=1.5, limit=4.0, bias=0.5, interleaved=interleaved)
        h = x.double()
        a, b = (h[:, 0::2], h[:, 1::2]) if interleaved else (h[:, :6], h[:, 6:])
        a, b = a.clamp(max=4.0), b.clamp(-4.0, 4.0)
        torch.testing.assert_close(y.double(), a * torch.sigmoid(1.5 * a) * (b + 0.5), rtol=2e-2, atol=2e-2)
    assert (x.abs() > 4).any()  # the clamps mattered


@pytest.mark.parametrize("causal", [True, False])
def test_tnd_without_page_attention_semantics(causal):
    """The dense TND form in its documented shape: 8 heads, Q/K head size 192, V 128."""
    torch.manual_seed(2)
    q_lens, kv_lens, n, d, dv = [2, 3], [4, 3], 8, 192, 128
    q = torch.randn(sum(q_lens), n, d, dtype=BF16)
    k, v = torch.randn(sum(kv_lens), n, d, dtype=BF16), torch.randn(sum(kv_lens), n, dv, dtype=BF16)
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q,
        k,
        v,
        num_heads=n,
        num_key_value_heads=n,
        input_layout="TND",
        actual_seq_lengths=[2, 5],
        actual_seq_lengths_kv=[4, 7],
        atten_mask=MASK if causal else None,
        sparse_mode=3 if causal else 0,
        scale=1 / math.sqrt(d),
        softmax_lse_flag=True,
    )
    assert out.shape == (5, n, dv) and lse.shape == (5, n, 1)
    qs = ks = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        visible = (
            (lambda i, q_len=q_len, kv_len=kv_len: kv_len - q_len + i + 1)
            if causal
            else (lambda i, kv_len=kv_len: kv_len)
        )
        expected = _brute_attention(
            q[qs : qs + q_len], k[ks : ks + kv_len], v[ks : ks + kv_len], 1 / math.sqrt(d), visible
        )
        torch.testing.assert_close(out[qs : qs + q_len].double(), expected, rtol=2e-2, atol=2e-2)
        qs, ks = qs + q_len, ks + kv_len


def test_attention_update_lse_out_only_with_update_type_1():
    """AU.lse_out_type1: the merged lse is documented for update_type 1 only; the double
    poisons it for 0, so a caller that folds partials with update_type 0 fails its tests."""
    lses = [torch.randn(6), torch.randn(6)]
    outs = [torch.randn(6, 16), torch.randn(6, 16)]
    out0, lse0 = torch_npu.npu_attention_update(lses, outs, 0)
    out1, lse1 = torch_npu.npu_attention_update(lses, outs, 1)
    assert torch.isnan(lse0).all()
    torch.testing.assert_close(lse1, torch.logsumexp(torch.stack(lses), 0))
    torch.testing.assert_close(out0, out1)


def test_cache_write_semantics():
    key, value = torch.randn(3, 1, 8, dtype=BF16), torch.randn(3, 1, 4, dtype=BF16)
    kc, vc = torch.zeros(2, 16, 1, 8, dtype=BF16), torch.zeros(2, 16, 1, 4, dtype=BF16)
    torch_npu._npu_reshape_and_cache(
        key=key,
        value=value,
        key_cache=kc,
        value_cache=vc,
        slot_indices=torch.tensor([0, 17, 31], dtype=torch.int32),
    )
    for row, slot in enumerate([0, 17, 31]):
        assert torch.equal(kc[slot // 16, slot % 16], key[row])
        assert torch.equal(vc[slot // 16, slot % 16], value[row])
    assert int((kc != 0).any(-1).sum()) == 3
    cache = torch.zeros(3, 2, 4, 5)
    index = torch.tensor([[[1, 0, 2], [1, 1, 2]], [[0, 0, 3], [0, 1, 3]]])
    updates = torch.randn(2, 2, 5)
    assert torch_npu.npu_scatter_nd_update_(cache, index, updates) is cache
    assert torch.equal(cache[1, :, 2], updates[0]) and torch.equal(cache[0, :, 3], updates[1])
    assert int((cache != 0).any(-1).sum()) == 4


@pytest.mark.parametrize("group_list_type", [0, 1])
def test_grouped_matmul_and_swiglu_semantics(group_list_type):
    torch.manual_seed(3)
    x = torch.randn(7, 8, dtype=BF16)
    weight = torch.randn(3, 4, 8, dtype=BF16).transpose(1, 2)  # [E, K, N] as a transposed view
    counts = [2, 0, 5]
    groups = counts if group_list_type else torch.tensor(counts).cumsum(0).tolist()
    [y] = torch_npu.npu_grouped_matmul(
        [x],
        [weight],
        group_list=torch.tensor(groups),
        split_item=2,
        group_type=0,
        group_list_type=group_list_type,
    )
    rows = [e for e, c in enumerate(counts) for _ in range(c)]
    for i, e in enumerate(rows):
        torch.testing.assert_close(y[i].float(), x[i].float() @ weight[e].float(), rtol=2e-2, atol=2e-2)
    act = torch_npu.npu_swiglu(y)
    a, b = y.float()[:, :2], y.float()[:, 2:]
    torch.testing.assert_close(act.float(), a * torch.sigmoid(a) * b, rtol=2e-2, atol=2e-2)


def test_grouped_matmul_rows_past_the_groups_are_left_undefined():
    """Callers may pass more rows than the groups cover (GMM.rows_past_groups); the double
    leaves those rows NaN so a caller that uses them fails."""
    [y] = gmm(x_rows=9, group_list=(2, 6))
    assert not y[:6].isnan().any()
    assert y[6:].isnan().all()


def test_a8w4_grouped_matmul_is_the_documented_formula():
    """``((x - 8) @ w * scale + bias) * per_token_scale`` with the documented bias
    (``8 * w * scale`` summed over K) is ``x @ w * scale * per_token_scale``, the int8 x int4
    product, per expert group; rows past the groups stay undefined."""
    torch.manual_seed(0)
    y, x, values, scales, args = a8w4(counts=(2, 3), rows=6)
    per_token, starts = args["per_token_scale"][0], (0, 2, 5)
    for e in range(2):
        rows = slice(starts[e], starts[e + 1])
        want = (
            (x[rows].double() @ values[e].double()) * scales[e].double() * per_token[rows].double()[:, None]
        )
        torch.testing.assert_close(y[rows].double(), want, rtol=1e-2, atol=1e-2)
    assert y[5:].isnan().all()
    # without the offset term the result is off by 8 * sum_k w * scale per channel
    torch.manual_seed(0)  # the same inputs
    wrong, x_again, *_ = a8w4(counts=(2, 3), rows=6, bias=[torch.zeros(2, 8)])
    assert torch.equal(x_again, x)
    assert not torch.allclose(wrong[:5].float(), y[:5].float(), rtol=1e-2, atol=1e-2)


def test_int4_packing_is_undone_by_the_grouped_matmul():
    values = torch.randint(-8, 8, (3, 16), dtype=torch.int32)
    packed = torch_npu.npu_convert_weight_to_int4pack(values)
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (3, 2)  # documented (k, n/8)
    from torch_npu._ops.moe import unpack_int4

    assert torch.equal(unpack_int4(packed).to(torch.int32), values)


def test_w8a8_ops_semantics():
    """Quantize, dynamic quant and quant matmul (static and per-token) against brute force."""
    x = torch.tensor([[0.5, -1.5, 2.5, 100.0], [0.0, 0.0, 0.0, 0.0]])
    q = torch_npu.npu_quantize(x, torch.full((4,), 2.0), torch.full((4,), 1.0), torch.qint8, -1, False)
    # 0.5*2+1=2, -1.5*2+1=-2, 2.5*2+1=6, saturated to 127; zeros -> offset 1
    assert q.dtype == torch.int8 and q.tolist() == [[2, -2, 6, 127], [1, 1, 1, 1]]
    y, scale = torch_npu.npu_dynamic_quant(torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]], dtype=BF16))
    assert scale.dtype == torch.float32 and torch.allclose(scale, torch.tensor([2.0 / 127, 0.0]))
    assert y.tolist() == [[64, -127, 32], [0, 0, 0]]  # 63.5 and 31.75 round to even / nearest
    x1 = torch.randint(-128, 128, (3, 5), dtype=torch.int8)
    x2 = torch.randint(-128, 128, (5, 2), dtype=torch.int8)
    brute = [[sum(int(x1[i, t]) * int(x2[t, j]) for t in range(5)) for j in range(2)] for i in range(3)]
    brute = torch.tensor(brute, dtype=torch.float64)
    scale, bias = torch.tensor([0.5, 0.25]), torch.tensor([10, -10], dtype=torch.int32)
    out = torch_npu.npu_quant_matmul(x1, x2, scale, bias=bias, output_dtype=BF16)
    torch.testing.assert_close(out.double(), ((brute + bias.double()) * scale.double()).to(BF16).double())
    per_token = torch.tensor([1.0, 2.0, 0.5])
    out = torch_npu.npu_quant_matmul(x1, x2, scale, pertoken_scale=per_token, output_dtype=torch.float16)
    torch.testing.assert_close(
        out.double(), (brute * scale.double() * per_token.double()[:, None]).to(torch.float16).double()
    )


def test_rms_norm_semantics():
    torch.manual_seed(5)
    x, r, w = torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(8)
    y, rstd = torch_npu.npu_rms_norm(x, w, 1e-5)
    want = [row / math.sqrt(sum(v * v for v in row.tolist()) / 8 + 1e-5) * w for row in x.view(-1, 8)]
    torch.testing.assert_close(y, torch.stack(want).view(3, 2, 8))
    assert rstd.shape == (3, 2, 1) and rstd.dtype == torch.float32
    y2, _, s2 = torch_npu.npu_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(s2, x + r)
    torch.testing.assert_close(y2, torch_npu.npu_rms_norm(x + r, w, 1e-5)[0])


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul_semantics(mode):
    """Each pair of a head (the halves' i-th elements, or neighbours) turns by its angle:
    checked with complex multiplication."""
    torch.manual_seed(6)
    tokens, heads, dim = 3, 2, 8
    x = torch.randn(1, tokens, heads, dim)
    angle = torch.rand(tokens, dim // 2) * 6
    pair_angle = angle.repeat(1, 2) if mode == "half" else angle.repeat_interleave(2, dim=1)
    cos, sin = pair_angle.cos()[None, :, None], pair_angle.sin()[None, :, None]
    out = torch_npu.npu_rotary_mul(x, cos, sin, mode)
    if mode == "half":
        pairs = torch.complex(x[..., : dim // 2], x[..., dim // 2 :])
    else:
        pairs = torch.complex(x[..., 0::2], x[..., 1::2])
    turned = pairs * torch.polar(torch.ones_like(angle), angle)[None, :, None]
    if mode == "half":
        want = torch.cat((turned.real, turned.imag), dim=-1)
    else:
        want = torch.stack((turned.real, turned.imag), dim=-1).flatten(-2)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_apply_rotary_pos_emb_semantics():
    """Query and key turned in the half layout with one head of tables, both updated in place
    and returned; what the Atlas A2/A3 docs leave out is refused, naming the rule."""
    torch.manual_seed(7)
    tokens, dim = 3, 64
    q, k = torch.randn(tokens, 4, dim), torch.randn(tokens, 2, dim)
    angle = torch.rand(tokens, dim // 2) * 6
    cos, sin = angle.repeat(1, 2).cos()[:, None], angle.repeat(1, 2).sin()[:, None]
    want = [torch_npu.npu_rotary_mul(x.unsqueeze(0), cos[None], sin[None], "half")[0] for x in (q, k)]
    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = torch_npu.npu_apply_rotary_pos_emb(q_in, k_in, cos, sin, layout="TND")
    for got, expected, updated in ((q_out, want[0], q_in), (k_out, want[1], k_in)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(updated, expected, rtol=1e-5, atol=1e-5)  # in place
    cases = {
        "ARPE.mode": dict(rotary_mode="interleave"),
        "ARPE.layout": dict(layout="BNSD"),
        "ARPE.d": dict(q=torch.randn(tokens, 4, 32), k=torch.randn(tokens, 2, 32)),
        "ARPE.dtype": dict(q=q.to(BF16)),
        "ARPE.shapes": dict(
            cos=cos.expand(tokens, 2, dim).contiguous(), sin=sin.expand(tokens, 2, dim).contiguous()
        ),
        "PROJECT.in_place_contiguous": dict(q=torch.randn(tokens, 8, dim)[:, :4]),
    }
    for rule, change in cases.items():
        args = {
            "q": q.clone(),
            "k": k.clone(),
            "cos": cos,
            "sin": sin,
            "layout": "TND",
            "rotary_mode": "half",
        }
        args.update(change)
        with pytest.raises(ContractViolation, match=rf"\[{rule};"):
            torch_npu.npu_apply_rotary_pos_emb(
                args["q"],
                args["k"],
                args["cos"],
                args["sin"],
                layout=args["layout"],
                rotary_mode=args["rotary_mode"],
            )


@pytest.mark.parametrize("active", [[0, 4], [1, 3]])
def test_init_and_finalize_routing_semantics(active):
    """Init sorts each (token, slot) row by expert and counts the rows per active expert;
    the gather-type index says where each source row went. Finalize weighs and sums a
    token's rows from positions read slot-major. Checked against a per-token loop."""
    torch.manual_seed(7)
    tokens, top_k, hidden = 5, 2, 6
    x = torch.randn(tokens, hidden)
    ids = torch.stack([torch.randperm(4)[:top_k] for _ in range(tokens)]).to(torch.int32)
    rows, position, counts, _ = torch_npu.npu_moe_init_routing_v2(
        x,
        ids,
        active_num=tokens * top_k,
        expert_num=4,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        active_expert_range=active,
        quant_mode=-1,
    )
    start, end = active
    flat = ids.flatten().tolist()
    assert counts.tolist() == [flat.count(e) for e in range(start, end)]
    for source, expert in enumerate(flat):
        if start <= expert < end:
            assert torch.equal(rows[int(position[source])], x[source // top_k])
        else:
            assert int(position[source]) == -1
    held = [position[s] for s, e in enumerate(flat) if start <= e < end]
    assert sorted(int(p) for p in held) == list(range(len(held)))  # the valid rows come first
    sorted_experts = [
        flat[s] for s in sorted(range(len(flat)), key=lambda s: int(position[s])) if int(position[s]) >= 0
    ]
    assert sorted_experts == sorted(sorted_experts)
    if active == [0, 4]:
        processed = rows * 2 + 1  # any per-row function of the expert input
        weights = torch.rand(tokens, top_k)
        slot_major = position.view(tokens, top_k).t().contiguous().view(-1)
        out = torch_npu.npu_moe_finalize_routing(
            processed, None, None, None, weights, slot_major, ids, 0, top_k
        )
        want = torch.stack([sum(weights[t, k] * (x[t] * 2 + 1) for k in range(top_k)) for t in range(tokens)])
        torch.testing.assert_close(out, want)


def test_latent_prolog_and_interleave_rope_semantics():
    """Both ops normalise/rotate as documented: the rope part's pairs (neighbours in the
    input) each turn by their angle (checked with complex multiplication) and come out
    de-interleaved (the pairs' first elements, then their second); the latent part is
    RMS-normed; both land at the index's slots and nowhere else."""
    torch.manual_seed(7)
    tokens = 3
    kv = torch.randn(tokens, 1, 1, 576)
    angle = torch.rand(tokens, 32) * 6
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)  # the half layout's tables
    pairs = torch.complex(kv[:, 0, 0, 512::2], kv[:, 0, 0, 513::2]) * torch.polar(
        torch.ones_like(angle), angle
    )
    want_rope = torch.cat((pairs.real, pairs.imag), dim=-1)
    gamma = torch.rand(512) + 0.5
    latent = kv[:, 0, 0, :512]
    want_latent = latent / latent.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * gamma
    index = torch.tensor([20, 5, 17])
    k_cache, ckv_cache = torch.zeros(2, 16, 1, 64, dtype=BF16), torch.zeros(2, 16, 1, 512, dtype=BF16)
    _, _, k_embed, y = torch_npu.npu_kv_rmsnorm_rope_cache(
        kv.to(BF16),
        gamma.to(BF16),
        cos.view(tokens, 1, 1, 64).to(BF16),
        sin.view(tokens, 1, 1, 64).to(BF16),
        index,
        k_cache,
        ckv_cache,
        epsilon=1e-6,
        cache_mode="PA_BNSD",
        is_output_kv=True,
    )
    tol = dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(k_embed.view(tokens, 64).float(), want_rope, **tol)
    torch.testing.assert_close(y.view(tokens, 512).float(), want_latent, **tol)
    torch.testing.assert_close(k_cache.view(-1, 64)[index].float(), want_rope, **tol)
    torch.testing.assert_close(ckv_cache.view(-1, 512)[index].float(), want_latent, **tol)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[index] = False
    assert not k_cache.view(-1, 64)[untouched].any() and not ckv_cache.view(-1, 512)[untouched].any()
    x = kv[:, :, :, 512:].expand(tokens, 2, 1, 64).contiguous()  # two heads, the same rope part
    rotated = torch_npu.npu_interleave_rope(
        x.to(BF16), cos.view(tokens, 1, 1, 64).to(BF16), sin.view(tokens, 1, 1, 64).to(BF16)
    )
    torch.testing.assert_close(rotated[:, 1, 0].float(), want_rope, **tol)
