"""The byte addressing of a P/D pull, executed on real memory in the Ascend KV layout.

Every rank of both instances gets per-layer buffers laid out as the attention backends
lay them out (attention/kv_layout.py: head-major planes; MLA: latent then rope). Prefill
ranks are filled where the placement rule puts each (token, head), with values that
encode (layer, plane, token, head, element); the plan's reads are turned into byte
ranges by ``addressing`` (the code the decode worker runs) and copied with memmove.
Every decode rank must then hold exactly its own placement's values and nothing else.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.ascend.attention.kv_layout import LayerLayout
from vllm.ascend.context_parallel.placement import CPLayout, place
from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.addressing import RankTables, plane_table, read_ranges
from vllm.ascend.kv_transfer.plan import build_plan
from vllm.ascend.kv_transfer.planner import ReplicaPlanner

LAYERS = 2
HEAD, HEAD_V, LORA, ROPE = 4, 3, 6, 2  # elements (int32)


def _value(layer, plane, token, head, element):
    return 1 + layer * 10_000_000 + plane * 1_000_000 + token * 1000 + head * 10 + element


class Rank:
    """One rank's KV cache: a buffer per layer, planes as the backends read them."""

    def __init__(self, layout: CPLayout, tp_rank: int, num_blocks: int):
        self.heads = layout.heads(tp_rank)
        if layout.mla:
            self.layout = LayerLayout.mla(num_blocks, layout.block_size, LORA, ROPE, 4)
            self.widths = (LORA, ROPE)
        else:
            self.layout = LayerLayout.gqa(num_blocks, len(self.heads), layout.block_size, HEAD, HEAD_V, 4)
            self.widths = (HEAD, HEAD_V)
        self.block_size = layout.block_size
        self.buffers = [np.zeros(self.layout.total_bytes // 4, dtype=np.int32) for _ in range(LAYERS)]

    def planes(self, layer: int):
        out, offset = [], 0
        for plane, width in zip(self.layout.planes, self.widths):
            n = self.layout.num_blocks * plane.heads * self.block_size * width
            out.append(
                self.buffers[layer][offset : offset + n].reshape(
                    self.layout.num_blocks, plane.heads, self.block_size, width
                )
            )
            offset += n
        return out

    def mine(self) -> dict:
        return {f"layer.{i}": (buf.ctypes.data, self.layout) for i, buf in enumerate(self.buffers)}

    def regions(self) -> list:
        return [
            wire.LayerRegion(
                name, base, layout.num_blocks, [wire.PlaneSpec(p.heads, p.head_bytes) for p in layout.planes]
            )
            for name, (base, layout) in self.mine().items()
        ]


def _planner(prefill, decode, d_rank: int, tp_rank: int, rank: Rank, src: dict) -> ReplicaPlanner:
    """Decode rank ``d_rank``'s planner of the prefill replica ``src`` (rank in replica ->
    Rank), its plane tables built as the worker builds them at connection."""
    return ReplicaPlanner(
        prefill, decode, d_rank, tp_rank, lambda p: RankTables.build({0: rank.mine()}, src[p].regions())
    )


def _tp_rank(decode: CPLayout, decode_dp: int, d_rank: int) -> int:
    return (d_rank - decode_dp * decode.ranks_per_replica) % decode.tp


def _instance(layout: CPLayout, dp_rank: int, num_blocks: int) -> dict[int, Rank]:
    return {
        dp_rank * layout.ranks_per_replica + layout.rank(p, t): Rank(layout, t, num_blocks)
        for p in range(layout.pcp)
        for t in range(layout.tp)
    }


def _store(ranks: dict, layout: CPLayout, dp_rank: int, block_ids: list[int], tokens: int) -> None:
    for t in range(tokens):
        where = place(layout, t)
        for holder in where.holders:
            rank = ranks[dp_rank * layout.ranks_per_replica + holder.rank]
            for layer in range(LAYERS):
                for plane_index, plane in enumerate(rank.planes(layer)):
                    for h in holder.heads:
                        width = plane.shape[-1]
                        head = 0 if layout.mla else h - holder.heads.start
                        plane[block_ids[where.block_index], head, where.offset] = [
                            _value(layer, plane_index, t, h, e) for e in range(width)
                        ]


CASES = {
    "gqa4 tp1 -> tp4 (head slices of one block)": (
        CPLayout(tp=1, kv_heads=4, block_size=8),
        CPLayout(tp=4, kv_heads=4, block_size=8),
    ),
    "gqa4 tp4 -> tp2, block 8 -> 4": (
        CPLayout(tp=4, kv_heads=4, block_size=8),
        CPLayout(tp=2, kv_heads=4, block_size=4),
    ),
    "gqa2 tp4/dcp2 -> tp1, dp 2 on decode": (
        CPLayout(tp=4, dcp=2, kv_heads=2, block_size=4),
        CPLayout(tp=1, dp=2, kv_heads=2, block_size=8),
    ),
    "mla tp2/pcp2 interleave 2 -> tp2/dcp2": (
        CPLayout(tp=2, pcp=2, interleave=2, block_size=4),
        CPLayout(tp=2, dcp=2, block_size=8),
    ),
    "mla tp1 -> tp1": (CPLayout(tp=1, block_size=4), CPLayout(tp=1, block_size=4)),
    "gqa4 tp2 -> tp2": (CPLayout(tp=2, kv_heads=4, block_size=4), CPLayout(tp=2, kv_heads=4, block_size=4)),
}


@pytest.mark.parametrize("via", ["planner", "read_ranges"])
@pytest.mark.parametrize("name", list(CASES))
def test_pulled_bytes_are_the_decode_placement(name, via):
    """``via``: the worker's planner, over all the prefill ranks a decode rank reads from,
    or one prefill rank at a time."""
    prefill, decode = CASES[name]
    tokens, decode_dp = 45, decode.dp - 1
    n_p, n_d = -(-tokens // prefill.virtual_block_size), -(-tokens // decode.virtual_block_size)
    p_ids = list(range(n_p + 2, 1, -1))[:n_p]  # not 0..n-1, not in order
    d_ids = list(range(3, 3 + n_d))
    src = _instance(prefill, 0, n_p + 3)
    dst = _instance(decode, decode_dp, n_d + 4)
    _store(src, prefill, 0, p_ids, tokens)
    plan = build_plan(prefill, decode, tokens, p_ids, d_ids, 0, decode_dp)
    for d_rank, rank in dst.items():
        ids = plan.read_ids_of(d_rank)
        if via == "planner":
            planner = _planner(prefill, decode, d_rank, _tp_rank(decode, decode_dp, d_rank), rank, src)
            batches = [batch[1:] for batch in planner.ranges(plan)]
        else:
            batches = [
                read_ranges(
                    plan,
                    ids[plan.prefill_rank[ids] == p_rank],
                    *plane_table(rank.mine(), src[p_rank].regions()),
                    src[p_rank].heads.start,
                    rank.heads.start,
                    (prefill.block_size, decode.block_size),
                )
                for p_rank in np.unique(plan.prefill_rank[ids]).tolist()
            ]
        for local, remote, lengths in batches:
            for lo, re, n in zip(local.tolist(), remote.tolist(), lengths.tolist()):
                ctypes.memmove(lo, re, n)
    expected = _instance(decode, decode_dp, n_d + 4)
    _store(expected, decode, decode_dp, d_ids, tokens)
    for d_rank, rank in dst.items():
        for layer in range(LAYERS):
            assert np.array_equal(rank.buffers[layer], expected[d_rank].buffers[layer]), (d_rank, layer)
    assert any(rank.buffers[0].any() for rank in dst.values())


def test_a_different_model_is_named():
    layout = CPLayout(tp=1, kv_heads=2, block_size=4)
    mine, theirs = Rank(layout, 0, 2), Rank(layout, 0, 2)
    renamed = [wire.LayerRegion("other." + r.name, r.base, r.num_blocks, r.planes) for r in theirs.regions()]
    with pytest.raises(RuntimeError, match="no KV layer 'layer.0' like this one: not the same model"):
        plane_table(mine.mine(), renamed)


def test_a_run_never_crosses_from_one_read_into_the_next():
    """Two reads whose slots happen to continue across different blocks stay two ranges."""
    from types import SimpleNamespace

    plan = SimpleNamespace(
        token_start=np.array([0, 4]),
        token_count=np.array([4, 4]),
        src_offsets=np.arange(8),
        dst_offsets=np.arange(8),
        head0=np.array([0, 0]),
        head1=np.array([1, 1]),
        src_block=np.array([0, 5]),
        dst_block=np.array([2, 9]),
        runs_start=np.array([0, 1]),
        runs_count=np.array([1, 1]),
        run_token=np.array([0, 4]),
        run_length=np.array([4, 4]),
    )
    # one plane of one head: block b starts at base + b * 80, a slot is 10 bytes
    local, remote, lengths = read_ranges(plan, [0, 1], [(1000, 80, 80)], [(5000, 80, 80)], 0, 0, (8, 8))
    assert local.tolist() == [5000 + 2 * 80, 5000 + 9 * 80 + 40]
    assert remote.tolist() == [1000, 1000 + 5 * 80 + 40]
    assert lengths.tolist() == [40, 40]


@pytest.mark.parametrize("name", list(CASES))
def test_layer_by_layer_reads_copy_the_same_bytes_as_one_pull(name):
    """Layer-wise transfer reads each prefill rank's layers as they are written, in any
    order: the ranges of all those partial reads are exactly the ranges of one pull."""
    prefill, decode = CASES[name]
    tokens, decode_dp = 45, decode.dp - 1
    n_p, n_d = -(-tokens // prefill.virtual_block_size), -(-tokens // decode.virtual_block_size)
    src = _instance(prefill, 0, n_p + 3)
    dst = _instance(decode, decode_dp, n_d + 4)
    plan = build_plan(prefill, decode, tokens, list(range(n_p)), list(range(1, n_d + 1)), 0, decode_dp)
    every_rank = range(prefill.ranks_per_replica)
    for d_rank, rank in dst.items():
        planner = _planner(prefill, decode, d_rank, _tp_rank(decode, decode_dp, d_rank), rank, src)

        def ranges(layers, whole_blocks, planner=planner):
            out = set()
            for _, local, remote, lengths in planner.ranges(plan, 3, layers, whole_blocks):
                for lo, re, n in zip(local.tolist(), remote.tolist(), lengths.tolist()):
                    out.update((lo + i, re + i) for i in range(0, n, 4))  # int32 elements
            return out

        # whole blocks (LLM-DataDist) where both sides store blocks alike
        for whole_blocks in (False, True) if prefill == decode else (False,):
            whole = ranges(None, whole_blocks)
            by_layer = set()
            for layer in reversed(range(LAYERS)):
                part = ranges({p: {layer} for p in every_rank}, whole_blocks)
                assert not part & by_layer  # no element is read twice
                by_layer |= part
            assert by_layer == whole and whole
        assert set(planner.sources(plan, 3)) <= set(every_rank)


@pytest.mark.parametrize("name", list(CASES))
def test_a_kv_cache_group_with_no_layer_ready_yet_is_skipped(name):
    """Layer-wise, with two KV-cache groups: while only the first group's layers are
    written, a read of the ready layers is the first group's ranges (the other group has
    no rows yet), on every decode rank and however many prefill ranks it reads from."""
    from vllm.ascend.kv_transfer.plan import build_group_plan

    prefill, decode = CASES[name]
    tokens, decode_dp = 45, decode.dp - 1
    n_p, n_d = -(-tokens // prefill.virtual_block_size), -(-tokens // decode.virtual_block_size)
    src = _instance(prefill, 0, n_p + 3)
    dst = _instance(decode, decode_dp, n_d + 4)
    tables = (list(range(1, n_p + 1)), list(range(1, n_d + 1)))
    one = build_plan(prefill, decode, tokens, *tables, 0, decode_dp)
    two = build_group_plan(prefill, decode, tokens, [tables[0]] * 2, [tables[1]] * 2, 0, decode_dp)
    for d_rank, rank in dst.items():
        tp_rank = _tp_rank(decode, decode_dp, d_rank)

        def first_group_only(p, rank=rank):
            ready = RankTables.build({0: rank.mine()}, src[p].regions())
            s, d = ready.src[0], ready.dst[0]
            return RankTables({0: s, 1: s[:0]}, {0: d, 1: d[:0]}, {0: ready.layer_of_row[0], 1: []})

        def as_lists(batches):
            return [(p, *(a.tolist() for a in arrays)) for p, *arrays in batches]

        expected = as_lists(_planner(prefill, decode, d_rank, tp_rank, rank, src).ranges(one))
        waiting = ReplicaPlanner(prefill, decode, d_rank, tp_rank, first_group_only)
        assert as_lists(waiting.ranges(two)) == expected
        assert expected or not one.read_ids_of(d_rank).size


@pytest.mark.parametrize("name", list(CASES))
def test_address_templates_give_every_request_its_own_bytes(name):
    """A whole pull takes its ranges from templates its planner keeps per plan piece:
    requests of one shape but other block ids, aligned to the period or not, still copy
    exactly their own placement, the second request reuses the first one's templates, and
    with a prefix cached here the ranges are those of the reads from there on, one prefill
    rank at a time."""
    from vllm.ascend.kv_transfer.plan import period

    prefill, decode = CASES[name]
    decode_dp, cycle = decode.dp - 1, period(prefill, decode)
    rng = np.random.default_rng(7)
    for tokens in (cycle - 1, 3 * cycle, 3 * cycle + 5):
        n_p, n_d = -(-tokens // prefill.virtual_block_size), -(-tokens // decode.virtual_block_size)
        src = _instance(prefill, 0, n_p + 6)
        dst = _instance(decode, decode_dp, n_d + 6)
        planners = {
            d_rank: _planner(prefill, decode, d_rank, _tp_rank(decode, decode_dp, d_rank), rank, src)
            for d_rank, rank in dst.items()
        }
        kept = []
        for _ in range(2):  # two requests
            p_ids = (rng.permutation(n_p + 5)[:n_p] + 1).tolist()
            d_ids = (rng.permutation(n_d + 5)[:n_d] + 1).tolist()
            for rank in [*src.values(), *dst.values()]:
                for buffer in rank.buffers:
                    buffer[:] = 0
            _store(src, prefill, 0, p_ids, tokens)
            for planner in planners.values():
                plan = planner.plan(tokens, [p_ids], [d_ids], 0, decode_dp)
                for _, local, remote, lengths in planner.ranges(plan):
                    for lo, re, n in zip(local.tolist(), remote.tolist(), lengths.tolist()):
                        ctypes.memmove(lo, re, n)
            # a plan ending inside a period is made of two pieces
            assert len(plan.pieces) == (2 if tokens > cycle and tokens % cycle != 0 else 1)
            assert not hasattr(plan, "no_such_column")
            expected = _instance(decode, decode_dp, n_d + 6)
            _store(expected, decode, decode_dp, d_ids, tokens)
            for d_rank, rank in dst.items():
                for layer in range(LAYERS):
                    assert np.array_equal(rank.buffers[layer], expected[d_rank].buffers[layer]), (
                        tokens,
                        d_rank,
                    )
            kept.append({d: dict(p.kept.items()) for d, p in planners.items()})
        templates = [
            {(d, k): v for d, items in request.items() for k, v in items.items() if k[0] == "template"}
            for request in kept
        ]
        assert templates[0] and templates[1].keys() == templates[0].keys()  # made once, for the first request
        assert all(templates[1][k] is templates[0][k] for k in templates[0])

        def elements(batches):
            return sorted(
                (lo + i, re + i)
                for _, local, remote, lengths in batches
                for lo, re, n in zip(local.tolist(), remote.tolist(), lengths.tolist())
                for i in range(0, n, 4)
            )

        for first_token in (3, cycle, cycle + 1, tokens - 1):
            for d_rank, planner in planners.items():
                with_templates = planner.ranges(plan, first_token)
                ids = plan.read_ids_of(d_rank)
                ids = ids[plan.first_position[ids] >= first_token]
                one_at_a_time = [
                    (
                        p,
                        *read_ranges(
                            plan,
                            ids[plan.prefill_rank[ids] == p],
                            *plane_table(dst[d_rank].mine(), src[p].regions()),
                            src[p].heads.start,
                            dst[d_rank].heads.start,
                            (prefill.block_size, decode.block_size),
                        ),
                    )
                    for p in np.unique(plan.prefill_rank[ids]).tolist()
                ]
                assert elements(with_templates) == elements(one_at_a_time), (tokens, first_token, d_rank)


def _merged_one_by_one(local, remote, lengths):
    """The brute-force oracle: extend the last range while the next one continues it on both sides."""
    out = []
    for lo, re, n in zip(local, remote, lengths):
        if out and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == re:
            out[-1][2] += n
        else:
            out.append([lo, re, n])
    return out


@given(
    st.lists(
        st.lists(st.tuples(st.booleans(), st.booleans(), st.integers(1, 4)), min_size=1, max_size=12),
        min_size=1,
        max_size=5,
    )
)
@settings(max_examples=200, deadline=None)
def test_ranges_of_several_prefill_ranks_merge_within_a_rank_only(parts):
    """Per part (a prefill rank's ranges, one after another in one pass), each range either
    continues the previous one locally and remotely or jumps; a part may start exactly where
    the previous part ended on both sides, and still stays apart."""
    from vllm.ascend.kv_transfer.addressing import _merged, merge_ranges

    local, remote, lengths, bounds = [], [], [], [0]
    lo = re = 0
    for part in parts:
        for jump_local, jump_remote, n in part:
            lo, re = lo + 8 * jump_local, re + 16 * jump_remote
            local.append(lo), remote.append(re), lengths.append(n)
            lo, re = lo + n, re + n
        bounds.append(len(local))
    arrays = [np.array(x, dtype=np.int64) for x in (local, remote, lengths)]
    merged, edges = _merged(*arrays, np.array(bounds))
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        expected = _merged_one_by_one(local[a:b], remote[a:b], lengths[a:b])
        got = [list(r) for r in zip(*(x[edges[i] : edges[i + 1]].tolist() for x in merged))]
        assert got == expected
    assert [list(r) for r in zip(*(x.tolist() for x in merge_ranges(*arrays)))] == _merged_one_by_one(
        local, remote, lengths
    )


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("first_token", [0, 5])
def test_a_windowed_group_reads_nothing_into_the_null_block(name, first_token):
    """Two KV-cache groups, the second a sliding window (its tables name the null block
    before the window): the planner's ranges, made of the kept shapes less their reads into
    the null block, are the ranges of the plan's own reads computed one prefill rank and
    one group at a time, and none lands in the null block of the second group."""
    from vllm.ascend.kv_transfer.plan import NULL_BLOCK

    prefill, decode = CASES[name]
    tokens, decode_dp = 45, decode.dp - 1
    n_p, n_d = -(-tokens // prefill.virtual_block_size), -(-tokens // decode.virtual_block_size)
    src = _instance(prefill, 0, 2 * n_p + 3)
    dst = _instance(decode, decode_dp, 2 * n_d + 4)
    window = max(prefill.virtual_block_size, decode.virtual_block_size)

    def windowed(ids: list[int], size: int, first_kept: int) -> list[int]:
        """The null block for every block whose tokens all lie before ``first_kept``."""
        return [NULL_BLOCK if (b + 1) * size <= first_kept else i for b, i in enumerate(ids)]

    size_p, size_d = prefill.virtual_block_size, decode.virtual_block_size
    d_window = windowed(list(range(n_d + 1, 2 * n_d + 1)), size_d, tokens - window + 1)
    # the prefill side keeps at least every token the decode side keeps
    decode_keeps = d_window.count(NULL_BLOCK) * size_d
    p_tables = [list(range(1, n_p + 1)), windowed(list(range(n_p + 1, 2 * n_p + 1)), size_p, decode_keeps)]
    d_tables = [list(range(1, n_d + 1)), d_window]
    for d_rank, rank in dst.items():
        tp_rank = _tp_rank(decode, decode_dp, d_rank)

        def both_groups(p, rank=rank):  # the same layers stand for both groups' here
            t = RankTables.build({0: rank.mine()}, src[p].regions())
            return RankTables({0: t.src[0], 1: t.src[0]}, {0: t.dst[0], 1: t.dst[0]}, {0: [], 1: []})

        planner = ReplicaPlanner(prefill, decode, d_rank, tp_rank, both_groups)
        plan = planner.plan(tokens, p_tables, d_tables, 0, decode_dp)
        assert any(p.skip_null for p in plan.pieces) and NULL_BLOCK not in plan.dst_block.tolist()
        got = _elements(planner.ranges(plan, first_token))
        ids = plan.read_ids_of(d_rank)
        ids = ids[plan.first_position[ids] >= first_token]
        expected = []
        for g in (0, 1):
            for p in np.unique(plan.prefill_rank[ids]).tolist():
                t = both_groups(p)
                mine = ids[(plan.prefill_rank[ids] == p) & (plan.group[ids] == g)]
                ranges = read_ranges(
                    plan,
                    mine,
                    t.src[g],
                    t.dst[g],
                    src[p].heads.start,
                    rank.heads.start,
                    (prefill.block_size, decode.block_size),
                )
                expected.append((p, *ranges))
        assert got == _elements(expected) and (got or not ids.size)


def _elements(batches) -> list:
    """Every (local, remote) 4-byte element the ranges copy, sorted, with repeats."""
    return sorted(
        (lo + i, re + i)
        for _, local, remote, lengths in batches
        for lo, re, n in zip(local.tolist(), remote.tolist(), lengths.tolist())
        for i in range(0, n, 4)
    )
