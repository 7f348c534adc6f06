"""The Gated DeltaNet kernels (kernels/gdn.py) against transformers' own torch functions of
Qwen3-Next (``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``,
``causal_conv1d_update``) and against a token-by-token loop: the recurrence with and
without an incoming state, sequences shorter than, equal to and longer than a chunk,
grouped value heads; the convolution with its state carried across calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.ascend.kernels import gdn

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def _inputs(length: int, heads_k: int = 2, heads_v: int = 4, dk: int = 16, dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, heads_k, dk, generator=g)
    k = torch.randn(length, heads_k, dk, generator=g)
    v = torch.randn(length, heads_v, dv, generator=g)
    a, b = torch.randn(length, heads_v, generator=g), torch.randn(length, heads_v, generator=g)
    A_log, dt_bias = torch.randn(heads_v, generator=g) * 0.5, torch.randn(heads_v, generator=g) * 0.5
    state = torch.randn(heads_v, dv, dk, generator=g) * 0.3
    return q, k, v, a, b, A_log, dt_bias, state


def _transformers(q, k, v, g, beta, state, chunked: bool):
    group = v.shape[1] // q.shape[1]
    rep = [t.repeat_interleave(group, dim=1)[None] for t in (q, k)]
    fn = hf.torch_chunk_gated_delta_rule if chunked else hf.torch_recurrent_gated_delta_rule
    o, final = fn(
        *rep,
        v[None],
        g[None],
        beta[None],
        initial_state=None if state is None else state.transpose(1, 2)[None],  # theirs: [B, HV, K, V]
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return o[0], final[0].transpose(1, 2)


@pytest.mark.parametrize("length", [1, 5, 64, 150])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_delta_rule_equals_transformers(length, with_state, form):
    q, k, v, a, b, A_log, dt_bias, state = _inputs(length, seed=length)
    g, beta = gdn.gating(a, b, A_log, dt_bias)
    state = state if with_state else None
    rule = gdn.chunked_delta_rule if form == "chunked" else gdn.recurrent_delta_rule
    o, final = rule(q, k, v, g, beta, state)
    want_o, want_final = _transformers(q, k, v, g, beta, state, chunked=form == "chunked")
    assert o.shape == v.shape and final.shape == (4, 8, 16)
    torch.testing.assert_close(o, want_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(final, want_final, atol=2e-5, rtol=2e-5)


def test_chunked_and_recurrent_forms_agree_and_a_state_carries_a_split_sequence():
    q, k, v, a, b, A_log, dt_bias, state = _inputs(200, seed=7)
    g, beta = gdn.gating(a, b, A_log, dt_bias)
    whole, s_whole = gdn.chunked_delta_rule(q, k, v, g, beta, state)
    step, s_step = gdn.recurrent_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(whole, step, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(s_whole, s_step, atol=2e-5, rtol=2e-5)
    # a prefill split in two chunks of a scheduler, then decode steps, carries the state
    first, s1 = gdn.chunked_delta_rule(q[:70], k[:70], v[:70], g[:70], beta[:70], state)
    second, s2 = gdn.chunked_delta_rule(q[70:190], k[70:190], v[70:190], g[70:190], beta[70:190], s1)
    outs, s = [first, second], s2
    for t in range(190, 200):
        o, s = gdn.recurrent_delta_rule(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s
        )
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), whole, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(s, s_whole, atol=3e-5, rtol=3e-5)


def test_dropping_the_state_or_the_gate_changes_the_output():
    q, k, v, a, b, A_log, dt_bias, state = _inputs(20, seed=3)
    g, beta = gdn.gating(a, b, A_log, dt_bias)
    o, _ = gdn.chunked_delta_rule(q, k, v, g, beta, state)
    assert not torch.allclose(o, gdn.chunked_delta_rule(q, k, v, g, beta, None)[0], atol=1e-3)
    assert not torch.allclose(
        o, gdn.chunked_delta_rule(q, k, v, torch.zeros_like(g), beta, state)[0], atol=1e-3
    )


def test_gating_is_qwens():
    _, _, _, a, b, A_log, dt_bias, _ = _inputs(6)
    g, beta = gdn.gating(a, b, A_log, dt_bias)
    torch.testing.assert_close(g, -A_log.exp() * F.softplus(a + dt_bias))
    torch.testing.assert_close(beta, b.sigmoid())


def test_conv_equals_transformers_and_carries_its_state():
    gen = torch.Generator().manual_seed(1)
    dim, width, length = 12, 4, 9
    x, weight = torch.randn(length, dim, generator=gen), torch.randn(dim, width, generator=gen)
    y, state = gdn.conv(x, weight, None)
    torch.testing.assert_close(
        y, hf.causal_conv1d_fn(x.T[None], weight, activation="silu")[0].T, atol=1e-5, rtol=1e-5
    )
    # transformers' one-token update over a zero state (its state keeps W columns)
    hf_state = torch.zeros(1, dim, width)
    steps = [
        hf.causal_conv1d_update(x[t][None, :, None], hf_state, weight, None, "silu")[0, :, 0]
        for t in range(length)
    ]
    torch.testing.assert_close(y, torch.stack(steps), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, x[-(width - 1) :])
    # split into two calls, the state carried: the same outputs
    y1, s1 = gdn.conv(x[:4], weight, None)
    y2, s2 = gdn.conv(x[4:], weight, s1)
    torch.testing.assert_close(torch.cat([y1, y2]), y, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s2, state)
