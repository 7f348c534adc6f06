"""The speculative-decoding kernels (reference and NPU forms) against per-request loops
written from the Triton kernels' contracts, sharing no code with them; the NPU forms also
run under a guard that fails on any read-back to the host."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.ascend.kernels import spec_decode as sd

PAD = -1
FORMS = ["reference", "npu"]


def impl(form: str, name: str):
    return getattr(sd, f"{form}_{name}")


@contextlib.contextmanager
def no_host_reads(active: bool):
    """Fail on the calls that make a device wait for the host to read a value back."""
    if not active:
        yield
        return
    names = ("item", "tolist", "nonzero", "__bool__", "__int__", "__index__", "__float__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(*args, **kwargs):
        raise AssertionError("host read-back in an npu_* kernel")

    for n in names:
        setattr(torch.Tensor, n, refuse)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def draft_layout(data, max_spec: int, max_reqs: int = 6):
    counts = data.draw(st.lists(st.integers(0, max_spec), min_size=1, max_size=max_reqs))
    cu, total = [], 0
    for n in counts:
        total += n
        cu.append(total)
    return counts, cu


# -- oracles (one request at a time, from the kernels' documented behaviour) ------------
def oracle_sample(cu, draft, bonus, width, decide, rows):
    """decide(t, pos) -> (token written, accepted). Rows not in ``rows`` stay -1."""
    out = [[PAD] * (width + 1) for _ in cu]
    start = 0
    for r, end in enumerate(cu):
        if rows[r]:
            for pos in range(end - start):
                token, accepted = decide(start + pos, pos)
                out[r][pos] = token
                if not accepted:
                    break
            else:
                out[r][end - start] = bonus[r]
        start = end
    return out


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=60, deadline=None)
@given(data=st.data(), synthetic=st.booleans(), mixed=st.booleans())
def test_greedy_rejection(form, data, synthetic, mixed):
    width = data.draw(st.integers(1, 4))
    counts, cu = draft_layout(data, width)
    n, batch, vocab = cu[-1], len(cu), 7
    draft = data.draw(st.lists(st.integers(-1, vocab - 1), min_size=n, max_size=n))
    argmax = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    bonus = data.draw(st.lists(st.integers(0, vocab - 1), min_size=batch, max_size=batch))
    greedy = data.draw(st.lists(st.booleans(), min_size=batch, max_size=batch)) if mixed else [True] * batch
    u = data.draw(st.lists(st.floats(0, 1, exclude_max=True), min_size=n, max_size=n))
    rates = data.draw(st.lists(st.sampled_from([0.0, 0.3, 1.0]), min_size=width, max_size=width))
    rates32 = torch.tensor(rates, dtype=torch.float32).tolist()  # what the kernels receive

    def decide(t, pos):
        if synthetic:
            accepted = u[t] < rates32[pos] and draft[t] >= 0
            return (draft[t] if accepted else argmax[t]), accepted
        return argmax[t], draft[t] == argmax[t]

    out = torch.full((batch, width + 1), PAD, dtype=torch.int32)
    with no_host_reads(form == "npu"):
        impl(form, "rejection_greedy_sample")(
            out,
            torch.tensor(cu, dtype=torch.int32),
            torch.tensor(draft, dtype=torch.int32),
            torch.tensor(argmax, dtype=torch.int64),
            torch.tensor(bonus, dtype=torch.int64).view(-1, 1),
            torch.tensor(greedy) if mixed else None,
            width,
            torch.tensor(u, dtype=torch.float64) if synthetic else None,
            torch.tensor(rates, dtype=torch.float32) if synthetic else None,
            synthetic,
        )
    assert out.tolist() == oracle_sample(cu, draft, bonus, width, decide, greedy)


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=60, deadline=None)
@given(data=st.data(), synthetic=st.booleans(), with_draft_probs=st.booleans())
def test_random_rejection(form, data, synthetic, with_draft_probs):
    width = data.draw(st.integers(1, 4))
    counts, cu = draft_layout(data, width)
    n, batch, vocab = cu[-1], len(cu), 6
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    draft = data.draw(st.lists(st.integers(-1, vocab - 1), min_size=n, max_size=n))
    target = torch.rand(n, vocab, generator=gen).softmax(-1)
    q = torch.rand(n, vocab, generator=gen)
    q[torch.rand(n, vocab, generator=gen) < 0.2] = 0.0  # some drafts the drafter gave no mass
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    for t in range(0, n, 2):  # the boundary p/q == u accepts
        if draft[t] >= 0:
            u[t] = float(target[t, draft[t]] / (q[t, draft[t]] if with_draft_probs else 1.0))
    recovered = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    bonus = data.draw(st.lists(st.integers(0, vocab - 1), min_size=batch, max_size=batch))
    greedy = data.draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    rates = [0.5] * width

    def decide(t, pos):
        d = draft[t]
        if d < 0:
            accepted = False
        elif synthetic:
            accepted = float(u[t]) < rates[pos]
        else:
            p = target[t, d]
            qd = q[t, d] if with_draft_probs else torch.tensor(1.0)
            accepted = bool(qd > 0) and float(p / qd) >= float(u[t])
        return (d if accepted else recovered[t]), accepted

    out = torch.full((batch, width + 1), PAD, dtype=torch.int32)
    with no_host_reads(form == "npu"):
        impl(form, "rejection_random_sample")(
            out,
            torch.tensor(cu, dtype=torch.int32),
            torch.tensor(draft, dtype=torch.int32),
            q if with_draft_probs else None,
            target,
            torch.tensor(bonus, dtype=torch.int64).view(-1, 1),
            torch.tensor(recovered, dtype=torch.int32),
            u,
            torch.tensor(greedy),
            width,
            vocab,
            torch.tensor(rates, dtype=torch.float32) if synthetic else None,
            not with_draft_probs,
            synthetic,
        )
    assert out.tolist() == oracle_sample(cu, draft, bonus, width, decide, [not g for g in greedy])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("fp64", [False, True])
@pytest.mark.parametrize("vocab", [5, 9000])  # 9000: more than one Triton tile of 8192
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_recovered_tokens(form, fp64, vocab, with_draft_probs):
    gen = torch.Generator().manual_seed(vocab + fp64)
    counts = [2, 0, 3, 1]
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    n = int(cu[-1])
    draft = torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int32)
    draft[1] = -1  # a padded draft removes nothing
    draft[2] = vocab - 1  # the last token must not be confused with -1
    target = torch.rand(n, vocab, generator=gen).softmax(-1)
    draft_probs = torch.rand(n, vocab, generator=gen).softmax(-1)
    inv_q = 1 / torch.empty(len(counts), vocab, dtype=torch.float64 if fp64 else torch.float32).exponential_(
        generator=gen
    )
    out = torch.full((n,), 12345, dtype=torch.int32)
    with no_host_reads(form == "npu"):
        impl(form, "sample_recovered_tokens")(
            out,
            cu,
            draft,
            draft_probs if with_draft_probs else None,
            target,
            inv_q,
            vocab,
            8192,
            not with_draft_probs,
            fp64,
        )
    expected, t = [], 0
    for r, c in enumerate(counts):
        for _ in range(c):
            best, best_score = 0, None
            for v in range(vocab):
                if with_draft_probs:
                    prob = max(float(target[t, v]) - float(draft_probs[t, v]), 0.0)
                else:
                    prob = 0.0 if v == int(draft[t]) else float(target[t, v])
                score = prob * float(inv_q[r, v])
                if best_score is None or score > best_score:
                    best, best_score = v, score
            expected.append(best)
            t += 1
    assert out.tolist() == expected, expected


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.int32, torch.int64]))
def test_expand(form, data, dtype):
    counts = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
    values = data.draw(st.lists(st.integers(-1, 3), min_size=len(counts), max_size=len(counts)))
    limit = data.draw(st.sampled_from([2, 128]))
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = torch.full((sum(counts),), 99, dtype=dtype)
    with no_host_reads(form == "npu"):
        impl(form, "expand")(out, torch.tensor(values, dtype=dtype), cu, -1, 7, limit)
    expected = []
    for c, v in zip(counts, values):
        expected += [7 if v == -1 else v] * min(c, limit) + [99] * max(c - limit, 0)
    assert out.tolist() == expected, expected


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_step_slot_mapping(form, data):
    block_size, blocks = data.draw(st.sampled_from([1, 4, 16])), 5
    max_model_len = data.draw(st.integers(4, 60))
    batch = data.draw(st.integers(1, 5))
    padded = batch + data.draw(st.integers(0, 3))
    positions = data.draw(st.lists(st.integers(0, max_model_len), min_size=batch, max_size=batch))
    seq_lens = data.draw(st.lists(st.integers(1, max_model_len), min_size=batch, max_size=batch))
    wide = torch.randint(0, 100, (batch + 2, blocks + 3), dtype=torch.int32)
    table = wide[:batch, :blocks]  # a strided view, as the drafter may pass
    out_pos = torch.full((batch,), 555, dtype=torch.int64)
    out_slots = torch.full((padded,), 555, dtype=torch.int64)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    with no_host_reads(form == "npu"):
        impl(form, "eagle_step_slot_mapping_metadata")(
            torch.tensor(positions, dtype=torch.int64),
            table,
            table.stride(0),
            lens,
            out_pos,
            out_slots,
            block_size,
            max_model_len,
            blocks,
            PAD,
            batch,
        )
    exp_pos, exp_slots, exp_lens = [], [], []
    for r in range(batch):
        p = positions[r] + 1
        if p >= max_model_len:
            exp_pos.append(0), exp_slots.append(PAD), exp_lens.append(1)
            continue
        b = min(p // block_size, blocks - 1)
        exp_pos.append(p)
        exp_slots.append(int(wide[r, b]) * block_size + p % block_size)
        exp_lens.append(min(seq_lens[r] + 1, max_model_len))
    assert out_pos.tolist() == exp_pos
    assert out_slots.tolist() == exp_slots + [PAD] * (padded - batch)
    assert lens.tolist() == exp_lens


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_prepare_inputs_padded(form, data):
    counts, cu = draft_layout(data, 3)
    q_lens = [c + 1 for c in counts]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    valid = [data.draw(st.integers(1 if c else 0, c + 1)) for c in counts]
    tok = torch.full((len(cu) + 2,), 7, dtype=torch.int32)
    rej = torch.full((len(cu) + 2,), 7, dtype=torch.int32)
    with no_host_reads(form == "npu"):
        impl(form, "eagle_prepare_inputs_padded")(
            torch.tensor(cu, dtype=torch.int32),
            torch.tensor(valid, dtype=torch.int32),
            torch.tensor(qsl + [qsl[-1]], dtype=torch.int32),
            tok,
            rej,
            len(cu),
        )
    expected_rej = [(c + 1 - v) if c else 0 for c, v in zip(counts, valid)]
    assert rej.tolist() == expected_rej + [7, 7]
    assert tok.tolist() == [qsl[r + 1] - 1 - expected_rej[r] for r in range(len(cu))] + [7, 7]


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_prepare_next_token_padded(form, data):
    batch, width, vocab = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4)), 10
    rows = data.draw(
        st.lists(
            st.lists(st.integers(-1, vocab + 2), min_size=width, max_size=width),
            min_size=batch,
            max_size=batch,
        )
    )
    discard = data.draw(st.lists(st.booleans(), min_size=batch + 1, max_size=batch + 1))
    backup = data.draw(st.lists(st.integers(0, vocab - 1), min_size=batch, max_size=batch))
    sampled = torch.zeros(batch, width + 2, dtype=torch.int32)[:, :width]  # strided rows
    sampled.copy_(torch.tensor(rows, dtype=torch.int32))
    next_ids = torch.full((batch,), 77, dtype=torch.int32)
    counts = torch.full((batch,), 77, dtype=torch.int32)
    with no_host_reads(form == "npu"):
        impl(form, "eagle_prepare_next_token_padded")(
            sampled,
            torch.tensor(discard),
            torch.tensor(backup, dtype=torch.int32),
            next_ids,
            counts,
            vocab,
            width,
            batch,
            sampled.stride(0),
            4,
        )
    exp_next, exp_count = [], []
    for r in range(batch):
        real = [t for t in rows[r] if t != -1 and t < vocab]
        if discard[r]:
            exp_next.append(backup[r]), exp_count.append(0)
        else:
            # the last real token by position (rows may hold -1 between real tokens)
            exp_next.append(real[-1] if real else backup[r]), exp_count.append(len(real))
    assert next_ids.tolist() == exp_next
    assert counts.tolist() == exp_count


def test_overrides_replace_upstream_kernels():
    """Registered under the kernels' real names, with the kernels' own parameter names (so
    upstream's launcher forwards its keyword arguments unchanged)."""
    import inspect

    from vllm.triton_utils.dispatcher import _kernel_arg_names, _resolve_kernel

    for name in sd.KERNELS:
        owner, attr = _resolve_kernel(name)
        names = _kernel_arg_names(getattr(owner, attr))
        for form in FORMS:
            f = getattr(sd, f"{form}_{attr.removesuffix('_kernel')}")
            assert tuple(inspect.signature(f).parameters) == names, (name, form)


def _textbook_rejection(drafts, logits, draft_probs, bonus, greedy, seeds):
    """Speculative sampling as the papers state it, one request at a time, drawing from a
    fresh generator per random request in upstream's order (the request's uniform draws,
    then one exponential per vocabulary entry for the recovery race)."""
    vocab = logits.shape[1]
    out, t = [], 0
    for r, draft in enumerate(drafts):
        row = [PAD] * (max(map(len, drafts)) + 1)
        rows = range(t, t + len(draft))
        if greedy[r]:
            for pos, i in enumerate(rows):
                row[pos] = int(logits[i].argmax())
                if row[pos] != draft[pos]:
                    break
            else:
                row[len(draft)] = bonus[r]
        else:
            gen = torch.Generator().manual_seed(seeds[r])
            u = torch.empty(len(draft), dtype=torch.float64).uniform_(generator=gen) if draft else None
            inv_q = 1 / torch.empty(vocab, dtype=torch.float32).exponential_(generator=gen)
            for pos, i in enumerate(rows):
                p = logits[i].softmax(-1, dtype=torch.float32)
                q = draft_probs[i] if draft_probs is not None else None
                d = draft[pos]
                q_d = q[d] if q is not None else torch.tensor(1.0)
                if q_d > 0 and float(p[d] / q_d) >= float(u[pos]):
                    row[pos] = d
                    continue
                if q is not None:
                    residual = (p - q).clamp(min=0)
                else:
                    residual = p.clone().index_fill_(0, torch.tensor(d), 0)
                row[pos] = int((residual * inv_q).argmax())
                break
            else:
                row[len(draft)] = bonus[r]
        out.append(row)
        t += len(draft)
    return out


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_sample_matches_textbook_reference(form, with_draft_probs):
    """Upstream's ``rejection_sample`` (random draws, recovery race, greedy and random rows
    in one batch) running on these kernels equals speculative sampling written plainly."""
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    register_kernels(
        {
            name: getattr(sd, f"{form}_{name.rsplit('.', 1)[-1].removesuffix('_kernel')}")
            for name in sd.KERNELS
        }
    )
    gen = torch.Generator().manual_seed(11)
    vocab = 12
    drafts = [[3, 1, 4], [], [5, 9], [2], [7, 7, 7]]
    greedy = [False, True, False, True, False]
    seeds = [101, 0, 202, 0, 303]
    n = sum(map(len, drafts))
    logits = torch.randn(n, vocab, generator=gen) * 2
    logits[0, 3] = logits[3, 5] = logits[6, 7] = 6.0  # random requests whose first draft is likely accepted
    draft_probs = torch.rand(n, vocab, generator=gen).softmax(-1) if with_draft_probs else None
    bonus = [11, 10, 9, 8, 6]
    counts = torch.tensor([len(d) for d in drafts], dtype=torch.int32)
    metadata = SamplingMetadata(
        temperature=torch.tensor([0.0 if g else 1.0 for g in greedy]),
        all_greedy=False,
        all_random=False,
        top_p=None,
        top_k=None,
        generators={r: torch.Generator().manual_seed(s) for r, s in enumerate(seeds) if not greedy[r]},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.tensor([]),
        presence_penalties=torch.tensor([]),
        repetition_penalties=torch.tensor([]),
        output_token_ids=[],
        spec_token_ids=[],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )
    out = rs.rejection_sample(
        torch.tensor([t for d in drafts for t in d], dtype=torch.int32),
        counts.tolist(),
        3,
        counts.cumsum(0).to(torch.int32),
        draft_probs,
        logits.clone(),
        torch.tensor(bonus, dtype=torch.int64).view(-1, 1),
        metadata,
    )
    expected = _textbook_rejection(drafts, logits, draft_probs, bonus, greedy, seeds)
    assert out.tolist() == expected, expected
    # Both outcomes happened: some drafts accepted, some rejected with a recovered token.
    assert any(row[0] == d[0] for row, d, g in zip(expected, drafts, greedy) if d and not g)
    assert any(row[i] != d[i] for row, d, g in zip(expected, drafts, greedy) if not g for i in range(len(d)))


def test_mla_verification_rows():
    """Verification requests (1 + k query tokens) take MLA's decode path, one row per query
    token: token i of a request with q_len tokens sees its first seq_len - q_len + i + 1 keys."""
    from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport

    from vllm.ascend.attention.mla import AscendMLAMetadataBuilder, decode_rows

    assert AscendMLAMetadataBuilder.query_len_support == QueryLenSupport.UNIFORM
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    rows, lens = decode_rows(table, [0, 3, 4, 7], [10, 5, 7])
    assert rows.tolist() == [table[0].tolist()] * 3 + [table[1].tolist()] + [table[2].tolist()] * 3
    assert lens == [8, 9, 10, 5, 5, 6, 7]
    same, same_lens = decode_rows(table, [0, 1, 2, 3], [4, 5, 6])  # plain decode: unchanged
    assert same is table and same_lens == [4, 5, 6]
