"""The distribution's NPU kernels (``npu_*``) run through the torch_npu contract double
on random shapes: every torch_npu call must pass the contract, and the results must
equal the reference kernels (bf16, the dtype the NPU kernels take)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

torch_npu = pytest.importorskip("torch_npu")

from vllm.ascend.kernels import (  # noqa: E402
    activation,
    attention,
    mla,
    moe,
    norm,
    quant,  # noqa: E402
    rotary,
)

BF16 = torch.bfloat16
TOL = dict(rtol=3e-2, atol=3e-2)


def _requests(data, block_size: int, max_blocks: int, decode_only: bool = False):
    """(kv_len, q_len) per request: prefill, chunked prefill / prefix hit, decode."""
    n = data.draw(st.integers(1, 4))
    out = []
    for _ in range(n):
        kv = data.draw(st.integers(1, block_size * max_blocks))
        q = 1 if decode_only else data.draw(st.sampled_from([1, min(kv, 3), kv]))
        out.append((kv, q))
    return out


def _slots(table, kv_len, q_len, block_size):
    return [int(table[p // block_size]) * block_size + p % block_size for p in range(kv_len - q_len, kv_len)]


@settings(max_examples=16, deadline=None)
@given(
    data=st.data(),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    head_size=st.sampled_from([16, 64]),
    block_size=st.sampled_from([128, 256]),
)
def test_gqa_write_and_attention_equal_reference(data, kv_heads, group, head_size, block_size):
    """With a sliding window too: the band, in decode-only steps as well (contexts up to 768
    keys: past window + 512, where a sparse-0 mask would be ignored on the device); blocks
    before every window of a request are vLLM's null block in its table row, as upstream's
    sliding-window manager leaves them."""
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    max_blocks = 3
    window = data.draw(st.sampled_from([None, 1, 5, 130]))
    reqs = _requests(data, block_size, max_blocks, decode_only=data.draw(st.booleans()))
    num_blocks = 1 + max_blocks * len(reqs)  # block 0 is vLLM's null block
    table = torch.arange(1, num_blocks, dtype=torch.int32).view(len(reqs), max_blocks)
    shape = (num_blocks, kv_heads, block_size, head_size)
    planes = {
        name: (torch.zeros(shape, dtype=BF16), torch.zeros(shape, dtype=BF16)) for name in ("npu", "ref")
    }
    # History first (as earlier steps wrote it), then this step's tokens plus two padding slots.
    history = [torch.randn(kv - q, kv_heads, head_size, dtype=BF16) for kv, q in reqs]
    for r, (kv, q) in enumerate(reqs):
        if kv > q:
            slots = torch.tensor(_slots(table[r], kv - q, kv - q, block_size))
            writers = (("npu", attention.npu_write_kv_cache), ("ref", attention.reference_write_kv_cache))
            for name, write in writers:
                write(history[r], -history[r], *planes[name], slots)
    new = sum(q for _, q in reqs)
    key = torch.randn(new + 2, kv_heads, head_size, dtype=BF16)
    value = torch.randn(new + 2, kv_heads, head_size, dtype=BF16)
    slots = sum((_slots(table[r], kv, q, block_size) for r, (kv, q) in enumerate(reqs)), [])
    slots = torch.tensor(slots + [-1, -1])
    attention.npu_write_kv_cache(key, value, *planes["npu"], slots)
    attention.reference_write_kv_cache(key, value, *planes["ref"], slots)
    for npu_plane, ref_plane in zip(planes["npu"], planes["ref"]):
        assert torch.equal(npu_plane[1:], ref_plane[1:])  # padding went to the null block only
    query = torch.randn(new, kv_heads * group, head_size, dtype=BF16)
    qsl = torch.tensor([0] + [q for _, q in reqs]).cumsum(0).tolist()
    seq_lens = [kv for kv, _ in reqs]
    if window is not None:
        for r, (kv, q) in enumerate(reqs):
            first_key = max(0, kv - q - window + 1)
            table[r, : first_key // block_size] = 0
    out_npu, out_ref = torch.zeros_like(query), torch.zeros_like(query)
    scale = head_size**-0.5
    # gpt-oss's sinks: the fused op's v2 (bfloat16 learnable_sink)
    sinks = (torch.randn(kv_heads * group) * 2).to(BF16) if data.draw(st.booleans()) else None
    attention.npu_paged_attention(
        query, *planes["npu"], table, qsl, seq_lens, scale, out_npu, window, sinks=sinks
    )
    attention.reference_paged_attention(
        query, *planes["ref"], table, qsl, seq_lens, scale, out_ref, window, sinks=sinks
    )
    torch.testing.assert_close(out_npu.float(), out_ref.float(), **TOL)


@settings(max_examples=12, deadline=None)
@given(
    data=st.data(),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 4]),
    block_size=st.sampled_from([128, 256]),
)
def test_paged_decode_with_lse_equals_reference(data, kv_heads, group, block_size):
    """The context-parallel decode (one query row per request, with the softmax
    log-sum-exp): a request this rank holds no key of gets out 0 and lse -inf, as the
    reference gives it, whatever the fused op leaves there."""
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    max_blocks, head_size = 2, 64
    seq_lens = data.draw(st.lists(st.integers(0, block_size * max_blocks), min_size=1, max_size=4))
    num_blocks = 1 + max_blocks * len(seq_lens)
    table = torch.arange(1, num_blocks, dtype=torch.int32).view(len(seq_lens), max_blocks)
    shape = (num_blocks, kv_heads, block_size, head_size)
    k_plane, v_plane = torch.randn(shape, dtype=BF16), torch.randn(shape, dtype=BF16)
    query = torch.randn(len(seq_lens), kv_heads * group, head_size, dtype=BF16)
    args = (query, k_plane, v_plane, table, seq_lens, head_size**-0.5)
    out_npu, lse_npu = attention.npu_paged_decode(*args)
    out_ref, lse_ref = attention.reference_paged_decode(*args)
    torch.testing.assert_close(out_npu.float(), out_ref.float(), **TOL)
    empty = torch.tensor([n == 0 for n in seq_lens])
    assert torch.isneginf(lse_npu[empty]).all() and (out_npu[empty] == 0).all()
    torch.testing.assert_close(lse_npu[~empty].float(), lse_ref[~empty].float(), **TOL)


@pytest.mark.parametrize(
    "q_lens,window,expected",
    [
        ([1, 1], None, {"sparse_mode": 0, "atten_mask": False}),  # plain decode: no mask to read
        ([1, 1], 8, {"sparse_mode": 4, "atten_mask": True, "pre_tokens": 7, "next_tokens": 0}),
        ([3, 1], None, {"sparse_mode": 3, "atten_mask": True}),
        ([3, 1], 8, {"sparse_mode": 4, "atten_mask": True, "pre_tokens": 7, "next_tokens": 0}),
    ],
)
def test_fused_attention_mask_by_step(monkeypatch, q_lens, window, expected):
    """The mask the fused attention gets: none for one query row per request, the band for a
    window (decode too), rightDownCausal otherwise."""
    npu = attention.torch_npu()
    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    real = npu.npu_fused_infer_attention_score
    monkeypatch.setattr(npu, "npu_fused_infer_attention_score", spy)
    planes = [torch.randn(3, 1, 128, 16, dtype=BF16) for _ in range(2)]
    table = torch.tensor([[1], [2]], dtype=torch.int32)
    qsl = [0, *itertools.accumulate(q_lens)]
    query, out = torch.randn(qsl[-1], 2, 16, dtype=BF16), torch.zeros(qsl[-1], 2, 16, dtype=BF16)
    attention.npu_paged_attention(query, *planes, table, qsl, [40, 100], 0.25, out, window)
    got = {k: seen[k] for k in expected}
    got["atten_mask"] = seen["atten_mask"] is not None
    assert got == expected


@settings(max_examples=8, deadline=None)
@given(data=st.data(), heads=st.sampled_from([4, 32, 100]), block_size=st.sampled_from([16, 128]))
def test_mla_write_decode_and_prefill_equal_reference(data, heads, block_size):
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    rank, rope_dim, max_blocks = 512, 64, 2
    reqs = _requests(data, block_size, max_blocks)
    num_blocks = 1 + max_blocks * len(reqs)
    table = torch.arange(1, num_blocks, dtype=torch.int32).view(len(reqs), max_blocks)
    planes = {
        name: (
            torch.zeros(num_blocks, block_size, 1, rank, dtype=BF16),
            torch.zeros(num_blocks, block_size, 1, rope_dim, dtype=BF16),
        )
        for name in ("npu", "ref")
    }
    total = sum(kv for kv, _ in reqs)
    kv_c = torch.randn(total + 1, rank, dtype=BF16)
    k_pe = torch.randn(total + 1, 1, rope_dim, dtype=BF16)
    slots = sum((_slots(table[r], kv, kv, block_size) for r, (kv, _) in enumerate(reqs)), [])
    slots = torch.tensor(slots + [-1])
    mla.npu_write_latent_cache(kv_c, k_pe, *planes["npu"], slots)
    mla.reference_write_latent_cache(kv_c, k_pe, *planes["ref"], slots)
    for npu_plane, ref_plane in zip(planes["npu"], planes["ref"]):
        assert torch.equal(npu_plane[1:], ref_plane[1:])
    seq_lens = [kv for kv, _ in reqs]
    q_nope = torch.randn(len(reqs), heads, rank, dtype=BF16)
    q_pe = torch.randn(len(reqs), heads, rope_dim, dtype=BF16)
    out_npu = mla.npu_mla_decode(q_nope, q_pe, *planes["npu"], table, seq_lens, 0.04)
    out_ref = mla.reference_mla_decode(q_nope, q_pe, *planes["ref"], table, seq_lens, 0.04)
    torch.testing.assert_close(out_npu.float(), out_ref.float(), **TOL)
    # Draft verification: q_len rows per request (one batch each, S = q_len, rightDownCausal)
    # against one decode row per query token over its own prefix (the brute-force rule).
    q_len = data.draw(st.integers(2, 3))
    verified = [max(n, q_len) for n in seq_lens]
    q_nope = torch.randn(len(reqs) * q_len, heads, rank, dtype=BF16)
    q_pe = torch.randn(len(reqs) * q_len, heads, rope_dim, dtype=BF16)
    out_npu = mla.npu_mla_decode(q_nope, q_pe, *planes["npu"], table, verified, 0.04, q_len=q_len)
    rows = table.repeat_interleave(q_len, dim=0)
    row_lens = [n - q_len + i + 1 for n in verified for i in range(q_len)]
    out_rows = mla.reference_mla_decode(q_nope, q_pe, *planes["ref"], rows, row_lens, 0.04)
    torch.testing.assert_close(out_npu.float(), out_rows.float(), **TOL)
    out_ref = mla.reference_mla_decode(q_nope, q_pe, *planes["ref"], table, verified, 0.04, q_len=q_len)
    torch.testing.assert_close(out_ref, out_rows, rtol=0, atol=0)
    # Prefill attention over expanded keys/values (V narrower than Q/K, as in DeepSeek).
    q_lens = [q for _, q in reqs]
    q = torch.randn(sum(q_lens), 4, 96, dtype=BF16)
    k = torch.randn(total, 4, 96, dtype=BF16)
    v = torch.randn(total, 4, 32, dtype=BF16)
    torch.testing.assert_close(
        mla.npu_dense_attention(q, k, v, q_lens, seq_lens, 0.1, causal=True)[0].float(),
        mla.reference_dense_attention(q, k, v, q_lens, seq_lens, 0.1, causal=True)[0].float(),
        **TOL,
    )


@settings(max_examples=10, deadline=None)
@given(
    data=st.data(),
    kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 3, 48]),
    dims=st.sampled_from([(16, 16), (64, 32), (192, 128), (96, 160)]),
    dtype=st.sampled_from([torch.float16, BF16]),
    causal=st.booleans(),
)
def test_dense_attention_equals_reference(data, kv_heads, group, dims, dtype, causal):
    """The dense TND form fitted to its documented limits (cast to bf16, K/V heads repeated
    and padded to 8..128, more than 128 heads in groups, head sizes padded to 192 and 128 or
    192) through the contract double, against the float32 reference, output and LSE."""
    from torch_npu import _contract

    torch.manual_seed(data.draw(st.integers(0, 1000)))
    qk_dim, v_dim = dims
    heads = kv_heads * group
    kv_lens = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    q_lens = [data.draw(st.integers(0, kv)) if causal else data.draw(st.integers(0, 9)) for kv in kv_lens]
    q = torch.randn(sum(q_lens), heads, qk_dim, dtype=dtype)
    k = torch.randn(sum(kv_lens), kv_heads, qk_dim, dtype=dtype)
    v = torch.randn(sum(kv_lens), kv_heads, v_dim, dtype=dtype)
    before = _contract.calls["npu::npu_fused_infer_attention_score"]
    out, lse = mla.npu_dense_attention(q, k, v, q_lens, kv_lens, 0.1, causal)
    ref_out, ref_lse = mla.reference_dense_attention(q, k, v, q_lens, kv_lens, 0.1, causal)
    assert out.dtype == dtype and tuple(out.shape) == (sum(q_lens), heads, v_dim)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    calls = _contract.calls["npu::npu_fused_infer_attention_score"] - before
    # an entry without queries splits a call (its keys would sit inside the call's key rows)
    runs = sum(1 for i, n in enumerate(q_lens) if n and (i == 0 or not q_lens[i - 1]))
    assert calls == runs * -(-heads // 128), "one call per run of entries with queries and group of 128 heads"


def test_dense_attention_refuses_head_sizes_padding_cannot_fit():
    q = torch.randn(2, 8, 256, dtype=BF16)
    with pytest.raises(ValueError, match="Q/K head size <= 192"):
        mla.npu_dense_attention(q, q, q[..., :128], [2], [2], 0.1, True)
    q = torch.randn(2, 8, 64, dtype=BF16)
    with pytest.raises(ValueError, match="V head size <= 192"):
        mla.npu_dense_attention(q, q, torch.randn(2, 8, 256, dtype=BF16), [2], [2], 0.1, True)


def test_dense_calls_stay_within_the_documented_t():
    """Entries are packed into calls of at most 65536 query and key rows (host-side plan);
    an entry without queries ends a call (a call's keys are one contiguous run)."""
    limit = mla.NPU_DENSE_MAX_T
    q_lens, kv_lens = [40000, 30000, 5000, 0, 5, 65536], [40000, 30000, 5000, 7, 70, 65536]
    calls = mla._dense_subcalls(q_lens, kv_lens)
    assert [(c[2], c[3]) for c in calls] == [
        ([40000], [40000]),
        ([30000, 5000], [30000, 5000]),
        ([5], [70]),
        ([65536], [65536]),
    ]
    assert [(c[0], c[1]) for c in calls] == [(0, 0), (40000, 40000), (75000, 75007), (75005, 75077)]
    assert all(sum(c[2]) <= limit and sum(c[3]) <= limit for c in calls)
    with pytest.raises(ValueError, match="exceeds"):
        mla._dense_subcalls([limit + 1], [limit + 1])


@settings(max_examples=10, deadline=None)
@given(
    data=st.data(),
    tokens=st.integers(1, 9),
    experts=st.sampled_from([2, 4, 8]),
    top_k=st.sampled_from([1, 2]),
    with_map=st.booleans(),
)
def test_moe_experts_equal_reference(data, tokens, experts, top_k, with_map):
    """SiLU experts, and gpt-oss's: biases and the clamped SwiGLU (npu_clipped_swiglu),
    with the router weights on the output or (Llama 4) on the input."""
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    hidden, inter = 16, 8
    x = torch.randn(tokens, hidden, dtype=BF16)
    w13 = (torch.randn(experts, 2 * inter, hidden) * 0.2).to(BF16)
    w2 = (torch.randn(experts, hidden, inter) * 0.2).to(BF16)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)
    gpt_oss = data.draw(st.booleans())
    extra = {}
    if gpt_oss:  # gate/up biases of a few units: some values pass the clamp limit
        extra = dict(
            activation="swigluoai",
            w13_bias=(torch.randn(experts, 2 * inter) * 4).to(BF16),
            w2_bias=torch.randn(experts, hidden).to(BF16),
        )
    on_input = data.draw(st.booleans())
    expert_map = None
    if with_map:  # this rank holds the upper half of the experts (some tokens route to none of them)
        local = experts // 2
        expert_map = torch.tensor([-1] * (experts - local) + list(range(local)))
        w13, w2 = w13[experts - local :], w2[experts - local :]
        extra = {n: t[experts - local :] if n.endswith("bias") else t for n, t in extra.items()}
    args = dict(expert_map=expert_map, apply_router_weight_on_input=on_input, **extra)
    out_npu = moe.npu_moe_experts(x, w13, w2, weights, ids, **args)
    out_ref = moe.reference_moe_experts(x, w13, w2, weights, ids, **args)
    # bf16 rounds the forms' intermediate values (a few units with the biases) differently
    atol = TOL["atol"] * max(1.0, float(out_ref.float().abs().max()) / 2)
    torch.testing.assert_close(out_npu.float(), out_ref.float(), rtol=TOL["rtol"], atol=atol)


@settings(max_examples=10, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 9),
    k=st.sampled_from([16, 48]),
    n=st.sampled_from([8, 24]),
    dtype=st.sampled_from([BF16, torch.float16]),
    with_bias=st.booleans(),
)
def test_w8a8_linear_kernels_equal_reference(data, rows, k, n, dtype, with_bias):
    """Static and dynamic W8A8 through torch_npu's quantize / dynamic-quant / quant-matmul
    ops: the int8 activations agree with the reference but for ties the reciprocal form
    may round differently (at most one step), and the outputs agree to the output dtype."""
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    x = (torch.randn(rows, k) * 2).to(dtype)
    w_q = torch.randint(-128, 128, (k, n), dtype=torch.int8)
    scale, offset = torch.tensor([0.03]), torch.tensor([5.0])
    xq_npu = quant.npu_quantize_static(x, *quant.npu_static_params(scale, offset, k))
    xq_ref = quant.reference_quantize_static(x, *quant.reference_static_params(scale, offset, k))
    assert xq_npu.dtype == torch.int8 and (xq_npu.int() - xq_ref.int()).abs().max() <= 1
    deq = torch.rand(n) * 1e-3
    qbias = torch.randint(-1000, 1000, (n,), dtype=torch.int32) if with_bias else None
    out = quant.npu_matmul_static(xq_ref, w_q, deq, qbias, dtype)
    torch.testing.assert_close(
        out.float(), quant.reference_matmul_static(xq_ref, w_q, deq, qbias, dtype).float(), **TOL
    )
    xq_d, s_d = quant.npu_quantize_dynamic(x)
    xq_r, s_r = quant.reference_quantize_dynamic(x)
    assert torch.equal(xq_d, xq_r) and torch.equal(s_d, s_r)
    w_scale = torch.rand(n) * 1e-2
    bias = torch.randn(n).to(dtype) if with_bias else None
    out = quant.npu_matmul_dynamic(xq_d, w_q, w_scale, s_d, bias, dtype)
    ref = quant.reference_matmul_dynamic(xq_r, w_q, w_scale, s_r, bias, dtype)
    torch.testing.assert_close(out.float(), ref.float(), **TOL)


def _routing_with_optional_map(tokens, experts, top_k, with_map, *per_expert):
    """Random top-k routing; with ``with_map``, this rank holds the last half of the experts
    (an expert map, and ``per_expert`` tensors cut to its experts). (ids, weights, map,
    the per-expert tensors)."""
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)
    if not with_map:
        return ids, weights, None, per_expert
    local = experts // 2
    expert_map = torch.tensor([-1] * (experts - local) + list(range(local)))
    return ids, weights, expert_map, tuple(t[experts - local :] for t in per_expert)


@settings(max_examples=8, deadline=None)
@given(
    data=st.data(),
    tokens=st.integers(1, 12),
    experts=st.sampled_from([4, 8]),
    top_k=st.sampled_from([1, 2]),
    with_map=st.booleans(),
)
def test_w8a8_dynamic_moe_experts_equal_reference(data, tokens, experts, top_k, with_map):
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    hidden, inter = 16, 8
    x = torch.randn(tokens, hidden, dtype=BF16)
    w13 = torch.randint(-128, 128, (experts, 2 * inter, hidden), dtype=torch.int8)
    w2 = torch.randint(-128, 128, (experts, hidden, inter), dtype=torch.int8)
    s13, s2 = torch.rand(experts, 2 * inter) * 2e-3, torch.rand(experts, hidden) * 2e-3
    ids, weights, expert_map, (w13, w2, s13, s2) = _routing_with_optional_map(
        tokens, experts, top_k, with_map, w13, w2, s13, s2
    )
    out_npu = moe.npu_moe_experts_w8a8_dynamic(x, w13, w2, s13, s2, weights, ids, expert_map=expert_map)
    out_ref = moe.reference_moe_experts_w8a8_dynamic(x, w13, w2, s13, s2, weights, ids, expert_map=expert_map)
    # the NPU form's scales are bfloat16 (documented for bfloat16 output), the reference's float32
    torch.testing.assert_close(out_npu.float(), out_ref.float(), rtol=6e-2, atol=6e-2)


@settings(max_examples=6, deadline=None)
@given(
    data=st.data(),
    tokens=st.integers(1, 12),
    experts=st.sampled_from([2, 4]),
    top_k=st.sampled_from([1, 2]),
    with_map=st.booleans(),
)
def test_w4a8_dynamic_moe_experts_equal_reference(data, tokens, experts, top_k, with_map):
    """The A8W4 grouped matmul (the double computes its documented ``(x - 8) @ w * scale +
    bias``, so the offset term must be right) against the reference's int8 math on the
    same int4 values; hidden and intermediate 256, the smallest input the op takes."""
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    hidden = inter = 256
    x = torch.randn(tokens, hidden, dtype=BF16)
    v13 = torch.randint(-8, 8, (experts, 2 * inter, hidden), dtype=torch.int8)
    v2 = torch.randint(-8, 8, (experts, hidden, inter), dtype=torch.int8)
    s13, s2 = torch.rand(experts, 2 * inter) * 2e-2, torch.rand(experts, hidden) * 2e-2
    # msModelSlim's scale_bias: 8 * sum_k w * scale
    o13 = 8 * (v13.double() * s13.double()[..., None]).sum(-1)
    o2 = 8 * (v2.double() * s2.double()[..., None]).sum(-1)
    ids, weights, expert_map, (v13, v2, s13, s2, o13, o2) = _routing_with_optional_map(
        tokens, experts, top_k, with_map, v13, v2, s13, s2, o13, o2
    )
    npu13, npu2 = moe.npu_w4a8_weights(v13, s13, o13), moe.npu_w4a8_weights(v2, s2, o2)
    assert (
        npu13.weight.dtype == torch.int32 and npu13.weight.numel() * 4 == v13.numel() // 2
    )  # int4: half an int8
    out_npu = moe.npu_moe_experts_w4a8_dynamic(x, npu13, npu2, weights, ids, expert_map=expert_map)
    ref13, ref2 = moe.reference_w4a8_weights(v13, s13, o13), moe.reference_w4a8_weights(v2, s2, o2)
    out_ref = moe.reference_moe_experts_w4a8_dynamic(x, ref13, ref2, weights, ids, expert_map=expert_map)
    torch.testing.assert_close(out_npu.float(), out_ref.float(), rtol=6e-2, atol=6e-2)


def test_w4a8_weights_the_npu_op_cannot_take_are_refused():
    values = torch.zeros(2, 16, 64, dtype=torch.int8)  # input 64: not a multiple of 256
    with pytest.raises(ValueError, match="multiple of 256"):
        moe.npu_w4a8_weights(values, torch.ones(2, 16), torch.zeros(2, 16))


def test_write_index_and_slots_built_once_equal_the_per_call_writes():
    """The backends build the cache-write coordinates (GQA) and int32 slots (MLA) once per
    step and hand them to every layer's write: through the double, those writes land
    exactly where the writes that derive them per call land."""
    slot_mapping = torch.tensor([5, -1, 130, 300])  # the fourth slot is past the step's tokens
    index = attention.npu_write_index(slot_mapping, 3, 2, 128)
    assert (
        index.shape == (3, 2, 3) and index[2, 1].tolist() == [1, 1, 2] and index[1, 0].tolist() == [0, 0, 0]
    )
    key = torch.randn(3, 2, 16, dtype=BF16)
    given = (torch.zeros(3, 2, 128, 16, dtype=BF16), torch.zeros(3, 2, 128, 16, dtype=BF16))
    derived = (torch.zeros(3, 2, 128, 16, dtype=BF16), torch.zeros(3, 2, 128, 16, dtype=BF16))
    attention.npu_write_kv_cache(key, -key, *given, slot_mapping, index)
    attention.npu_write_kv_cache(key, -key, *derived, slot_mapping)
    assert all(torch.equal(a, b) for a, b in zip(given, derived)) and bool(given[0].any())

    slots = mla.npu_write_slots(slot_mapping, 3)
    assert slots.dtype == torch.int32 and slots.tolist() == [5, 0, 130]
    kv_c, k_pe = torch.randn(3, 512, dtype=BF16), torch.randn(3, 1, 64, dtype=BF16)
    caches = [
        (torch.zeros(3, 128, 1, 512, dtype=BF16), torch.zeros(3, 128, 1, 64, dtype=BF16)) for _ in range(2)
    ]
    mla.npu_write_latent_cache(kv_c, k_pe, *caches[0], slot_mapping, slots)
    mla.npu_write_latent_cache(kv_c, k_pe, *caches[1], slot_mapping)
    assert all(torch.equal(a, b) for a, b in zip(*caches)) and torch.equal(caches[0][0][1, 2, 0], kv_c[2])


def test_npu_slots_send_padding_to_the_null_block():
    """Padding tokens (slot -1) are written to slot 0 (block 0, vLLM's null block) without
    a host sync; through the double, the write lands there and nowhere else."""
    slots = attention.npu_slots(torch.tensor([5, -1, 130, 7]), 3)
    assert slots.dtype == torch.int64 and slots.tolist() == [5, 0, 130]
    planes = (torch.zeros(3, 2, 128, 16, dtype=BF16), torch.zeros(3, 2, 128, 16, dtype=BF16))
    key = torch.randn(3, 2, 16, dtype=BF16)
    attention.npu_write_kv_cache(key, -key, *planes, torch.tensor([5, -1, 130]))
    k_plane, v_plane = planes
    assert torch.equal(k_plane[0, :, 0], key[1]) and torch.equal(v_plane[0, :, 0], -key[1])
    assert torch.equal(k_plane[0, :, 5], key[0]) and torch.equal(k_plane[1, :, 2], key[2])
    assert int((k_plane != 0).any(dim=-1).sum()) == 3 * 2  # three tokens x two heads, nothing else


@pytest.mark.parametrize("heads", [1, 32, 33, 64, 65, 128])
def test_mla_decode_pads_heads_to_the_documented_counts(heads):
    padded = mla.npu_padded_heads(heads)
    assert padded == min(n for n in (32, 64, 128) if n >= heads)
    torch.manual_seed(heads)
    latent = torch.randn(2, 16, 1, 512, dtype=BF16)
    rope = torch.randn(2, 16, 1, 64, dtype=BF16)
    table = torch.tensor([[1]], dtype=torch.int32)
    q_nope, q_pe = torch.randn(1, heads, 512, dtype=BF16), torch.randn(1, heads, 64, dtype=BF16)
    out = mla.npu_mla_decode(q_nope, q_pe, latent, rope, table, [9], 0.04)  # the double checks num_heads
    assert out.shape == (1, heads, 512)
    torch.testing.assert_close(
        out.float(), mla.reference_mla_decode(q_nope, q_pe, latent, rope, table, [9], 0.04).float(), **TOL
    )


def test_mla_decode_refuses_more_heads_than_the_kernel_takes():
    with pytest.raises(ValueError, match="at most 128 query heads per rank.*tensor-parallel"):
        mla.npu_padded_heads(129)


@pytest.mark.parametrize(
    "choice, emulate, expect_npu",
    [("npu", "1", True), ("reference", "1", False), ("auto", "1", False), ("auto", "0", True)],
)
def test_npu_kernels_binds_the_facade_once_from_the_kernel_choice(choice, emulate, expect_npu):
    """``npu_kernels()`` follows VLLM_ASCEND_KERNELS (auto: NPU kernels unless emulating), and
    the facade binds accordingly: with the NPU kernels a cache write goes through the
    double's torch_npu op, with the reference kernels no torch_npu op is called."""
    code = """
        import torch, torch_npu
        from torch_npu import _contract
        from vllm.ascend.kernels import npu_kernels, attention
        planes = [torch.zeros(2, 1, 128, 8, dtype=torch.bfloat16) for _ in range(2)]
        token = torch.ones(1, 1, 8, dtype=torch.bfloat16)
        attention.write_kv_cache(token, token, *planes, torch.tensor([130]))
        print(npu_kernels(), attention.write_kv_cache is attention.npu_write_kv_cache,
              _contract.calls["npu::npu_scatter_nd_update_"], float(planes[0][1, 0, 2].sum()))
    """
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ASCEND_KERNELS", "VLLM_ASCEND_EMULATE")}
    env.update(VLLM_ASCEND_KERNELS=choice, VLLM_ASCEND_EMULATE=emulate)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    on, bound, calls, written = result.stdout.split()[-4:]
    assert (on, bound) == (str(expect_npu), str(expect_npu))
    assert int(calls) == (2 if expect_npu else 0)  # K and V planes
    assert float(written) == 8.0  # either way the token reached block 1, offset 2


def test_mc2_passes_the_algorithm_the_selector_models():
    """comm_alg is never left to the environment: on A2 "" would follow
    HCCL_INTRA_PCIE_ENABLE / HCCL_INTRA_ROCE_ENABLE into hierarchy, whose limits differ."""
    from vllm.ascend.kernels.mc2 import Mc2Comm, _soc_arguments

    def args(soc):
        return _soc_arguments(Mc2Comm(None, "g", 16, 0, soc))

    assert args("A2") == {"comm_alg": "fullmesh"}
    assert args("A3") == {"comm_alg": "", "group_tp": "g", "tp_world_size": 1, "tp_rank_id": 0}
    assert args("host")["comm_alg"] == ""


@settings(max_examples=12, deadline=None)
@given(
    data=st.data(),
    tokens=st.integers(1, 9),
    hidden=st.sampled_from([8, 64, 96]),
    dtype=st.sampled_from([BF16, torch.float16, torch.float32]),
)
def test_norm_rotary_and_swiglu_equal_reference(data, tokens, hidden, dtype):
    """RMSNorm (alone and after the residual add), rotary embedding in both styles and
    SiLU-and-mul: torch_npu's fused ops through the double against the reference forms."""
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    x, residual = torch.randn(tokens, hidden, dtype=dtype), torch.randn(tokens, hidden, dtype=dtype)
    weight = torch.randn(hidden, dtype=dtype)
    torch.testing.assert_close(
        norm.npu_rms_norm(x, weight, 1e-6), norm.reference_rms_norm(x, weight, 1e-6), **TOL
    )
    for got, want in zip(
        norm.npu_add_rms_norm(x, residual, weight, 1e-6),
        norm.reference_add_rms_norm(x, residual, weight, 1e-6),
    ):
        torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(activation.npu_silu_and_mul(x), activation.reference_silu_and_mul(x), **TOL)

    head_size = data.draw(st.sampled_from([16, 32, 64]))
    heads = data.draw(st.integers(1, 4))
    angles = torch.rand(64, head_size // 2) * 6
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)
    positions = torch.randint(0, 64, (tokens,))
    q = torch.randn(tokens, heads, head_size, dtype=dtype)
    for neox in (True, False):
        cos, sin = rotary.tables_at(rotary.full_tables(cache, neox), positions)
        torch.testing.assert_close(
            rotary.npu_rotate(q, cos, sin, neox), rotary.reference_rotate(q, cos, sin, neox), **TOL
        )
    # YaRN's cache carries its attention factor: cos/sin beyond [-1, 1], which the op refuses
    # (ops/rotary.py rotates such caches in plain torch)
    for neox in (True, False):
        cos, sin = rotary.tables_at(rotary.full_tables((cache.float() * 1.35).to(dtype), neox), positions)
        with pytest.raises(torch_npu.ContractViolation, match="ROPE.range"):
            rotary.npu_rotate(q, cos, sin, neox)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_size", [64, 128, 96])
@pytest.mark.parametrize("strided", [False, True])
def test_rotate_pair_equals_reference_and_fuses_where_the_op_takes_it(neox, head_size, strided):
    """npu_apply_rotary_pos_emb for neox heads of 64 or 128 given contiguous (one launch);
    npu_rotary_mul per tensor for the rest (GPT-J, other head sizes, a QKV split's views)."""
    from torch_npu import _contract

    torch.manual_seed(3)
    tokens = 5
    qkv = torch.randn(tokens, (4 + 2 + 2) * head_size, dtype=BF16)
    q, k = qkv[:, : 4 * head_size], qkv[:, 4 * head_size : 6 * head_size]
    if not strided:
        q, k = q.contiguous(), k.contiguous()
    q, k = q.view(tokens, 4, head_size), k.view(tokens, 2, head_size)
    cache = _yarn_like_cache(64, head_size).to(BF16)
    cos, sin = rotary.tables_at(rotary.full_tables(cache, neox), torch.tensor([0, 3, 9, 17, 40]))
    want = rotary.reference_rotate_pair(q, k, cos, sin, neox)
    before = dict(_contract.calls)
    got = rotary.npu_rotate_pair(q, k, cos, sin, neox)
    calls = {op: n - before.get(op, 0) for op, n in _contract.calls.items() if n != before.get(op, 0)}
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), **TOL)
    fused = neox and head_size in (64, 128) and not strided
    assert calls == ({"npu::npu_apply_rotary_pos_emb": 1} if fused else {"npu::npu_rotary_mul": 2})


def _yarn_like_cache(positions: int, rope_dim: int) -> torch.Tensor:
    """A cos/sin cache in upstream's layout ([P, rot]: the rot/2 cosines, then the sines)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@settings(max_examples=6, deadline=None)
@given(data=st.data(), heads=st.sampled_from([4, 32]), block_size=st.sampled_from([16, 128]))
def test_mla_latent_prolog_and_query_rope_equal_reference(data, heads, block_size):
    """The fused prolog (npu_kv_rmsnorm_rope_cache) writes the same latent plane as the
    reference's norm + write, the rope plane in the de-interleaved order its docs give, and
    a decode whose query rope is rotated by npu_interleave_rope scores the same."""
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    rank, rope_dim, num_blocks = 512, 64, 16  # the decode's blocks: one per token
    tokens = data.draw(st.integers(1, 12))
    slots = torch.randperm(num_blocks * block_size - block_size)[:tokens] + block_size  # not the null block
    positions = torch.randint(0, 300, (tokens,))
    kv_lora = torch.randn(tokens, rank + rope_dim, dtype=BF16)
    gamma = torch.rand(rank, dtype=BF16) + 0.5
    cache = _yarn_like_cache(512, rope_dim).to(BF16)
    planes, outs = {}, {}
    for form, neox, prolog in (
        ("npu", True, mla.npu_latent_prolog),
        ("ref", False, mla.reference_latent_prolog),
    ):
        planes[form] = (
            torch.zeros(num_blocks, block_size, 1, rank, dtype=BF16),
            torch.zeros(num_blocks, block_size, 1, rope_dim, dtype=BF16),
        )
        rows = rotary.tables_at(rotary.full_tables(cache, neox), positions)
        outs[form] = (rows, *prolog(kv_lora, gamma, 1e-6, rows, *planes[form], slots))
    (_, c_npu, pe_npu), (_, c_ref, pe_ref) = outs["npu"], outs["ref"]
    torch.testing.assert_close(c_npu.float(), c_ref.float(), **TOL)
    deinterleave = torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))
    torch.testing.assert_close(pe_npu.float(), pe_ref[..., deinterleave].float(), **TOL)
    latent_npu, rope_npu = planes["npu"]
    latent_ref, rope_ref = planes["ref"]
    assert latent_ref.abs().sum() > 0 and torch.equal(latent_npu, latent_ref)
    torch.testing.assert_close(rope_npu.float(), rope_ref[..., deinterleave].float(), **TOL)
    # The query's rope part, rotated inside the decode, meets the rope plane in either order.
    table = (slots // block_size).to(torch.int32).view(tokens, 1)
    seq_lens = [int(s % block_size) + 1 for s in slots]
    q_nope = torch.randn(tokens, heads, rank, dtype=BF16)
    q_pe = torch.randn(tokens, heads, rope_dim, dtype=BF16)
    out_npu = mla.npu_mla_decode(q_nope, q_pe, *planes["npu"], table, seq_lens, 0.04, q_rope=outs["npu"][0])
    out_ref = mla.reference_mla_decode(
        q_nope, q_pe, *planes["ref"], table, seq_lens, 0.04, q_rope=outs["ref"][0]
    )
    torch.testing.assert_close(out_npu.float(), out_ref.float(), **TOL)
    # A key or query rotated in GPT-J order elsewhere (upstream's forward: dummy and padded
    # steps, graphs of more tokens than a block) and put in the prolog's order by rope_order
    # meets the prolog's plane alike; left in GPT-J order it would not.
    torch.testing.assert_close(mla.npu_rope_order(pe_ref).float(), pe_npu.float(), **TOL)
    assert torch.equal(mla.reference_rope_order(pe_ref), pe_ref)
    q_gptj = mla.reference_rope_query(q_pe, outs["ref"][0])
    out_upstream = mla.npu_mla_decode(
        q_nope, mla.npu_rope_order(q_gptj), *planes["npu"], table, seq_lens, 0.04
    )
    torch.testing.assert_close(out_upstream.float(), out_ref.float(), **TOL)
    # Prefill: rope_query gives the same rotation in the same order as the rope plane.
    rotated = mla.npu_rope_query(q_pe, outs["npu"][0])
    torch.testing.assert_close(
        rotated.float(), mla.reference_rope_query(q_pe, outs["ref"][0])[..., deinterleave].float(), **TOL
    )


def test_latent_prolog_refuses_repeated_or_padding_slots():
    rank, rope_dim = 512, 64
    kv_lora = torch.randn(2, rank + rope_dim, dtype=BF16)
    planes = (torch.zeros(2, 16, 1, rank, dtype=BF16), torch.zeros(2, 16, 1, rope_dim, dtype=BF16))
    rows = rotary.tables_at(
        rotary.full_tables(_yarn_like_cache(8, rope_dim).to(BF16), True), torch.tensor([0, 1])
    )
    gamma = torch.ones(rank, dtype=BF16)
    from torch_npu._rules import ContractViolation

    with pytest.raises(ContractViolation, match="KRRC.index_unique"):
        mla.npu_latent_prolog(kv_lora, gamma, 1e-6, rows, *planes, torch.tensor([17, 17]))
    with pytest.raises(ContractViolation, match="PROJECT.valid_slots"):
        mla.npu_latent_prolog(kv_lora, gamma, 1e-6, rows, *planes, torch.tensor([17, -1]))


def test_requests_sharing_prefix_blocks_past_the_cache_are_attended_in_several_calls():
    """Eight requests reading the same three prefix blocks need 8 x 4 = 32 blocks by the fused
    attention's blocknum rule (a shared block counts once per request) from a cache of 12: the
    NPU form splits the step into calls that each fit, and equals the reference."""
    from torch_npu import _contract

    torch.manual_seed(5)
    block_size, heads, head_size, reqs = 128, 2, 16, 8
    planes = [torch.randn(12, heads, block_size, head_size, dtype=BF16) for _ in range(2)]
    table = torch.tensor([[1, 2, 3, 4 + r] for r in range(reqs)], dtype=torch.int32)  # blocks 4..11: own
    seq_lens = [3 * block_size + 5 + r for r in range(reqs)]
    qsl = list(range(reqs + 1))  # one decode row each
    query = torch.randn(reqs, heads * 2, head_size, dtype=BF16)
    out_npu, out_ref = torch.zeros_like(query), torch.zeros_like(query)
    assert attention.block_groups(seq_lens, block_size, 12) == [(0, 3), (3, 6), (6, 8)]
    before = _contract.calls["npu::npu_fused_infer_attention_score"]
    attention.npu_paged_attention(query, *planes, table, qsl, seq_lens, 0.25, out_npu)
    assert _contract.calls["npu::npu_fused_infer_attention_score"] - before == 3
    attention.reference_paged_attention(query, *planes, table, qsl, seq_lens, 0.25, out_ref)
    torch.testing.assert_close(out_npu.float(), out_ref.float(), **TOL)
    with pytest.raises(torch_npu.ContractViolation, match="FIA.blocknum"):  # one call would not fit
        torch_npu.npu_fused_infer_attention_score(
            query,
            *planes,
            num_heads=heads * 2,
            num_key_value_heads=heads,
            input_layout="TND",
            block_table=table,
            block_size=block_size,
            actual_seq_lengths=qsl[1:],
            actual_seq_lengths_kv=seq_lens,
            scale=0.25,
        )
