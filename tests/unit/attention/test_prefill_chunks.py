"""Long prefill in bounded memory (attention/prefill_chunks.py): a history cut into chunks
and merged by log-sum-exp gives the unchunked result. The plan is checked on the host
(every query sees exactly its causal prefix, once; no round exceeds the chunk), and the
numbers against an independent float64 attention, with the reference kernels and with the
NPU kernels through the torch_npu contract double."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.ascend.attention import prefill_chunks
from vllm.ascend.attention.mla import prefill_plan
from vllm.ascend.kernels import context_parallel as cp_kernels
from vllm.ascend.kernels import mla as mla_kernels
from vllm.ascend.kernels.attention import gather_range


@st.composite
def batches(draw):
    """(q_lens, seq_lens) of prefill requests (fresh, chunked-prefill continuations, prefix hits)."""
    n = draw(st.integers(1, 4))
    q_lens = [draw(st.integers(0, 40)) for _ in range(n)]
    seq_lens = [q + draw(st.integers(0, 60)) for q in q_lens]
    return q_lens, seq_lens


def _starts(q_lens):
    out = [0]
    for n in q_lens:
        out.append(out[-1] + n)
    return out


@settings(max_examples=200, deadline=None)
@given(batches(), st.integers(1, 70))
def test_every_query_sees_its_causal_prefix_exactly_once(batch, chunk):
    q_lens, seq_lens = batch
    starts = _starts(q_lens)
    plan = prefill_plan(starts, seq_lens, 0, chunk)
    seen: dict[int, list[int]] = {}
    for rnd in plan.rounds:
        assert rnd.rows <= chunk
        positions = [(r, p) for r, a, b in rnd.chunks for p in range(a, b)]
        for call in rnd.calls:
            for (row, n), (offset, kv_len) in zip(call.q_runs, call.kv_runs):
                assert n and kv_len and (not call.causal or kv_len >= n)
                keys = positions[offset : offset + kv_len]
                assert len({r for r, _ in keys}) == 1
                for i in range(n):
                    visible = kv_len - n + i + 1 if call.causal else kv_len
                    seen.setdefault(row + i, []).extend(p for _, p in keys[:visible])
    expected = {}
    for r, (q, s) in enumerate(zip(q_lens, seq_lens)):
        for i in range(q):
            expected[starts[r] + i] = list(range(s - q + i + 1))
    assert {row: sorted(keys) for row, keys in seen.items()} == expected
    assert plan.merge == any(s > chunk for q, s in zip(q_lens, seq_lens) if q)


def _oracle(q, k, v, q_lens, seq_lens, scale):
    """float64 causal attention, request by request, query by query."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    qs = ks = 0
    for q_len, seq in zip(q_lens, seq_lens):
        for i in range(q_len):
            n = seq - q_len + i + 1
            keys = k[ks : ks + n].double().repeat_interleave(group, dim=1)
            vals = v[ks : ks + n].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,nhd->hn", q[qs + i].double(), keys) * scale
            out[qs + i] = torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), vals)
        qs, ks = qs + q_len, ks + seq
    return out


@contextmanager
def _use(form: str):
    """Bind the chunked prefill to one kernel form."""
    if form == "npu":
        pytest.importorskip("torch_npu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mla_kernels, "dense_attention", getattr(mla_kernels, f"{form}_dense_attention"))
        mp.setattr(cp_kernels, "merge_partials", getattr(cp_kernels, f"{form}_merge_partials"))
        yield


@pytest.mark.parametrize("form", ["reference", "npu"])
@pytest.mark.parametrize(
    "heads, kv_heads, dqk, dv",
    [(4, 2, 16, 16), (8, 1, 192, 128)],  # GQA (context-parallel prefill), MLA-expanded (DeepSeek sizes)
)
@settings(max_examples=4, deadline=None)
@given(batch=batches(), chunk=st.sampled_from([3, 7, 16, 200]), seed=st.integers(0, 100))
def test_chunked_prefill_equals_unchunked_and_an_independent_oracle(
    form, heads, kv_heads, dqk, dv, batch, chunk, seed
):
    with _use(form):
        _check_chunked(form, heads, kv_heads, dqk, dv, batch, chunk, seed)


def _check_chunked(form, heads, kv_heads, dqk, dv, batch, chunk, seed):
    q_lens, seq_lens = batch
    if not sum(q_lens):
        return
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if form == "npu" else torch.float32
    q = torch.randn(sum(q_lens), heads, dqk, dtype=dtype)
    k = torch.randn(sum(seq_lens), kv_heads, dqk, dtype=dtype)
    v = torch.randn(sum(seq_lens), kv_heads, dv, dtype=dtype)
    kv_starts = _starts(seq_lens)
    scale = dqk**-0.5

    def materialize(rnd):
        rows = [slice(kv_starts[r] + a, kv_starts[r] + b) for r, a, b in rnd.chunks]
        return torch.cat([k[s] for s in rows]), torch.cat([v[s] for s in rows])

    plan = prefill_plan(_starts(q_lens), seq_lens, 0, chunk)
    out = torch.zeros(q.shape[0], heads, dv, dtype=dtype)
    prefill_chunks.attend(q, plan, materialize, scale, out, dv)
    unchunked, _ = mla_kernels.reference_dense_attention(q, k, v, q_lens, seq_lens, scale, causal=True)
    tol = dict(rtol=3e-2, atol=3e-2) if form == "npu" else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.double(), _oracle(q, k, v, q_lens, seq_lens, scale), **tol)
    torch.testing.assert_close(out.float(), unchunked.float(), **tol)


def test_mla_history_read_from_the_paged_cache_in_chunks():
    """The MLA prefill's materialiser: latent rows of each chunk read from the paged cache
    (``gather_range``), expanded by a projection, attended chunk by chunk."""
    torch.manual_seed(0)
    block_size, rank, rope, heads, nope, dv = 4, 8, 4, 2, 6, 5
    seq_lens, q_lens = [23, 9], [5, 9]
    table = torch.tensor([[3, 1, 7, 5, 2, 9], [4, 8, 6, 0, 0, 0]], dtype=torch.int32)
    latent = torch.randn(10, 1, block_size, rank + rope)  # head-major plane, latent and rope concatenated
    w_kv = torch.randn(rank, heads * (nope + dv))

    def expand(rows):
        kv = (rows[:, :rank] @ w_kv).view(-1, heads, nope + dv)
        k_nope, v = kv.split([nope, dv], dim=-1)
        return torch.cat([k_nope, rows[:, None, rank:].expand(-1, heads, -1)], dim=-1), v

    def materialize(rnd):
        return expand(torch.cat([gather_range(latent, table[r], a, b)[:, 0] for r, a, b in rnd.chunks]))

    q = torch.randn(sum(q_lens), heads, nope + rope)
    whole = torch.cat(
        [
            latent[table[r, : -(-s // block_size)].long()].transpose(1, 2).flatten(0, 1)[:s, 0]
            for r, s in enumerate(seq_lens)
        ]
    )
    k, v = expand(whole)
    expected = _oracle(q, k, v, q_lens, seq_lens, 0.3)
    for chunk in (3, 8, 64):
        out = torch.zeros(q.shape[0], heads, dv)
        with _use("reference"):
            prefill_chunks.attend(
                q, prefill_plan(_starts(q_lens), seq_lens, 0, chunk), materialize, 0.3, out, dv
            )
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_merge_partials_folds_like_one_softmax():
    torch.manual_seed(1)
    scores = torch.randn(3, 2, 10)
    v = torch.randn(10, 8)
    parts = [
        (torch.softmax(scores[..., a:b], -1) @ v[a:b], torch.logsumexp(scores[..., a:b], -1))
        for a, b in ((0, 4), (4, 10))
    ]
    out, lse = cp_kernels.reference_merge_partials(*parts[0], *parts[1])
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    torch_npu = pytest.importorskip("torch_npu")  # noqa: F841
    npu_out, npu_lse = cp_kernels.npu_merge_partials(*parts[0], *parts[1])
    torch.testing.assert_close(npu_out, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(npu_lse, lse)
