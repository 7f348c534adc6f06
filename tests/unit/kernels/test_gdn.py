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


def _batch(lengths, heads_k=2, heads_v=4, d=128, seed=3):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k = torch.randn(t, heads_k, d, generator=gen), torch.randn(t, heads_k, d, generator=gen)
    v = torch.randn(t, heads_v, d, generator=gen)
    a, b = torch.randn(t, heads_v, generator=gen), torch.randn(t, heads_v, generator=gen)
    g, beta = gdn.gating(a, b, torch.randn(heads_v, generator=gen) * 0.5, torch.randn(heads_v, generator=gen))
    states = torch.randn(len(lengths), heads_v, d, d, generator=gen) * 0.1
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, g, beta, states, starts


def test_conv_batch_equals_the_per_sequence_convolution_and_writes_each_state_row():
    lengths, started = [1, 5, 2, 0], [True, False, True, True]
    dim, width = 6, 4
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(sum(lengths) + 2, dim, generator=gen)  # two padding rows past the batch
    weight = torch.randn(dim, width, generator=gen)
    cache = torch.randn(9, width - 1, dim, generator=gen)
    slots = torch.tensor([4, 0, 7, 2])
    before = cache.clone()
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    y = gdn.conv_batch(x, weight, cache, starts, slots, torch.tensor(started))
    for i, (lo, hi) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
        want_y, want_state = gdn.conv(x[lo:hi], weight, before[slots[i]] if started[i] else None)
        torch.testing.assert_close(y[lo:hi], want_y)
        torch.testing.assert_close(cache[slots[i]], want_state)
    others = [r for r in range(9) if r not in slots.tolist()]
    assert torch.equal(cache[others], before[others])


def test_recurrent_step_batch_equals_the_recurrent_rule_per_sequence():
    q, k, v, g, beta, states, _ = _batch([1, 1, 1], d=16)
    cache = torch.zeros(5, *states.shape[1:])
    slots = torch.tensor([3, 1, 4])
    cache[slots] = states
    nq, nk = gdn.normalise_qk(q, k)
    o = gdn.recurrent_step_batch(nq, nk, v, g, beta, cache, slots)
    for i in range(3):
        want_o, want_state = gdn.recurrent_delta_rule(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], states[i]
        )
        torch.testing.assert_close(o[i], want_o[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache[slots[i]], want_state, atol=1e-5, rtol=1e-5)


def test_npu_forms_equal_the_reference_rules_through_the_contract_double():
    torch_npu = pytest.importorskip("torch_npu")
    if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
        pytest.skip("the real torch_npu is active on this host")
    lengths, started = [40, 3, 70], [True, False, True]
    q, k, v, g, beta, states, starts = _batch(lengths)
    cache = torch.zeros(6, *states.shape[1:], dtype=torch.bfloat16)
    slots = torch.tensor([5, 2, 0])
    cache[slots] = states.to(torch.bfloat16)
    nq, nk = gdn.normalise_qk(q, k)
    o = gdn.npu_prefill(nq, nk, v, g, beta, cache, slots, starts, torch.tensor(started))
    for i, (lo, hi) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
        initial = states[i].to(torch.bfloat16).float() if started[i] else None
        want_o, want_state = gdn.chunked_delta_rule(
            q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], initial
        )
        torch.testing.assert_close(o[lo:hi].float(), want_o, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(cache[slots[i]].float(), want_state, atol=3e-2, rtol=3e-2)
    # one decode token per sequence from the states just written, both forms
    q1, k1, v1, g1, beta1, _, _ = _batch([1, 1, 1], seed=4)
    nq1, nk1 = gdn.normalise_qk(q1, k1)
    twin = cache.clone()
    o_npu = gdn.npu_decode(nq1, nk1, v1, g1, beta1, cache, slots)
    o_torch = gdn.recurrent_step_batch(nq1, nk1, v1, g1, beta1, twin, slots)
    torch.testing.assert_close(o_npu.float(), o_torch, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(cache.float(), twin.float(), atol=3e-2, rtol=3e-2)


def _verification_reference(x, weight, buffers, accepted, lengths):
    """Per sequence, in the plain rule: the window ``accepted - 1`` into the buffer, the
    convolution from it, and the buffer afterwards (the window without its first input,
    then the sequence's inputs; the rest as it was)."""
    history = weight.shape[1] - 1
    ys, after, lo = [], buffers.clone(), 0
    for i, (took, n) in enumerate(zip(accepted, lengths)):
        window = buffers[i, took - 1 : took - 1 + history]
        y, _ = gdn.conv(x[lo : lo + n], weight, window)
        ys.append(y)
        rolled = torch.cat([window, x[lo : lo + n]])[1:]
        after[i, : rolled.shape[0]] = rolled
        lo += n
    return torch.cat(ys), after


@pytest.mark.parametrize("lengths, accepted", [([3, 3, 3], [1, 3, 2]), ([3, 1, 2], [2, 1, 2])])
def test_conv_verify_batch_starts_each_window_where_the_last_accepted_token_left_it(lengths, accepted):
    dim, width, drafts = 6, 4, 2
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(sum(lengths) + 3, dim, generator=gen)  # graph padding past the batch
    weight = torch.randn(dim, width, generator=gen)
    cache = torch.randn(8, width - 1 + drafts, dim, generator=gen)
    slots = torch.tensor([6, 1, 3])
    before = cache.clone()
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    y = gdn.conv_verify_batch(x, weight, cache, starts, slots, torch.tensor(accepted, dtype=torch.int32))
    want_y, want_buffers = _verification_reference(x, weight, before[slots], accepted, lengths)
    torch.testing.assert_close(y[: sum(lengths)], want_y)
    torch.testing.assert_close(cache[slots], want_buffers)
    others = [r for r in range(8) if r not in slots.tolist()]
    assert torch.equal(cache[others], before[others])


def _verify_inputs(lengths, drafts=2, d=16, seed=5):
    q, k, v, g, beta, _, starts = _batch(lengths, d=d, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    positions = drafts + 1
    slots = torch.randperm(len(lengths) * positions + 3, generator=gen)[: len(lengths) * positions]
    cache = torch.randn(len(lengths) * positions + 3, v.shape[1], v.shape[2], d, generator=gen) * 0.1
    return q, k, v, g, beta, cache, slots.view(len(lengths), positions), starts


@pytest.mark.parametrize("lengths, accepted", [([3, 3, 3], [1, 3, 2]), ([3, 2, 1], [2, 2, 1])])
def test_recurrent_verify_batch_keeps_every_position_s_state_from_the_accepted_start(lengths, accepted):
    q, k, v, g, beta, cache, slots, starts = _verify_inputs(lengths)
    before = cache.clone()
    nq, nk = gdn.normalise_qk(q, k)
    o = gdn.recurrent_verify_batch(
        nq, nk, v, g, beta, cache, slots, starts, torch.tensor(accepted, dtype=torch.int32)
    )
    for i, (lo, hi) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
        state = before[slots[i, accepted[i] - 1]]
        for t in range(hi - lo):
            j = lo + t
            want_o, state = gdn.recurrent_delta_rule(
                q[j : j + 1], k[j : j + 1], v[j : j + 1], g[j : j + 1], beta[j : j + 1], state
            )
            torch.testing.assert_close(o[j], want_o[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cache[slots[i, t]], state, atol=1e-5, rtol=1e-5)
        for t in range(hi - lo, slots.shape[1]):  # positions past the sequence: untouched
            assert torch.equal(cache[slots[i, t]], before[slots[i, t]])


def test_npu_verify_equals_the_torch_form_through_the_contract_double():
    torch_npu = pytest.importorskip("torch_npu")
    if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
        pytest.skip("the real torch_npu is active on this host")
    lengths, accepted = [3, 3, 2], torch.tensor([2, 3, 1], dtype=torch.int32)
    q, k, v, g, beta, cache, slots, starts = _verify_inputs(lengths, d=128)
    cache = cache.to(torch.bfloat16)
    twin = cache.clone()
    nq, nk = gdn.normalise_qk(q, k)
    o_npu = gdn.npu_verify(nq, nk, v, g, beta, cache, slots, starts, accepted)
    o_torch = gdn.recurrent_verify_batch(nq, nk, v, g, beta, twin, slots, starts, accepted)
    torch.testing.assert_close(o_npu.float(), o_torch, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(cache.float(), twin.float(), atol=3e-2, rtol=3e-2)
    # the start row matters: from each sequence's first row instead, far off
    error = (o_npu.float() - o_torch).abs().max()
    o_first = gdn.npu_verify(nq, nk, v, g, beta, twin, slots, starts, torch.ones_like(accepted))
    assert (o_first.float() - o_torch).abs().max() > 10 * error
