"""The contract double's Gated DeltaNet ops against transformers' own torch functions of
Qwen3-Next (no code shared), and the documented limits they enforce: shapes and dtypes,
one initial state per sequence, q and k normalised, gates at most 0, the recurrent op's
sequence lengths and state rows, and no ACL graph capture of the recurrent op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

torch_npu = pytest.importorskip("torch_npu")
if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
    pytest.skip("the real torch_npu is active on this host", allow_module_level=True)

from torch_npu._rules import ContractViolation  # noqa: E402

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
BF16 = torch.bfloat16


def _inputs(lengths, nk=2, nv=4, d=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = F.normalize(torch.randn(t, nk, d, generator=gen), dim=-1).to(BF16)
    k = F.normalize(torch.randn(t, nk, d, generator=gen), dim=-1).to(BF16)
    v = torch.randn(t, nv, d, generator=gen).to(BF16)
    g = -F.softplus(torch.randn(t, nv, generator=gen)) * 2  # strong gates, below -1 too
    beta = torch.sigmoid(torch.randn(t, nv, generator=gen)).to(BF16)
    state = (torch.randn(len(lengths), nv, d, d, generator=gen) * 0.1).to(BF16)
    return q, k, v, g, beta, state


def _transformers(q, k, v, g, beta, state, lengths, chunked):
    """Sequence by sequence through transformers (state [HV, K, V] there: ours transposed)."""
    group = v.shape[1] // q.shape[1]
    fn = hf.torch_chunk_gated_delta_rule if chunked else hf.torch_recurrent_gated_delta_rule
    outs, finals, start = [], [], 0
    for i, n in enumerate(lengths):
        part = slice(start, start + n)
        o, final = fn(
            q[part].float().repeat_interleave(group, 1)[None],
            k[part].float().repeat_interleave(group, 1)[None],
            v[part].float()[None],
            g[part][None],
            beta[part].float()[None],
            initial_state=state[i].float().transpose(1, 2)[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=False,
        )
        outs.append(o[0])
        finals.append(final[0].transpose(1, 2))
        start += n
    return torch.cat(outs), torch.stack(finals)


def test_chunk_op_equals_transformers_per_sequence():
    lengths = [70, 1, 130]
    q, k, v, g, beta, state = _inputs(lengths)
    out, final = torch_npu.npu_chunk_gated_delta_rule(
        q,
        k,
        v,
        beta=beta,
        initial_state=state,
        actual_seq_lengths=torch.tensor(lengths, dtype=torch.int32),
        scale=128**-0.5,
        g=g,
    )
    want_out, want_final = _transformers(q, k, v, g, beta, state, lengths, chunked=True)
    assert out.dtype == BF16 and final.dtype == BF16
    torch.testing.assert_close(out.float(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(final.float(), want_final, atol=2e-2, rtol=2e-2)


def test_recurrent_op_reads_and_writes_the_state_rows_in_place():
    lengths = [1, 1, 1]
    q, k, v, g, beta, state = _inputs(lengths, seed=1)
    rows = [5, 0, 3]
    cache = torch.zeros(6, *state.shape[1:], dtype=BF16)
    cache[rows] = state
    untouched = cache[[1, 2, 4]].clone()
    out = torch_npu.npu_recurrent_gated_delta_rule(
        q,
        k,
        v,
        cache,
        beta=beta,
        scale=128**-0.5,
        actual_seq_lengths=torch.ones(3, dtype=torch.int32),
        ssm_state_indices=torch.tensor(rows, dtype=torch.int32),
        g=g,
    )
    want_out, want_final = _transformers(q, k, v, g, beta, state, lengths, chunked=False)
    torch.testing.assert_close(out.float(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cache[rows].float(), want_final, atol=2e-2, rtol=2e-2)
    assert torch.equal(cache[[1, 2, 4]], untouched)


def test_recurrent_op_with_accepted_tokens_starts_from_the_last_accepted_row():
    """Verification rows (MTP): every token names the row its state goes to; a sequence
    starts from the state in its ``num_accepted_tokens - 1``-th token's row (the kernel's
    RGDR::Process), against transformers from that state."""
    lengths, accepted = [3, 3], [2, 1]
    q, k, v, g, beta, state = _inputs(lengths, seed=2)
    rows = [[4, 1, 6], [0, 7, 2]]
    cache = torch.zeros(8, *state.shape[1:], dtype=BF16)
    for i in range(2):
        cache[rows[i][accepted[i] - 1]] = state[i]
    untouched = cache[[3, 5]].clone()
    out = torch_npu.npu_recurrent_gated_delta_rule(
        q,
        k,
        v,
        cache,
        beta=beta,
        scale=128**-0.5,
        actual_seq_lengths=torch.tensor(lengths, dtype=torch.int32),
        ssm_state_indices=torch.tensor(rows, dtype=torch.int32).flatten(),
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32),
        g=g,
    )
    want_out, want_final = _transformers(q, k, v, g, beta, state, lengths, chunked=False)
    torch.testing.assert_close(out.float(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cache[[r[-1] for r in rows]].float(), want_final, atol=2e-2, rtol=2e-2)
    assert torch.equal(cache[[3, 5]], untouched)
    for bad in ([0, 1], [2, 4]):  # at least one accepted, at most the sequence's length
        with pytest.raises(ContractViolation, match=r"RGDR\.accepted"):
            torch_npu.npu_recurrent_gated_delta_rule(
                q,
                k,
                v,
                cache,
                beta=beta,
                scale=128**-0.5,
                actual_seq_lengths=torch.tensor(lengths, dtype=torch.int32),
                ssm_state_indices=torch.tensor(rows, dtype=torch.int32).flatten(),
                num_accepted_tokens=torch.tensor(bad, dtype=torch.int32),
                g=g,
            )


def _chunk_call(q, k, v, g, beta, state, lengths):
    return torch_npu.npu_chunk_gated_delta_rule(
        q,
        k,
        v,
        beta=beta,
        initial_state=state,
        actual_seq_lengths=torch.tensor(lengths, dtype=torch.int32),
        scale=q.shape[-1] ** -0.5,
        g=g,
    )


@pytest.mark.parametrize(
    "breach, rule",
    [
        ("head_dim_64", "CGDR.dims"),
        ("float32_state", "CGDR.state"),
        ("state_per_token", "CGDR.state"),
        ("q_not_normalised", "CGDR.ranges"),
        ("positive_gate", "CGDR.ranges"),
        ("lengths_do_not_sum", "GDR.lengths"),
        ("float16_inputs", "GDR.inputs"),
    ],
)
def test_chunk_op_refuses_what_its_docs_rule_out(breach, rule):
    lengths = [3, 2]
    q, k, v, g, beta, state = _inputs(lengths, d=64 if breach == "head_dim_64" else 128)
    if breach == "float32_state":
        state = state.float()
    if breach == "state_per_token":
        state = state.repeat(3, 1, 1, 1)[:5]
    if breach == "q_not_normalised":
        q = q * 2
    if breach == "positive_gate":
        g = -g
    if breach == "lengths_do_not_sum":
        lengths = [3, 3]
    if breach == "float16_inputs":
        q, k, v = (t.half() for t in (q, k, v))
    with pytest.raises(ContractViolation, match=rule.replace(".", r"\.")):
        _chunk_call(q, k, v, g, beta, state, lengths)


def test_recurrent_op_refuses_long_sequences_and_rows_outside_the_state():
    q, k, v, g, beta, state = _inputs([9])
    kwargs = dict(beta=beta, scale=0.1, g=g)
    cache = torch.zeros(9, *state.shape[1:], dtype=BF16)
    rows = torch.arange(9, dtype=torch.int32)
    with pytest.raises(ContractViolation, match=r"RGDR\.dims"):
        torch_npu.npu_recurrent_gated_delta_rule(
            q,
            k,
            v,
            cache,
            actual_seq_lengths=torch.tensor([9], dtype=torch.int32),
            ssm_state_indices=rows,
            **kwargs,
        )
    with pytest.raises(ContractViolation, match=r"RGDR\.indices"):
        torch_npu.npu_recurrent_gated_delta_rule(
            q,
            k,
            v,
            cache,
            actual_seq_lengths=torch.ones(9, dtype=torch.int32),
            ssm_state_indices=rows + 1,  # row 9 of 9
            **kwargs,
        )


def test_recurrent_op_is_not_captured_in_an_acl_graph():
    q, k, v, g, beta, state = _inputs([1, 1])
    cache = torch.zeros(2, *state.shape[1:], dtype=BF16)
    graph = torch_npu.npu.NPUGraph()
    capture = torch_npu.npu.graph(graph, stream=torch_npu.npu.Stream(), auto_dispatch_capture=True)
    with pytest.raises(ContractViolation, match=r"RGDR\.modes"), capture:
        torch_npu.npu_recurrent_gated_delta_rule(
            q,
            k,
            v,
            cache,
            beta=beta,
            scale=0.1,
            actual_seq_lengths=torch.ones(2, dtype=torch.int32),
            ssm_state_indices=torch.arange(2, dtype=torch.int32),
            g=g,
        )
