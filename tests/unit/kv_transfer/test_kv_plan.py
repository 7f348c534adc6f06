"""The P/D transfer plan, executed on simulated caches (no engine, no network).

Each prefill rank's cache is filled where the placement rule says, with values that
encode (token, head); the plan's runs are copied into empty decode caches the way a
transport would; then every decode rank must hold exactly what its own placement says,
every element written once, read counts and done messages as the plan says.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from vllm.ascend.context_parallel.placement import CPLayout, LayoutError, place
from vllm.ascend.kv_transfer import plan as plan_module
from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.inspector import main as inspect_main
from vllm.ascend.kv_transfer.plan import (
    NULL_BLOCK,
    PlanShapes,
    build_group_plan,
    build_plan,
    period,
    period_plan,
)
from vllm.ascend.kv_transfer.planner import Kept

UNSET = -7  # prefill slots that hold no token of the request


def _encode(token: int, head: int) -> int:
    return token * 1024 + head + 1


def _global_rank(layout: CPLayout, dp_rank: int, rank: int) -> int:
    return dp_rank * layout.ranks_per_replica + rank


def _caches(layout: CPLayout, dp_rank: int, num_blocks: int, fill: int) -> dict[int, np.ndarray]:
    return {
        _global_rank(layout, dp_rank, layout.rank(p, t)): np.full(
            (num_blocks, len(layout.heads(t)), layout.block_size), fill, dtype=np.int64
        )
        for p in range(layout.pcp)
        for t in range(layout.tp)
    }


def simulate(
    prefill: CPLayout,
    decode: CPLayout,
    num_tokens: int,
    seed: int = 0,
    prefill_dp: int = 0,
    decode_dp: int = 0,
    replica_offset: int = 0,
):
    rng = np.random.default_rng(seed)
    n_p = -(-num_tokens // prefill.virtual_block_size)
    n_d = -(-num_tokens // decode.virtual_block_size)
    # block ids as a real allocator hands them out: distinct, any order, not 0..n-1
    prefill_ids = (rng.permutation(n_p + 3)[:n_p] + 1).tolist()
    decode_ids = (rng.permutation(n_d + 3)[:n_d] + 1).tolist()
    src = _caches(prefill, prefill_dp, n_p + 4, UNSET)
    dst = _caches(decode, decode_dp, n_d + 4, 0)
    writes = {rank: np.zeros_like(cache) for rank, cache in dst.items()}
    for t in range(num_tokens):
        where = place(prefill, t)
        for holder in where.holders:
            for h in holder.heads:
                rank = _global_rank(prefill, prefill_dp, holder.rank)
                slot = (prefill_ids[where.block_index], h - holder.heads.start, where.offset)
                src[rank][slot] = _encode(t, h)

    plan = build_plan(
        prefill, decode, num_tokens, prefill_ids, decode_ids, prefill_dp, decode_dp, replica_offset
    )

    served: dict[int, int] = {}
    for read in plan.reads():
        assert read.prefill_rank in src, (
            f"read {read.read_id} names prefill rank {read.prefill_rank}, outside the request's replica"
        )
        assert read.decode_rank in dst, f"read {read.read_id} names decode rank {read.decode_rank}"
        p_heads = prefill.heads(read.prefill_rank % prefill.ranks_per_replica % prefill.tp)
        d_heads = decode.heads(read.decode_rank % decode.ranks_per_replica % decode.tp)
        h0, h1 = read.heads
        assert p_heads.start <= h0 < h1 <= p_heads.stop and d_heads.start <= h0 and h1 <= d_heads.stop
        served[read.prefill_rank] = served.get(read.prefill_rank, 0) + 1
        source = src[read.prefill_rank][read.src_block, h0 - p_heads.start : h1 - p_heads.start]
        target = dst[read.decode_rank][read.dst_block, h0 - d_heads.start : h1 - d_heads.start]
        count = writes[read.decode_rank][read.dst_block, h0 - d_heads.start : h1 - d_heads.start]
        copied = 0
        for _, s, d, n in plan.runs(read.read_id).tolist():  # what a transport copies
            target[:, d : d + n] = source[:, s : s + n]
            count[:, d : d + n] += 1
            copied += n
        assert copied == len(read.positions)

    needed = 0
    for t in range(num_tokens):
        where = place(decode, t)
        for holder in where.holders:
            rank = _global_rank(decode, decode_dp, holder.rank)
            for h in holder.heads:
                slot = (decode_ids[where.block_index], h - holder.heads.start, where.offset)
                assert dst[rank][slot] == _encode(t, h), (t, h, rank, dst[rank][slot])
                assert writes[rank][slot] == 1, (t, h, rank)
                needed += 1
    written = sum(int(w.sum()) for w in writes.values())
    assert written == needed == plan.head_slots_needed(), "a read wrote outside the decode placement"

    replica = set(src)
    assert plan.reads_served == served
    assert set(plan.unread) == replica - set(served)
    # every prefill rank of the replica hears a done message; its read ids are its reads, once each
    messages = plan.done_messages()
    heard: dict[int, list[int]] = {rank: [] for rank in replica}
    senders: dict[int, list[int]] = {rank: [] for rank in replica}
    for m in messages:
        assert m.prefill_rank in replica
        heard[m.prefill_rank] += m.read_ids
        senders[m.prefill_rank].append(m.decode_rank)
        assert all(plan.decode_rank[i] == m.decode_rank for i in m.read_ids)
    for rank in replica:
        assert sorted(heard[rank]) == np.flatnonzero(plan.prefill_rank == rank).tolist()
        assert senders[rank], f"prefill rank {rank} never hears done: its blocks would leak"
        if rank in plan.unread:
            assert senders[rank] == [min(dst)]
    return plan


def _mla(**kw) -> CPLayout:
    return CPLayout(kv_heads=None, **kw)


def _gqa4(**kw) -> CPLayout:
    return CPLayout(kv_heads=4, **kw)


# The layouts the issue names (prefill -> decode), at block size 16 so that a few hundred
# tokens cover several blocks and a partial one.
NAMED = {
    "mla tp8/dp2 -> tp8/dp2": (_mla(tp=8, dp=2, block_size=16), _mla(tp=8, dp=2, block_size=16)),
    "mla tp8/pcp2/dcp8 -> tp8/dcp4/dp2": (
        _mla(tp=8, pcp=2, dcp=8, block_size=16),
        _mla(tp=8, dcp=4, dp=2, block_size=16),
    ),
    "mla tp8/pcp2/dcp4 -> tp4/dcp2/dp4": (
        _mla(tp=8, pcp=2, dcp=4, block_size=16),
        _mla(tp=4, dcp=2, dp=4, block_size=16),
    ),
    "mla tp8/pcp2 -> tp4/dcp2": (_mla(tp=8, pcp=2, block_size=16), _mla(tp=4, dcp=2, block_size=16)),
    "gqa4 tp8/pcp2/dcp2 -> tp8/dcp2/dp2": (
        _gqa4(tp=8, pcp=2, dcp=2, block_size=16),
        _gqa4(tp=8, dcp=2, dp=2, block_size=16),
    ),
    "gqa4 tp16/dcp2 -> tp8/dcp2/dp2": (
        _gqa4(tp=16, dcp=2, block_size=16),
        _gqa4(tp=8, dcp=2, dp=2, block_size=16),
    ),
    "gqa4 tp8 -> tp2 (prefill TP greater)": (_gqa4(tp=8, block_size=16), _gqa4(tp=2, block_size=16)),
    "gqa4 tp4 -> tp4 (equal)": (_gqa4(tp=4, block_size=16), _gqa4(tp=4, block_size=16)),
    "gqa4 tp1 -> tp8 (prefill TP smaller)": (_gqa4(tp=1, block_size=16), _gqa4(tp=8, block_size=16)),
    "mla tp2 -> tp4 (prefill TP smaller)": (_mla(tp=2, block_size=16), _mla(tp=4, block_size=16)),
    "gqa4 tp2/block 16 -> tp4/block 8": (_gqa4(tp=2, block_size=16), _gqa4(tp=4, block_size=8)),
    "mla tp4/block 8 -> tp1/block 32": (_mla(tp=4, block_size=8), _mla(tp=1, block_size=32)),
    "mla pcp2/dcp2 interleave 4 -> dcp4 block 32 interleave 8": (
        _mla(tp=2, pcp=2, dcp=2, interleave=4, block_size=16),
        _mla(tp=4, dcp=4, interleave=8, block_size=32),
    ),
}


@pytest.mark.parametrize("name", list(NAMED))
def test_named_layouts_deliver_exactly_the_decode_placement(name):
    prefill, decode = NAMED[name]
    # within one period, several periods, and several with a partial one after them
    for tokens in (1, 333, 4 * period(prefill, decode), 3 * period(prefill, decode) + 5):
        simulate(prefill, decode, tokens, prefill_dp=prefill.dp - 1, decode_dp=decode.dp - 1)


def test_replicas_share_the_reads():
    # MLA TP8 -> TP8: eight replicas, eight readers: each prefill rank is read by one decode rank
    plan = simulate(*NAMED["mla tp8/dp2 -> tp8/dp2"], 200)
    assert plan.unread == [] and len(set(plan.reads_served.values())) == 1
    # TP8 (one DCP group of 8 MLA replicas) -> DCP2: eight readers still use eight replicas
    plan = simulate(_mla(tp=8, block_size=16), _mla(tp=8, dcp=2, block_size=16), 200)
    assert plan.unread == []
    # the rotation moves the load to other replicas (e.g. from one request to the next)
    prefill, decode = NAMED["mla tp8/pcp2 -> tp4/dcp2"]
    first = simulate(prefill, decode, 200)
    rotated = simulate(prefill, decode, 200, replica_offset=3)
    assert set(first.reads_served) != set(rotated.reads_served)


def test_a_request_on_another_dp_replica_is_read_there():
    prefill, decode = _mla(tp=2, dp=3, block_size=4), _mla(tp=2, dp=2, block_size=4)
    plan = simulate(prefill, decode, 50, prefill_dp=2, decode_dp=1)
    assert set(plan.decode_rank.tolist()) == {2, 3} and set(plan.prefill_rank.tolist()) == {4, 5}


@pytest.mark.parametrize(
    "prefill, decode, tokens, blocks, message",
    [
        (_gqa4(tp=8), _gqa4(tp=4, dcp=4), 10, (1, 1), "decode layout: decode_context_parallel_size 4 needs"),
        (
            _gqa4(tp=3),
            _gqa4(tp=4),
            10,
            (1, 1),
            "prefill layout: tensor_parallel_size 3 and the model's 4 KV heads",
        ),
        (_mla(tp=4, dcp=3), _mla(tp=4), 10, (1, 1), "must divide tensor_parallel_size"),
        (
            _mla(block_size=16, interleave=32),
            _mla(),
            10,
            (1, 1),
            "interleave_size 32 must divide the block size",
        ),
        (_mla(), _gqa4(), 10, (1, 1), "same model: prefill has MLA, decode 4 KV heads"),
        (_mla(block_size=4), _mla(block_size=4), 10, (2, 3), "10 tokens need 3 prefill blocks"),
    ],
)
def test_unsupported_combinations_fail_with_one_line(prefill, decode, tokens, blocks, message):
    for _ in range(2):  # a refused pair is not remembered as checked
        with pytest.raises(LayoutError) as caught:
            build_plan(prefill, decode, tokens, list(range(blocks[0])), list(range(blocks[1])))
        assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_dp_rank_outside_the_layout_is_refused():
    with pytest.raises(LayoutError, match="dp_rank 2 is outside data_parallel_size 2"):
        build_plan(_mla(dp=2), _mla(), 0, [], [], prefill_dp_rank=2)


# -- random layouts -------------------------------------------------------------------
def plainly_valid(layout: CPLayout) -> bool:
    """The oracle for what can be built, stated from what the layout means."""
    if layout.tp % layout.dcp or layout.block_size % layout.interleave:
        return False  # DCP ranks are TP ranks; a rank's interleave runs fill whole blocks
    kv = layout.kv_heads
    if kv is None:
        return True
    if kv % layout.tp and layout.tp % kv:
        return False  # heads are split evenly, or each head is replicated evenly
    # a DCP group shards tokens over ranks that must hold the same heads
    head_of = [
        set(range(r * kv // layout.tp, max(r * kv // layout.tp + 1, (r + 1) * kv // layout.tp)))
        for r in range(layout.tp)
    ]
    return all(head_of[r] == head_of[r - r % layout.dcp] for r in range(layout.tp)) or layout.dcp == 1


@st.composite
def raw_layout(draw, kv_heads):
    """Any layout; four times in five one that is meant to be buildable."""
    tidy = draw(st.integers(0, 4)) > 0
    tps = [1, 2, 3, 4, 6, 8, 16]
    if tidy and kv_heads is not None:
        tps = [t for t in tps if t % kv_heads == 0 or kv_heads % t == 0]
    tp, block_size = draw(st.sampled_from(tps)), draw(st.sampled_from([1, 2, 4, 8, 16]))
    dcps, interleaves = [1, 1, 2, 3, 4, 8], [1, 2, 4, 8]
    if tidy:
        dcps = [d for d in dcps if tp % d == 0 and (d == 1 or kv_heads is None or tp % (kv_heads * d) == 0)]
        interleaves = [i for i in interleaves if block_size % i == 0]
    return CPLayout(
        tp=tp,
        pcp=draw(st.sampled_from([1, 2, 3])),
        dcp=draw(st.sampled_from(dcps)),
        dp=draw(st.sampled_from([1, 2])),
        interleave=draw(st.sampled_from(interleaves)),
        block_size=block_size,
        kv_heads=kv_heads,
    )


@st.composite
def layout_pairs(draw):
    kv = draw(st.sampled_from([None, None, 1, 2, 3, 4, 8]))
    prefill = draw(raw_layout(kv))
    decode = draw(raw_layout(kv if draw(st.integers(0, 19)) else draw(st.sampled_from([None, 2, 4]))))
    return prefill, decode


@settings(max_examples=400, deadline=None)
@given(layout_pairs(), st.integers(0, 120), st.integers(0, 3), st.data())
def test_random_layouts_are_planned_exactly_or_refused(pair, tokens, offset, data):
    prefill, decode = pair
    buildable = plainly_valid(prefill) and plainly_valid(decode) and prefill.kv_heads == decode.kv_heads
    event("refused" if not buildable else "planned")
    if not buildable:
        with pytest.raises(LayoutError):
            build_plan(prefill, decode, tokens, list(range(tokens + 1)), list(range(tokens + 1)))
        return
    prefill_dp = data.draw(st.integers(0, prefill.dp - 1))
    decode_dp = data.draw(st.integers(0, decode.dp - 1))
    plan = simulate(
        prefill,
        decode,
        tokens,
        seed=tokens,
        prefill_dp=prefill_dp,
        decode_dp=decode_dp,
        replica_offset=offset,
    )
    # replicas of the same prefill data are read by decode-reader counts that differ by at most one
    readers: dict[tuple[int, int], set] = {}
    for i in range(len(plan)):
        key = (int(plan.prefill_rank[i]), int(plan.head0[i]))
        readers.setdefault(key, set()).add(int(plan.decode_rank[i]))
    for pcp_rank in range(prefill.pcp):
        for dcp_rank in range(prefill.dcp):
            for head in range(prefill.kv_heads or 1):
                holders = [
                    _global_rank(prefill, prefill_dp, prefill.rank(pcp_rank, t))
                    for t in range(dcp_rank, prefill.tp, prefill.dcp)
                    if head in prefill.heads(t)
                ]
                counts = [len(readers.get((r, head), ())) for r in holders]
                if any(counts):
                    assert max(counts) - min(counts) <= 1, (pcp_rank, dcp_rank, head, counts)


def _reads(plan) -> list[tuple]:
    """A plan's reads with their tokens and runs, in a canonical order (read ids aside)."""
    rows = []
    for read in plan.reads():
        rows.append(
            (
                read.decode_rank,
                read.prefill_rank,
                read.src_block,
                read.dst_block,
                read.heads,
                tuple(read.positions.tolist()),
                tuple(read.src_offsets.tolist()),
                tuple(read.dst_offsets.tolist()),
                tuple(map(tuple, plan.runs(read.read_id).tolist())),
            )
        )
    return sorted(rows)


@settings(max_examples=150, deadline=None)
@given(layout_pairs(), st.integers(1, 6), st.integers(0, 200), st.integers(0, 70))
# a last partial period whose one token only decode CP rank 0 wants: its readers of the
# replicas must still be counted as in a full period
@example((_mla(tp=8, block_size=16), _mla(tp=4, dcp=2, block_size=16)), 1, 1, 0)
def test_a_plan_made_of_periods_equals_the_plan_made_token_by_token(pair, periods, extra, offset):
    prefill, decode = pair
    if not (plainly_valid(prefill) and plainly_valid(decode) and prefill.kv_heads == decode.kv_heads):
        return
    tokens = periods * period(prefill, decode) + extra
    p_ids = (np.arange(tokens) * 3 + 1).tolist()  # ids unlike the indices
    d_ids = (np.arange(tokens) * 5 + 2).tolist()
    plan = build_plan(prefill, decode, tokens, p_ids, d_ids, replica_offset=offset)
    direct = period_plan(prefill, decode, 0, 0, offset, tokens)
    assert plan.num_tokens == tokens and plan.run_count() == direct.run_count()
    expected = [(r[0], r[1], p_ids[r[2]], d_ids[r[3]], *r[4:]) for r in _reads(direct)]
    assert _reads(plan) == sorted(expected)


def test_plans_of_one_shape_share_their_period_and_keep_their_block_ids(monkeypatch):
    prefill, decode = NAMED["mla tp8/pcp2 -> tp4/dcp2"]
    tokens = 5 * period(prefill, decode) + 7
    blocks = -(-tokens // 16)
    planned = []  # the periods worked out token by token
    monkeypatch.setattr(
        plan_module, "period_plan", lambda *args, **kw: planned.append(args) or period_plan(*args, **kw)
    )
    kept = Kept(2**30)
    shapes = PlanShapes(prefill, decode, keep=kept.get)
    first = shapes.plan(tokens, list(range(blocks)), list(range(blocks)))
    again = shapes.plan(tokens, list(range(100, 100 + blocks)), list(range(blocks)))
    assert len(planned) == 2  # the full and the partial period, planned once
    assert kept.made == 3  # and the five whole periods, made of the full one once
    # another replica of equal layouts (new objects, as a peer's handshake is decoded) has
    # its own planner, and the same plans
    rebuilt = PlanShapes(dataclasses.replace(prefill), dataclasses.replace(decode)).plan(
        tokens, list(range(blocks)), list(range(blocks))
    )
    assert (again.src_block == first.src_block + 100).all() and (again.dst_block == first.dst_block).all()
    assert _reads(rebuilt) == _reads(first)
    with pytest.raises(ValueError, match="read-only"):
        first.pieces[0].shape.src_block[0] = 1
    with pytest.raises(ValueError, match="read-only"):
        first.src_block[0] = 1  # a request's plan is frozen too


def test_kept_plans_are_bounded_and_a_dropped_one_is_made_again():
    prefill, decode = NAMED["mla tp8/pcp2 -> tp4/dcp2"]
    cycle = period(prefill, decode)
    full = period_plan(prefill, decode, 0, 0, 0, cycle)
    budget = 3 * (full.read_rows.nbytes + full.token_rows.nbytes + full.run_rows.nbytes)
    kept = Kept(budget)
    shapes = PlanShapes(prefill, decode, keep=kept.get)
    lengths = [cycle * k + extra for k in (1, 2, 3) for extra in (0, 5, 9)] * 2
    for tokens in lengths:
        blocks = -(-tokens // 16)
        ids = (np.arange(blocks) * 7 + 3).tolist()
        plan = shapes.plan(tokens, ids, ids)
        direct = period_plan(prefill, decode, 0, 0, 0, tokens)
        assert _reads(plan) == sorted((r[0], r[1], ids[r[2]], ids[r[3]], *r[4:]) for r in _reads(direct))
        assert kept.nbytes <= budget or len(kept) == 1
    assert kept.made > len(kept)  # some were dropped, and made again when asked for


# -- wire types -----------------------------------------------------------------------
def test_wire_messages_carry_the_plan():
    prefill, decode = NAMED["gqa4 tp8/pcp2/dcp2 -> tp8/dcp2/dp2"]
    plan = build_plan(prefill, decode, 300, list(range(10, 20)), list(range(40, 60)), decode_dp_rank=1)
    failed = frozenset({int(plan.read_ids_of(8)[0])})
    done = [
        wire.decode_message(wire.encode_message(m))
        for m in wire.done_messages(plan, "req-1", "reader", failed)
    ]
    assert sorted(i for m in done for i in m.read_ids) == list(range(len(plan)))
    assert [m.ok for m in done].count(False) == 1


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"\x00\x01garbage", "not a control message"),
        (wire.msgspec.msgpack.encode({"type": "blocks_ready"}), "not a control message"),
        (
            wire.msgspec.msgpack.encode({"type": "free_everything", "v": 1}),
            "unknown message type 'free_everything'",
        ),
        (
            wire.msgspec.msgpack.encode(
                {
                    "type": "done_reading",
                    "v": wire.WIRE_VERSION + 1,
                    "request_id": "r",
                    "decode_rank": 0,
                    "prefill_rank": 0,
                    "read_ids": [],
                }
            ),
            f"wire version {wire.WIRE_VERSION + 1}, this build speaks {wire.WIRE_VERSION}",
        ),
        (
            wire.msgspec.msgpack.encode(
                {
                    "type": "done_reading",
                    "v": wire.WIRE_VERSION,
                    "request_id": "r",
                    "decode_rank": -1,
                    "prefill_rank": 0,
                    "read_ids": [],
                }
            ),
            "malformed done_reading",
        ),
        (
            wire.msgspec.msgpack.encode(
                {
                    "type": "done_reading",
                    "v": wire.WIRE_VERSION,
                    "request_id": "x" * 300,
                    "decode_rank": 0,
                    "prefill_rank": 0,
                    "read_ids": [],
                }
            ),
            "malformed done_reading",
        ),
        (
            wire.msgspec.msgpack.encode(
                {
                    "type": "done_reading",
                    "v": wire.WIRE_VERSION,
                    "request_id": "r",
                    "decode_rank": 0,
                    "prefill_rank": 0,
                    "read_ids": [],
                    "free_all": True,
                }
            ),
            "malformed done_reading",
        ),
        (
            wire.msgspec.msgpack.encode(
                {
                    "type": "done_reading",
                    "v": wire.WIRE_VERSION,
                    "request_id": "r",
                    "decode_rank": 0,
                    "prefill_rank": 0,
                    "read_ids": list(range(wire.MAX_READS + 1)),
                }
            ),
            "malformed done_reading",
        ),
        (b"\x00" * (wire.MAX_MESSAGE_BYTES + 1), "over the"),
    ],
)
def test_bad_messages_are_refused_with_the_reason(data, problem):
    with pytest.raises(wire.WireError, match=problem):
        wire.decode_message(data)


def test_an_oversized_message_is_not_sent(monkeypatch):
    message = wire.DoneReading(wire.WIRE_VERSION, "r", "reader", 0, 0, list(range(64)))
    assert len(wire.encode_message(message)) > 100
    monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", 100)
    with pytest.raises(wire.WireError, match="over the 100-byte limit: split"):
        wire.encode_message(message)


# -- the inspector --------------------------------------------------------------------
def _spec(layout: CPLayout) -> str:
    return ",".join(f"{k}={getattr(layout, k)}" for k in ("tp", "pcp", "dcp", "dp", "interleave"))


@pytest.mark.parametrize("name", list(NAMED))
def test_the_inspector_json_is_the_plan(name, capsys):
    prefill, decode = NAMED[name]
    kv = ["--mla"] if prefill.kv_heads is None else ["--kv-heads", str(prefill.kv_heads)]
    assert (
        inspect_main(
            [
                "--prefill",
                _spec(prefill),
                "--decode",
                _spec(decode),
                *kv,
                "--block-size",
                str(prefill.block_size),
                "--decode-block-size",
                str(decode.block_size),
                "--tokens",
                "300",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    plan = build_plan(
        prefill,
        decode,
        300,
        range(-(-300 // prefill.virtual_block_size)),
        range(-(-300 // decode.virtual_block_size)),
    )
    assert [
        (r["decode_rank"], r["prefill_rank"], r["src_block"], r["dst_block"], tuple(r["heads"]))
        for r in data["reads"]
    ] == [(r.decode_rank, r.prefill_rank, r.src_block, r.dst_block, r.heads) for r in plan.reads()]
    assert sum(r["tokens"] for r in data["reads"]) == int(plan.token_count.sum())
    served = {p["rank"]: p["reads_served"] for p in data["prefill_ranks"] if p["reads_served"]}
    assert served == plan.reads_served
    assert data["unread"] == plan.unread
    assert sum(d["tokens"] for d in data["decode_ranks"]) == 300 * decode.tp // decode.dcp
    assert data["transfer"]["head_slots_needed"] == plan.head_slots_needed()


def test_the_inspector_prints_a_table_and_one_line_errors():
    # the example, through the module entry point users type
    cmd = [
        sys.executable,
        "-m",
        "vllm.ascend.kv_transfer.inspector",
        "--prefill",
        "tp=8,pcp=2,dcp=8",
        "--decode",
        "tp=8,dcp=4,dp=2",
        "--mla",
        "--block-size",
        "128",
        "--tokens",
        "4096",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()]
    decode_rows = [r for r in rows if len(r) > 7 and r[4] == "latent" and r[6] == "32"]
    assert [int(r[0]) for r in decode_rows] == list(range(8))  # eight decode ranks, 32 reads each
    assert "unread prefill ranks: none" in out.stdout
    bad = subprocess.run(cmd[:6] + ["tp=4,dcp=3"] + cmd[7:], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "decode layout: decode_context_parallel_size 3 must divide tensor_parallel_size 4" in bad.stderr
    # the command's old home says where it went
    old = subprocess.run(
        [sys.executable, "-m", "vllm.ascend.kv_transfer.plan"], capture_output=True, text=True, timeout=120
    )
    assert old.returncode == 1 and "python -m vllm.ascend.kv_transfer.inspector" in old.stderr


# -- KV-cache groups (hybrid manager) ---------------------------------------------------
def _windowed_table(ids: list[int], tokens: int, window: int, block_size: int, next_token: int) -> list[int]:
    """A sliding-window group's block table as upstream's manager keeps it: the null block for
    every block whose tokens all lie before the window of ``next_token``."""
    first_kept = max(0, next_token - window + 1)
    return [NULL_BLOCK if (b + 1) * block_size <= first_kept else i for b, i in enumerate(ids)]


@pytest.mark.parametrize("tokens", [31, 39, 40, 9])
def test_group_plan_moves_each_group_by_its_own_table(tokens):
    """A full-attention group and a windowed one (W=24, 8-token blocks): every token the
    decode side keeps arrives in its own group's block; nothing lands in a null block; read
    ids run over both groups. The prefill side computed ``tokens`` tokens (its next token is
    ``tokens``), the decode side computes token ``tokens`` itself: both keep one window."""
    prefill, decode = _gqa4(tp=2, block_size=8), _gqa4(tp=4, block_size=8)
    blocks = -(-tokens // 8)
    p_ids = [list(range(10, 10 + blocks)), list(range(30 + blocks, 30, -1))]
    d_ids = [list(range(50, 50 + blocks)), list(range(70, 70 + blocks))]
    p_tables = [p_ids[0], _windowed_table(p_ids[1], tokens, 24, 8, tokens)]
    d_tables = [d_ids[0], _windowed_table(d_ids[1], tokens, 24, 8, tokens)]
    plan = build_group_plan(prefill, decode, tokens, p_tables, d_tables)

    assert np.array_equal(np.unique(plan.group), [0, 1] if any(d_tables[1]) else [0])
    assert not np.isin(plan.dst_block, [NULL_BLOCK]).any() and not np.isin(plan.src_block, [NULL_BLOCK]).any()
    moved: dict[tuple[int, int], set] = {}  # (group, decode block) -> positions
    for read in plan.reads():
        g = int(plan.group[read.read_id])
        # a read stays inside its group's tables
        assert read.src_block in p_tables[g] and read.dst_block in d_tables[g]
        for pos, s, d in zip(read.positions, read.src_offsets, read.dst_offsets):
            assert p_tables[g][pos // 8] == read.src_block and s == pos % 8
            assert d_tables[g][pos // 8] == read.dst_block and d == pos % 8
            moved.setdefault((g, read.dst_block), set()).add(int(pos))
    for g in (0, 1):
        kept = [t for t in range(tokens) if d_tables[g][t // 8] != NULL_BLOCK]
        got = sorted(t for (group, _), ts in moved.items() if group == g for t in ts)
        assert got == kept  # each token once (per decode rank it is a set over ranks)
    ids = sorted(i for m in plan.done_messages() for i in m.read_ids)
    assert ids == list(range(len(plan)))


def test_a_token_the_decode_side_keeps_but_prefill_freed_is_refused():
    layout = _gqa4(tp=1, block_size=8)
    full = list(range(1, 5))
    with pytest.raises(LayoutError, match="group 1: the prefill instance kept no block for token 0"):
        build_group_plan(layout, layout, 32, [full, [NULL_BLOCK, 2, 3, 4]], [full, [5, 6, 7, 8]])
    with pytest.raises(LayoutError, match="block tables for 1 KV-cache groups, this instance has 2"):
        build_group_plan(layout, layout, 32, [full], [full, full])


def test_a_plan_of_periods_has_its_group_column():
    """A plan of whole periods plus a partial one has its group column like any other.
    (Once a plan worked its columns out when one was first read, and ``group``, which has
    a default, answered None when read first: it failed a clean-clone CI run, all six cases
    of test_kv_addressing's KV-cache-group test. Plans are frozen and whole now.)"""
    layout = CPLayout(tp=1, block_size=16)
    tokens = 2 * 16 + 13  # two whole periods and a partial one
    plan = build_plan(layout, layout, tokens, list(range(1, 4)), list(range(1, 4)))
    assert len(plan.pieces) == 2  # the case under test
    group = plan.group
    assert isinstance(group, np.ndarray) and group.tolist() == [0] * len(plan)
    # and its reads are those of the same plan worked out token by token
    direct = period_plan(layout, layout, 0, 0, 0, tokens)
    assert sorted(r.positions.tolist() for r in direct.reads()) == sorted(
        r.positions.tolist() for r in plan.reads()
    )
