"""Reference kernels against brute-force computations that share no code with them."""

from __future__ import annotations

import math

import pytest
import torch

from vllm.ascend.kernels import attention, mla, moe


def _dense_attention(q, k, v, context, scale, window=None, soft_cap=None, sinks=None):
    """Textbook softmax(q k^T) v with an explicit loop mask, one head at a time; with a
    window, each query over its last ``window`` positions; with a soft cap, each scaled
    score s replaced by cap * tanh(s / cap); with sinks, the head's sink logit joins the
    softmax and its weight is thrown away."""
    q_len, heads, _ = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(q_len, heads, v.shape[-1], dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for i in range(q_len):
            allowed = context + i + 1
            first = 0 if window is None else max(0, allowed - window)
            scores = (kh[first:allowed] @ q[i, h].double()) * scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            if sinks is not None:
                scores = torch.cat([scores, sinks[h : h + 1].double()])
            w = torch.softmax(scores, 0)[: allowed - first]
            out[i, h] = w @ vh[first:allowed]
    return out


@pytest.mark.parametrize("soft_cap,with_sinks", [(None, False), (0.5, False), (None, True), (0.5, True)])
def test_paged_attention_matches_dense_attention(soft_cap, with_sinks):
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size, num_blocks = 4, 2, 8, 4, 32
    k_plane = torch.zeros(num_blocks, kv_heads, block_size, dim)
    v_plane = torch.zeros(num_blocks, kv_heads, block_size, dim)
    # Two requests: one with 6 cached tokens + 3 new (chunked prefill / prefix hit), one decode.
    seqs = [(9, 3), (5, 1)]
    perm = torch.randperm(num_blocks).tolist()
    block_table = torch.zeros(2, 8, dtype=torch.int32)
    ks, vs, qs = [], [], []
    for r, (seq_len, q_len) in enumerate(seqs):
        blocks = perm[r * 8 : r * 8 + 8]
        block_table[r] = torch.tensor(blocks)
        k, v = torch.randn(seq_len, kv_heads, dim), torch.randn(seq_len, kv_heads, dim)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        attention.reference_write_kv_cache(k, v, k_plane, v_plane, slots)
        ks.append(k), vs.append(v), qs.append(torch.randn(q_len, heads, dim))
    # Head-major planes: token p of head h sits at [block, h, offset].
    b0, off = block_table[0, 5 // block_size], 5 % block_size
    torch.testing.assert_close(k_plane[b0, :, off], ks[0][5])
    query = torch.cat(qs)
    out = torch.zeros_like(query)
    sinks = torch.randn(heads) if with_sinks else None
    attention.reference_paged_attention(
        query,
        k_plane,
        v_plane,
        block_table,
        [0, 3, 4],
        [9, 5],
        1 / math.sqrt(dim),
        out,
        soft_cap=soft_cap,
        sinks=sinks,
    )
    qsl = [0, 3, 4]
    for r, (seq_len, q_len) in enumerate(seqs):
        expected = _dense_attention(
            qs[r], ks[r], vs[r], seq_len - q_len, 1 / math.sqrt(dim), None, soft_cap, sinks
        )
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]].double(), expected, rtol=1e-5, atol=1e-5)
    if soft_cap is not None or with_sinks:  # the cap bends these scores, sinks take weight: plain differs
        plain = _dense_attention(qs[0], ks[0], vs[0], 6, 1 / math.sqrt(dim))
        assert not torch.allclose(out[0:3].double(), plain, rtol=1e-3, atol=1e-3)


def test_sink_attention_matches_transformers_gpt_oss():
    """The reference kernel's sinks against transformers' own gpt-oss eager attention (an
    independent implementation), with a window and GQA."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(3)
    heads, kv_heads, dim, seq, window = 4, 2, 8, 11, 4
    q, k, v = torch.randn(seq, heads, dim), torch.randn(seq, kv_heads, dim), torch.randn(seq, kv_heads, dim)
    sinks = torch.randn(heads)
    ours = attention.causal_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 0, 0.3, window, sinks=sinks
    )
    pos = torch.arange(seq)
    visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    mask = torch.zeros(1, 1, seq, seq).masked_fill(~visible, float("-inf"))
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=2, training=False)
    theirs, _ = eager_attention_forward(
        module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, 0.3
    )
    torch.testing.assert_close(ours, theirs[0], rtol=1e-5, atol=1e-5)


def test_sliding_window_attention_reads_only_the_blocks_in_some_window():
    """Chunked prefill over a cached prefix and a decode, a 6-token window over 4-token
    blocks; the blocks before every window are NaN (returned to the pool and reused)."""
    torch.manual_seed(2)
    heads, kv_heads, dim, block_size, window = 4, 2, 8, 4, 6
    seqs = [(19, 3), (14, 1)]  # (tokens, of which new)
    k_plane = torch.zeros(16, kv_heads, block_size, dim)
    v_plane = torch.zeros(16, kv_heads, block_size, dim)
    block_table = torch.tensor([[3, 7, 1, 9, 12], [4, 0, 8, 2, 0]], dtype=torch.int32)
    ks, vs, qs = [], [], []
    for r, (seq_len, q_len) in enumerate(seqs):
        k, v = torch.randn(seq_len, kv_heads, dim), torch.randn(seq_len, kv_heads, dim)
        slots = torch.tensor(
            [int(block_table[r, p // block_size]) * block_size + p % block_size for p in range(seq_len)]
        )
        attention.reference_write_kv_cache(k, v, k_plane, v_plane, slots)
        first_seen = seq_len - q_len - window + 1  # the first query's first key
        for b in range(first_seen // block_size):  # whole blocks before it: freed
            k_plane[block_table[r, b]] = v_plane[block_table[r, b]] = float("nan")
        ks.append(k), vs.append(v), qs.append(torch.randn(q_len, heads, dim))
    assert k_plane.isnan().any()  # the case does free blocks
    query, qsl, scale = torch.cat(qs), [0, 3, 4], 1 / math.sqrt(dim)
    out = torch.zeros_like(query)
    attention.reference_paged_attention(
        query, k_plane, v_plane, block_table, qsl, [s for s, _ in seqs], scale, out, window
    )
    for r, (seq_len, q_len) in enumerate(seqs):
        expected = _dense_attention(qs[r], ks[r], vs[r], seq_len - q_len, scale, window)
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]].double(), expected, rtol=1e-5, atol=1e-5)
    full = torch.zeros_like(query)
    attention.reference_paged_attention(query, k_plane, v_plane, block_table, qsl, [19, 14], scale, full)
    assert full.isnan().any()  # without the window the freed blocks would be read


def test_write_skips_padding_slots():
    k_plane = torch.zeros(2, 1, 2, 1)
    v_plane = torch.zeros(2, 1, 2, 1)
    k = torch.tensor([[[1.0]], [[2.0]], [[3.0]]])
    attention.reference_write_kv_cache(k, -k, k_plane, v_plane, torch.tensor([3, -1, 0]))
    assert k_plane.flatten().tolist() == [3.0, 0.0, 0.0, 1.0]
    assert v_plane.flatten().tolist() == [-3.0, 0.0, 0.0, -1.0]


def test_mla_decode_matches_expanded_attention():
    """Absorbed MLA decode equals ordinary attention over the expanded keys/values."""
    torch.manual_seed(1)
    heads, rank, rope, block_size = 3, 16, 4, 4
    seq_len = 7
    latent, rope_plane = torch.zeros(4, block_size, 1, rank), torch.zeros(4, block_size, 1, rope)
    c, pe = torch.randn(seq_len, rank), torch.randn(seq_len, 1, rope)
    block_row = torch.tensor([2, 0], dtype=torch.int32)
    slots = torch.tensor(
        [int(block_row[p // block_size]) * block_size + p % block_size for p in range(seq_len)]
    )
    mla.reference_write_latent_cache(c, pe, latent, rope_plane, slots)
    q_nope, q_pe = torch.randn(1, heads, rank), torch.randn(1, heads, rope)
    out = mla.reference_mla_decode(q_nope, q_pe, latent, rope_plane, block_row.unsqueeze(0), [seq_len], 0.3)
    keys = torch.cat([c, pe.squeeze(1)], dim=-1)  # per-token key shared by all heads
    q = torch.cat([q_nope[0], q_pe[0]], dim=-1)
    expected = torch.softmax(q @ keys.t() * 0.3, dim=-1) @ c
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)


def test_mla_causal_dense_attention_matches_per_request_attention():
    torch.manual_seed(3)
    heads, dqk, dv = 2, 8, 4
    q_lens, kv_lens = [3, 0, 2], [5, 4, 2]
    q = torch.randn(sum(q_lens), heads, dqk)
    k, v = torch.randn(sum(kv_lens), heads, dqk), torch.randn(sum(kv_lens), heads, dv)
    out, _ = mla.reference_dense_attention(q, k, v, q_lens, kv_lens, 0.5, causal=True)
    qs = ks = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        expected = _dense_attention(
            q[qs : qs + q_len], k[ks : ks + kv_len], v[ks : ks + kv_len], kv_len - q_len, 0.5
        )
        torch.testing.assert_close(out[qs : qs + q_len].double(), expected, rtol=1e-5, atol=1e-5)
        qs, ks = qs + q_len, ks + kv_len


def test_moe_experts_match_per_token_loop():
    torch.manual_seed(2)
    tokens, hidden, inter, experts, k = 6, 8, 5, 4, 2
    x = torch.randn(tokens, hidden)
    w13, w2 = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k)
    out = moe.reference_moe_experts(x, w13, w2, weights, ids)
    for t in range(tokens):
        acc = torch.zeros(hidden)
        for j in range(k):
            e = int(ids[t, j])
            g, u = (w13[e] @ x[t]).split(inter)
            acc += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(g) * u))
        torch.testing.assert_close(out[t], acc, rtol=1e-4, atol=1e-4)
    # With an expert map that drops experts 0 and 1 (held by another rank), only 2 and 3 count.
    emap = torch.tensor([-1, -1, 0, 1])
    part = moe.reference_moe_experts(x, w13[2:], w2[2:], weights, ids, expert_map=emap)
    masked = weights * (ids >= 2)
    torch.testing.assert_close(part, moe.reference_moe_experts(x, w13, w2, masked, ids), rtol=1e-4, atol=1e-4)


def test_gpt_oss_experts_match_transformers():
    """Biased experts with the clamped, interleaved SwiGLU (swigluoai) against transformers'
    gpt-oss experts; vLLM's loader stores gate_up_proj [E, H, 2I] transposed as w13 and
    down_proj [E, I, H] as w2. Gate/up values past the clamp limit (7) occur."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    torch.manual_seed(4)
    tokens, hidden, inter, experts, k = 7, 8, 6, 4, 2
    config = GptOssConfig(
        intermediate_size=inter,
        num_local_experts=experts,
        hidden_size=hidden,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
    )
    hf = GptOssExperts(config)
    with torch.no_grad():
        hf.gate_up_proj.copy_(torch.randn(experts, hidden, 2 * inter))
        hf.gate_up_proj_bias.copy_(torch.randn(experts, 2 * inter) * 3)
        hf.down_proj.copy_(torch.randn(experts, inter, hidden) * 0.3)
        hf.down_proj_bias.copy_(torch.randn(experts, hidden))
    x = torch.randn(tokens, hidden)
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k), -1)
    with torch.no_grad():
        expected = hf(x, ids, weights)
        gate_up = torch.einsum("th,ehn->ten", x, hf.gate_up_proj) + hf.gate_up_proj_bias
    assert (gate_up.abs() > 7).any()  # the clamp matters here
    w13, w2 = hf.gate_up_proj.detach().transpose(1, 2), hf.down_proj.detach().transpose(1, 2)
    b13, b2 = hf.gate_up_proj_bias.detach(), hf.down_proj_bias.detach()
    out = moe.reference_moe_experts(
        x, w13, w2, weights, ids, activation="swigluoai", w13_bias=b13, w2_bias=b2
    )
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(NotImplementedError, match="silu and swigluoai"):
        moe.reference_moe_experts(x, w13, w2, weights, ids, activation="gelu")


def test_soc_notes_name_the_ops_the_wheel_documents_for_other_socs():
    from vllm.ascend.kernels import soc_notes

    assert soc_notes("A2") == []
    [note] = soc_notes("A3")
    assert note.startswith("npu_swiglu:") and "vllm-ascend" in note
