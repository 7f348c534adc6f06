"""The context-parallel placement rule, the per-step PCP split and the cross-rank
correction, against brute-force models of what they must do (no engine)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.ascend.attention.cp_step import RankLayout, build_step, zigzag_runs
from vllm.ascend.context_parallel.placement import (
    CPLayout,
    LayoutError,
    block_and_offset,
    local_count,
    local_positions,
    owner,
    place,
)
from vllm.ascend.kernels import attention as gqa_kernels
from vllm.ascend.kernels import mla as mla_kernels
from vllm.ascend.kernels.context_parallel import reference_combine_partials


@st.composite
def layouts(draw):
    dcp = draw(st.sampled_from([1, 2, 4]))
    tp = dcp * draw(st.sampled_from([1, 2, 4]))
    pcp = draw(st.sampled_from([1, 2, 3]))
    block_size = draw(st.sampled_from([4, 8, 16]))
    interleave = draw(st.sampled_from([i for i in (1, 2, 4, 8) if block_size % i == 0]))
    if draw(st.booleans()):
        kv_heads = None
    else:  # GQA: TP a multiple of KV heads x DCP, or KV heads a multiple of TP (DCP 1)
        kv_heads = draw(
            st.sampled_from([k for k in (1, 2, 4, 8) if tp % (k * dcp) == 0 or (dcp == 1 and k % tp == 0)])
        )
    return CPLayout(
        tp=tp, pcp=pcp, dcp=dcp, interleave=interleave, block_size=block_size, kv_heads=kv_heads
    ).check()


@settings(max_examples=150, deadline=None)
@given(layouts(), st.integers(1, 200))
def test_every_token_is_stored_once_per_context_parallel_group(layout, seq_len):
    # Brute force: walk every position, record which (rank, block, offset, head) it lands on.
    stored: dict[tuple, int] = {}
    per_rank_positions: dict[int, list[int]] = {}
    for t in range(seq_len):
        p = place(layout, t)
        assert p.cp_rank == p.pcp_rank * layout.dcp + p.dcp_rank
        assert 0 <= p.offset < layout.block_size and p.block_index == t // layout.virtual_block_size
        per_rank_positions.setdefault(p.cp_rank, []).append(t)
        heads_seen = []
        for h in p.holders:
            assert h.pcp_rank == p.pcp_rank and h.tp_rank % layout.dcp == p.dcp_rank
            assert h.rank == h.pcp_rank * layout.tp + h.tp_rank
            heads_seen += list(h.heads)
            for head in h.heads:
                key = (h.rank, p.block_index, p.offset, head)
                assert key not in stored, f"{key} holds both {stored[key]} and {t}"
                stored[key] = t
        # Each KV head is stored once per context-parallel group: groups are the DCP groups
        # of TP ranks, so a head has tp / (dcp x #ranks holding it in one group) replicas.
        total_heads = 1 if layout.mla else layout.kv_heads
        per_head = layout.tp if layout.mla else max(1, layout.tp // layout.kv_heads)
        replicas = per_head // layout.dcp
        assert sorted(heads_seen) == sorted(list(range(total_heads)) * replicas)
        for group_first in range(0, layout.tp, layout.dcp):
            group = [h for h in p.holders if group_first <= h.tp_rank < group_first + layout.dcp]
            in_group = [head for h in group for head in h.heads]
            assert len(in_group) == len(set(in_group)), "a head twice in one CP group"
    for c in range(layout.cp):
        mine = per_rank_positions.get(c, [])
        assert mine == local_positions(seq_len, c, layout.cp, layout.interleave)
        assert len(mine) == local_count(seq_len, c, layout.cp, layout.interleave)
        # Storage order follows position order: local slot index k holds the k-th position.
        slots = [place(layout, t).block_index * layout.block_size + place(layout, t).offset for t in mine]
        assert slots == list(range(len(mine)))


@pytest.mark.parametrize(
    "layout, error",
    [
        (CPLayout(tp=2, dcp=4), "must divide tensor_parallel_size 2"),
        (CPLayout(tp=8, dcp=4, kv_heads=4), "multiple of KV heads 4 x DCP 4"),
        (CPLayout(tp=2, dcp=2, kv_heads=2), "multiple of KV heads 2 x DCP 2"),
        (CPLayout(tp=4, pcp=2, interleave=3, block_size=8), "interleave_size 3 must divide the block size 8"),
        (CPLayout(tp=4, kv_heads=6), "must divide one another"),
        (CPLayout(tp=0), "tp must be at least 1"),
    ],
)
def test_invalid_layouts_name_the_constraint(layout, error):
    with pytest.raises(LayoutError, match=error):
        layout.check()


@pytest.mark.parametrize(
    "layout",
    [
        # the layouts users run (vllm-ascend, prefill -> decode), MLA and GQA with 4 KV heads
        CPLayout(tp=8, pcp=2, dcp=8),
        CPLayout(tp=8, dcp=4, dp=2),
        CPLayout(tp=8, pcp=2, dcp=4),
        CPLayout(tp=4, dcp=2, dp=4),
        CPLayout(tp=8, pcp=2),
        CPLayout(tp=4, dcp=2),
        CPLayout(tp=8, pcp=2, dcp=2, kv_heads=4),
        CPLayout(tp=8, dcp=2, dp=2, kv_heads=4),
        CPLayout(tp=16, dcp=2, kv_heads=4),
    ],
)
def test_the_production_layouts_are_accepted(layout):
    assert layout.check() is layout


@settings(max_examples=60, deadline=None)
@given(layouts(), st.lists(st.integers(1, 40), min_size=1, max_size=4), st.data())
def test_the_runners_slot_mapping_follows_the_placement(layout, q_lens, data):
    """The Ascend runner's block tables (worker/block_tables.py) map each token to the slot
    the placement gives it on the rank that owns it, and to the pad slot elsewhere."""
    from vllm.platforms import current_platform

    from vllm.ascend.worker.block_tables import NPUBlockTables

    current_platform.register_triton_kernel_overrides()  # the staged writes' torch forms (cached)
    max_blocks = 8 + 40 // layout.virtual_block_size
    contexts = [data.draw(st.integers(0, max_blocks * layout.virtual_block_size - q)) for q in q_lens]
    size = len(q_lens) * max_blocks
    table = torch.randperm(size + 5)[:size].view(len(q_lens), max_blocks).to(torch.int32)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(contexts, q_lens)])
    n = int(qsl[-1])
    for cp_rank in range(layout.cp):
        tables = NPUBlockTables(
            block_sizes=[layout.block_size],
            max_num_reqs=len(q_lens),
            max_num_batched_tokens=n + 3,
            max_num_blocks_per_group=[max_blocks],
            device=torch.device("cpu"),
            cp_size=layout.cp,
            cp_rank=cp_rank,
            cp_interleave=layout.interleave,
        )
        for r in range(len(q_lens)):
            tables.append_block_ids(r, (table[r].tolist(),), overwrite=True)
        tables.apply_staged_writes()
        idx = torch.arange(len(q_lens), dtype=torch.int32)
        out = tables.compute_slot_mappings(idx, qsl, positions, n + 3)[0]
        expected = []
        for r, (c, q) in enumerate(zip(contexts, q_lens)):
            for t in range(c, c + q):
                p = place(layout, t)
                expected.append(
                    int(table[r, p.block_index]) * layout.block_size + p.offset
                    if p.cp_rank == cp_rank
                    else -1
                )
        assert out.tolist() == expected + [-1, -1, -1]


def test_the_rule_on_tensors_equals_the_rule_on_ints():
    t = torch.arange(500)
    block, offset = block_and_offset(t, 8, 6, 2)
    assert owner(t, 6, 2).tolist() == [owner(int(x), 6, 2) for x in t]
    assert list(zip(block.tolist(), offset.tolist())) == [block_and_offset(int(x), 8, 6, 2) for x in t]


def test_context_parallel_groups_are_dcp_groups_across_pcp():
    # imported here: vllm.distributed resolves the current platform on import, and this
    # module is collected before the modules that opt the test process into host emulation
    from vllm.ascend.distributed.groups import context_parallel_rank_lists

    # world of 2 replicas (DP or PP) x PCP 2 x TP 4, DCP 2: rank = replica*8 + pcp*4 + tp
    lists = context_parallel_rank_lists(16, tp=4, pcp=2, dcp=2)
    assert lists == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    layout = CPLayout(tp=4, pcp=2, dcp=2)
    for group in lists:  # ordered by context-parallel rank
        ranks = [layout.cp_rank((r % 8) // 4, r % 4) for r in group]
        assert ranks == list(range(layout.cp))


# -- the per-step PCP split ------------------------------------------------------------------
def test_zigzag_pairs_an_early_chunk_with_a_late_one():
    assert [zigzag_runs(16, 2, p) for p in range(2)] == [[(0, 4), (12, 4)], [(4, 8)]]
    assert zigzag_runs(7, 1, 0) == [(0, 7)]
    # equal chunks: every rank's causal attention work (sum of key counts) is the same
    for pcp in (2, 3, 4):
        n = 2 * pcp * 5
        work = [sum(s + i + 1 for s, ln in zigzag_runs(n, pcp, p) for i in range(ln)) for p in range(pcp)]
        assert len(set(work)) == 1, work


@st.composite
def steps(draw):
    num_decodes = draw(st.integers(0, 3))
    num_prefills = draw(st.integers(0 if num_decodes else 1, 3))
    q_lens = [1] * num_decodes + [draw(st.integers(1, 30)) for _ in range(num_prefills)]
    contexts = [draw(st.integers(0, 40)) for _ in q_lens]
    pcp, dcp = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2]))
    interleave = draw(st.sampled_from([1, 2, 4]))
    return q_lens, contexts, num_decodes, pcp, dcp, interleave


@settings(max_examples=150, deadline=None)
@given(steps())
def test_pcp_split_covers_every_token_once_and_restores_the_order(case):
    q_lens, contexts, num_decodes, pcp, dcp, interleave = case
    query_start = torch.tensor([0] + q_lens).cumsum(0).tolist()
    seq_lens = [c + q for c, q in zip(contexts, q_lens)]
    plans = [
        [
            build_step(query_start, seq_lens, num_decodes, RankLayout(pcp, p, dcp, d, interleave))
            for d in range(dcp)
        ]
        for p in range(pcp)
    ]
    n = query_start[-1]
    rows = {s.local_rows for row in plans for s in row}
    assert len(rows) == 1, "every rank runs the same number of rows"
    for p in range(pcp):
        step = plans[p][0]
        assert step.num_decode_tokens == num_decodes
        if pcp == 1:
            assert not step.split
            continue
        # gathered rows in rank order are exactly what each rank runs
        gathered = [t for q in range(pcp) for t in plans[q][0].local_index]
        real = [t for t in step.gather_order if t >= 0]
        assert sorted(real) == list(range(n)), "each token exactly once"
        for row, token in enumerate(step.gather_order):
            if token >= 0:
                assert gathered[row] == token and step.restore[token] == row
        # the query runs are this rank's prefill tokens with their positions
        for seg in step.segments:
            for i in range(seg.length):
                token = step.local_index[seg.row + i]
                r = next(r for r in range(len(q_lens)) if query_start[r] <= token < query_start[r + 1])
                position = seq_lens[r] - q_lens[r] + token - query_start[r]
                assert r == seg.request and position == seg.first_position + i


@settings(max_examples=100, deadline=None)
@given(steps(), st.sampled_from([1, 5, 16, 4096]))
def test_history_gather_puts_every_rank_s_tokens_back_in_position_order(case, chunk):
    q_lens, contexts, num_decodes, pcp, dcp, interleave = case
    query_start = torch.tensor([0] + q_lens).cumsum(0).tolist()
    seq_lens = [c + q for c, q in zip(contexts, q_lens)]
    cp = pcp * dcp
    plans = [
        build_step(
            query_start, seq_lens, num_decodes, RankLayout(pcp, c // dcp, dcp, c % dcp, interleave), chunk
        )
        for c in range(cp)
    ]
    # the same rounds on every rank (they all join each round's gather), each at most ``chunk`` tokens
    rounds = [[rnd.chunks for rnd in step.prefill_plan.rounds] if step.prefill_plan else [] for step in plans]
    assert all(r == rounds[0] for r in rounds)
    covered = {}
    for chunks in rounds[0]:
        assert sum(end - start for _, start, end in chunks) <= chunk
        for r, start, end in chunks:
            covered.setdefault(r, []).extend(range(start, end))
    assert covered == {r: list(range(seq_lens[r])) for r in plans[0].prefill_requests}
    # each rank contributes its tokens' positions per chunk (padded), as gather_round does
    for i, chunks in enumerate(rounds[0]):
        buffers = []
        for c, step in enumerate(plans):
            rnd = step.prefill_plan.rounds[i]
            part = []
            for (_, start, end), (lo, hi), pad in zip(chunks, rnd.extra["local"], rnd.extra["pads"]):
                mine = local_positions(max(seq_lens), c, cp, interleave)[lo:hi]
                assert all(start <= t < end for t in mine)
                part += mine + [-1] * (pad - len(mine))
            buffers.append(part)
        assert len({len(b) for b in buffers}) == 1, "every rank sends the same number of rows"
        gathered = torch.tensor([t for b in buffers for t in b], dtype=torch.int64)
        take = plans[0].prefill_plan.rounds[i].extra["take"]
        assert gathered[take].tolist() == [t for _, start, end in chunks for t in range(start, end)]
    # decode rows: the tokens each rank holds add up to each query's visible keys
    for row in range(plans[0].num_decode_tokens):
        assert sum(step.decode_lens[row] for step in plans) == seq_lens[row]


# -- the cross-rank correction -------------------------------------------------------------
@pytest.mark.parametrize("cp, interleave", [(2, 1), (3, 2), (4, 3)])
def test_partial_decodes_combined_equal_one_decode_over_all_tokens(cp, interleave):
    torch.manual_seed(cp)
    heads, dim, block_size, seq_lens = 4, 16, 4, [1, 5, 13, 30]
    # GQA, one KV head: a full cache, and per rank a cache holding only its positions
    k_full, v_full = torch.randn(40, 1, block_size, dim), torch.randn(40, 1, block_size, dim)
    table = torch.arange(40, dtype=torch.int32).view(4, 10)
    query = torch.randn(len(seq_lens), heads, dim)
    full, _ = gqa_kernels.reference_paged_decode(query, k_full, v_full, table, seq_lens, 0.3)
    outs, lses = [], []
    flat_k = k_full.transpose(1, 2).reshape(4, 10 * block_size, 1, dim)
    flat_v = v_full.transpose(1, 2).reshape(4, 10 * block_size, 1, dim)
    for c in range(cp):
        k_c, v_c = torch.zeros_like(k_full), torch.zeros_like(v_full)
        lens = []
        for b, n in enumerate(seq_lens):
            mine = local_positions(n, c, cp, interleave)
            lens.append(len(mine))
            for k, t in enumerate(mine):
                blk, off = table[b, k // block_size], k % block_size
                k_c[blk, :, off], v_c[blk, :, off] = flat_k[b, t], flat_v[b, t]
        out, lse = gqa_kernels.reference_paged_decode(query, k_c, v_c, table, lens, 0.3)
        outs.append(out)
        lses.append(lse)
    assert lens[0] == 0  # the last rank holds nothing of the 1-token sequence: its lse is -inf
    merged = reference_combine_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(merged, full, rtol=1e-5, atol=1e-5)


def test_mla_decode_lse_is_the_log_of_the_softmax_denominator():
    torch.manual_seed(0)
    latent, rope = torch.randn(6, 4, 1, 32), torch.randn(6, 4, 1, 8)
    q_nope, q_pe = torch.randn(2, 3, 32), torch.randn(2, 3, 8)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    out, lse = mla_kernels.reference_mla_decode(
        q_nope, q_pe, latent, rope, table, [9, 0], 0.2, return_lse=True
    )
    c = latent[:3].reshape(12, 32)[:9]
    pe = rope[:3].reshape(12, 8)[:9]
    scores = (q_nope[0] @ c.t() + q_pe[0] @ pe.t()) * 0.2
    torch.testing.assert_close(lse[0], torch.log(torch.exp(scores).sum(-1)))
    torch.testing.assert_close(out[0], torch.softmax(scores, -1) @ c)
    assert torch.isinf(lse[1]).all() and not out[1].any()  # no keys: weight 0 in the combine
