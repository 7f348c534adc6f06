"""P/D KV transfer plan (pure, no I/O): which prefill rank each decode rank reads.

Both instances store a request's KV by ``vllm.ascend.context_parallel.placement``; the
plan is worked out from the two placements, so it follows what the runners store.

For every decode rank, every token it holds and every KV head it holds, the plan names
one prefill rank that holds the same (token, head), and where: source block and slot,
destination block and slot. Tokens that travel between the same pair of blocks for the
same head range form one *read*; a read's tokens come as *runs* of slots contiguous on
both sides (first position, source slot, destination slot, length), which is what a
transport copies.

Replicas: where the prefill side holds a head on several ranks (MLA on every TP rank of
a DCP group, GQA heads when TP > KV heads), the decode ranks that want the same tokens
and heads are spread over those replicas in rank order (``replica_offset`` rotates the
choice, e.g. per request). Every prefill rank of the request's DP replica holds blocks
of it: ranks no read touches are ``unread``, and the first decode rank sends them the
done message so they free their blocks.

KV-cache groups (upstream's hybrid manager: e.g. sliding-window and full-attention layers
in separate groups, each with its own block table): ``build_group_plan`` plans every group
from its own tables and joins the plans, so read ids stay unique per request; a read's
``group`` says which layers it is for. A sliding-window group's table names vLLM's null
block where the group keeps no block (before the window); such tokens are not read.

Plans are reused: a request's plan depends on its block tables only through the block
ids, and on its length through whole *periods* of ``lcm`` of both sides' virtual block
sizes (the placement repeats every period). So the plan of one period, and of a partial
last period, is worked out once per layout pair (cached, block-table indices instead of
block ids) and a request's plan is those copied period after period with its block ids
put in: no per-request sort, and the work per request grows with its blocks, not with
planning.

Run ``python -m vllm.ascend.kv_transfer.inspector --help`` to inspect a plan (docs/pd_plan.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from vllm.ascend.context_parallel.placement import CPLayout, LayoutError, block_and_offset, owner

# vLLM's block pool reserves block 0 as its null block: a block table names it where a
# KV-cache group keeps no block for the request (tokens before a sliding window)
NULL_BLOCK = 0


@dataclass(frozen=True)
class Read:
    """One read: tokens of one prefill block (one head range) into one decode block."""

    read_id: int
    decode_rank: int  # global rank of the decode instance (dp_rank x ranks_per_replica + rank)
    prefill_rank: int  # global rank of the prefill instance
    src_block: int  # prefill block id
    dst_block: int  # decode block id
    heads: tuple[int, int]  # global KV heads [h0, h1); MLA: (0, 1)
    positions: np.ndarray  # token positions, ascending
    src_offsets: np.ndarray  # each token's slot in the source block
    dst_offsets: np.ndarray  # each token's slot in the destination block


@dataclass(frozen=True)
class DoneMessage:
    """Sent by a decode rank to a prefill rank once its reads there are over (or failed)."""

    decode_rank: int
    prefill_rank: int
    read_ids: tuple[int, ...]  # empty: the prefill rank is unread and may free at once


@dataclass
class Plan:
    """The reads as columns, one row per read (row index = read id); a read's tokens are
    rows ``token_start .. token_start + token_count`` of the token columns, and its runs
    (slots contiguous on both sides) rows ``runs_start .. runs_start + runs_count`` of the
    run columns (``run_token``: a run's first token row; ``run_length``: its tokens)."""

    prefill: CPLayout
    decode: CPLayout
    num_tokens: int
    prefill_dp_rank: int
    decode_dp_rank: int
    replica_offset: int
    decode_rank: np.ndarray
    prefill_rank: np.ndarray
    src_block: np.ndarray
    dst_block: np.ndarray
    head0: np.ndarray
    head1: np.ndarray
    token_start: np.ndarray
    token_count: np.ndarray
    positions: np.ndarray
    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    runs_start: np.ndarray
    runs_count: np.ndarray
    run_token: np.ndarray
    run_length: np.ndarray
    group: np.ndarray | None = None  # per read: its KV-cache group (None: all group 0)
    # which decode CP ranks read which prefill CP rank's tokens (decode.cp x prefill.cp
    # booleans): it orders the readers of replicas, so a partial period is planned with
    # the full period's
    need: bytes = b""
    num_groups: int = 1  # KV-cache groups planned (``group`` runs below it)

    def __post_init__(self) -> None:
        if self.group is None:
            self.group = np.zeros(len(self), dtype=np.int64)

    def __len__(self) -> int:
        return int(self.decode_rank.shape[0])

    def with_columns(self, **columns) -> Plan:
        """This plan with these fields replaced (``dataclasses.replace`` without the
        per-field checks: a request's plan is made of a cached one on every pull)."""
        plan = object.__new__(Plan)
        plan.__dict__.update(self.__dict__)
        for name in _CACHED_PROPERTIES:  # worked out from the old columns
            plan.__dict__.pop(name, None)
        plan.__dict__.update(columns)
        return plan

    def subset(self, rows: np.ndarray) -> Plan:
        """The plan of the reads ``rows`` (a boolean mask or ascending indices), renumbered
        from 0; token columns are shared, not copied."""
        rows = np.flatnonzero(rows) if rows.dtype == bool else np.asarray(rows, dtype=np.int64)
        columns = {
            name: getattr(self, name)[rows]
            for name in (
                "decode_rank",
                "prefill_rank",
                "src_block",
                "dst_block",
                "head0",
                "head1",
                "token_start",
                "token_count",
                "runs_start",
                "runs_count",
                "group",
            )
        }
        return self.with_columns(**columns)

    @property
    def prefill_ranks(self) -> range:
        """Global ranks of the prefill replica that holds the request."""
        base = self.prefill_dp_rank * self.prefill.ranks_per_replica
        return range(base, base + self.prefill.ranks_per_replica)

    @property
    def decode_ranks(self) -> range:
        base = self.decode_dp_rank * self.decode.ranks_per_replica
        return range(base, base + self.decode.ranks_per_replica)

    @cached_property
    def reads_served(self) -> dict[int, int]:
        """Prefill rank -> reads it serves (it frees the request's blocks after the last)."""
        ranks, served = np.unique(self.prefill_rank, return_counts=True)
        return dict(zip(ranks.tolist(), served.tolist()))

    @cached_property
    def unread(self) -> list[int]:
        """Prefill ranks of the request's replica that no read touches."""
        return [r for r in self.prefill_ranks if r not in self.reads_served]

    def read(self, i: int) -> Read:
        s, n = int(self.token_start[i]), int(self.token_count[i])
        return Read(
            i,
            int(self.decode_rank[i]),
            int(self.prefill_rank[i]),
            int(self.src_block[i]),
            int(self.dst_block[i]),
            (int(self.head0[i]), int(self.head1[i])),
            self.positions[s : s + n],
            self.src_offsets[s : s + n],
            self.dst_offsets[s : s + n],
        )

    def reads(self):
        return (self.read(i) for i in range(len(self)))

    def read_ids_of(self, decode_rank: int) -> np.ndarray:
        """The reads one decode rank makes."""
        return np.flatnonzero(self.decode_rank == decode_rank)

    @property
    def first_position(self) -> np.ndarray:
        """Per read: the position of its first token."""
        return self.positions[self.token_start]

    def runs(self, i: int) -> np.ndarray:
        """Read ``i``'s tokens as runs that are contiguous on both sides: rows (first token's
        position, src slot, dst slot, length)."""
        s, n = int(self.runs_start[i]), int(self.runs_count[i])
        first = self.run_token[s : s + n]
        return np.stack(
            [
                self.positions[first],
                self.src_offsets[first],
                self.dst_offsets[first],
                self.run_length[s : s + n],
            ],
            axis=1,
        )

    def run_count(self) -> int:
        """Contiguous runs over all reads (a run is one copy per head and KV plane)."""
        return int(self.runs_count.sum())

    def done_messages(self) -> list[DoneMessage]:
        """Every done message of the request: each decode rank to each prefill rank it read
        from, with those read ids; the first decode rank to every unread prefill rank."""
        order = np.lexsort((np.arange(len(self)), self.prefill_rank, self.decode_rank))
        pairs = np.stack([self.decode_rank[order], self.prefill_rank[order]])
        changed = np.any(pairs[:, 1:] != pairs[:, :-1], axis=0)
        starts = np.flatnonzero(np.r_[True, changed]) if len(self) else []
        ends = list(starts[1:]) + [len(self)]
        messages = [
            DoneMessage(int(pairs[0, s]), int(pairs[1, s]), tuple(order[s:e].tolist()))
            for s, e in zip(starts, ends)
        ]
        first = self.decode_ranks.start
        messages += [DoneMessage(first, rank, ()) for rank in self.unread]
        return messages

    # -- what the transfer costs -------------------------------------------------------
    def head_slots_needed(self) -> int:
        """(token, head) entries the decode ranks must receive, summed over decode ranks."""
        return int((self.token_count * (self.head1 - self.head0)).sum())

    def head_slots_whole_blocks(self) -> int:
        """(slot, head) entries moved if each decode rank copies every source block it reads
        from whole, once (and picks its tokens out locally)."""
        if not len(self):
            return 0
        blocks = np.unique(
            np.stack([self.decode_rank, self.prefill_rank, self.src_block, self.head0, self.head1]), axis=1
        )
        return int((self.prefill.block_size * (blocks[4] - blocks[3])).sum())


def _run_starts(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Per token: does a run of slots contiguous on both sides start here?"""
    if src.size == 0:
        return np.zeros(0, dtype=bool)
    return np.r_[True, (np.diff(src) != 1) | (np.diff(dst) != 1)]


def check_pair(prefill: CPLayout, decode: CPLayout) -> None:
    """LayoutError (one line, naming the side) unless both layouts can be built and serve
    the same model."""
    for side, layout in (("prefill", prefill), ("decode", decode)):
        try:
            layout.check()
        except LayoutError as e:
            raise LayoutError(f"{side} layout: {e}") from None
    if prefill.kv_heads != decode.kv_heads:

        def name(kv):
            return "MLA" if kv is None else f"{kv} KV heads"

        raise LayoutError(
            f"prefill and decode must serve the same model: prefill has "
            f"{name(prefill.kv_heads)}, decode {name(decode.kv_heads)}"
        )


def _head_pieces(prefill: CPLayout, decode: CPLayout, tp_rank: int) -> list[tuple[int, int]]:
    """A decode TP rank's KV heads, cut where prefill TP ranks' head ranges end."""
    heads = decode.heads(tp_rank)
    if prefill.kv_heads is None:
        return [(heads.start, heads.stop)]
    step = max(1, prefill.kv_heads // prefill.tp)
    cuts = sorted({heads.start, heads.stop} | {h for h in heads if h % step == 0})
    return list(zip(cuts, cuts[1:]))


@lru_cache(maxsize=256)
def _targets(prefill: CPLayout, decode: CPLayout, replica_offset: int, needs: bytes):
    """Per (decode rank, head piece) of one replica: the rank, its CP rank, the heads, and
    for every prefill CP rank the prefill TP rank to read from. ``needs[d, p]``: decode CP
    rank ``d`` takes tokens from prefill CP rank ``p`` (only those count as readers)."""
    need = np.frombuffer(needs, dtype=bool).reshape(decode.cp, prefill.cp)
    rows, readers = [], {}
    for d_pcp in range(decode.pcp):
        for d_tp in range(decode.tp):
            cp_rank = decode.cp_rank(d_pcp, d_tp)
            for h0, h1 in _head_pieces(prefill, decode, d_tp):
                src_tp = []
                for p_cp in range(prefill.cp):
                    dcp_rank = p_cp % prefill.dcp
                    holders = [t for t in range(dcp_rank, prefill.tp, prefill.dcp) if h0 in prefill.heads(t)]
                    # the j-th decode reader of these tokens and heads takes the j-th replica
                    j = readers.get((p_cp, h0), 0)
                    if need[cp_rank, p_cp]:
                        readers[(p_cp, h0)] = j + 1
                    src_tp.append(holders[(j + replica_offset) % len(holders)])
                rows.append((decode.rank(d_pcp, d_tp), cp_rank, h0, h1, src_tp))
    rank = np.array([r[0] for r in rows], dtype=np.int64)
    cp = np.array([r[1] for r in rows], dtype=np.int64)
    h0 = np.array([r[2] for r in rows], dtype=np.int64)
    h1 = np.array([r[3] for r in rows], dtype=np.int64)
    src_tp = np.array([r[4] for r in rows], dtype=np.int64).reshape(len(rows), prefill.cp)
    return rank, cp, h0, h1, src_tp


_CACHED_PROPERTIES = [name for name, value in vars(Plan).items() if isinstance(value, cached_property)]
_CHECKED_PAIRS: set = set()  # layout pairs check_pair passed


def build_plan(
    prefill: CPLayout,
    decode: CPLayout,
    num_tokens: int,
    prefill_block_ids,
    decode_block_ids,
    prefill_dp_rank: int = 0,
    decode_dp_rank: int = 0,
    replica_offset: int = 0,
) -> Plan:
    """Plan one request's pull: ``num_tokens`` tokens, the request's block tables on both
    sides (``*_block_ids[i]`` is block-table entry ``i``), and the DP replicas holding it.
    Raises ``LayoutError`` (one line, naming the constraint) for plans that cannot be made."""
    if (prefill, decode) not in _CHECKED_PAIRS:
        check_pair(prefill, decode)
        _CHECKED_PAIRS.add((prefill, decode))
    if num_tokens < 0:
        raise LayoutError(f"num_tokens must be non-negative, got {num_tokens}")
    for side, dp_rank, layout in (("prefill", prefill_dp_rank, prefill), ("decode", decode_dp_rank, decode)):
        if not 0 <= dp_rank < layout.dp:
            raise LayoutError(f"{side} dp_rank {dp_rank} is outside data_parallel_size {layout.dp}")
    need_p = -(-num_tokens // prefill.virtual_block_size)
    need_d = -(-num_tokens // decode.virtual_block_size)
    if len(prefill_block_ids) < need_p or len(decode_block_ids) < need_d:
        raise LayoutError(
            f"{num_tokens} tokens need {need_p} prefill blocks ({prefill.virtual_block_size} tokens each) "
            f"and {need_d} decode blocks ({decode.virtual_block_size} tokens each), got "
            f"{len(prefill_block_ids)} and {len(decode_block_ids)}"
        )
    shape = plan_shape(prefill, decode, num_tokens, prefill_dp_rank, decode_dp_rank, replica_offset)
    src_ids = np.asarray(prefill_block_ids, dtype=np.int64)
    dst_ids = np.asarray(decode_block_ids, dtype=np.int64)
    return shape.with_columns(
        replica_offset=replica_offset,
        src_block=src_ids[shape.src_block],
        dst_block=dst_ids[shape.dst_block],
    )


def period(prefill: CPLayout, decode: CPLayout) -> int:
    """Tokens after which both placements repeat (block-table index + 1 on each side per
    virtual block): the plan of tokens ``t + period`` is that of ``t``, blocks shifted."""
    return math.lcm(prefill.virtual_block_size, decode.virtual_block_size)


@lru_cache(maxsize=64)
def _replica_period(prefill: CPLayout) -> int:
    """Replica offsets that choose the same replicas repeat with this period."""
    counts = {
        sum(1 for t in range(dcp_rank, prefill.tp, prefill.dcp) if head in prefill.heads(t))
        for dcp_rank in range(prefill.dcp)
        for head in range(prefill.kv_heads or 1)
    }
    return math.lcm(*(c for c in counts if c))


def plan_shape(
    prefill: CPLayout,
    decode: CPLayout,
    num_tokens: int,
    prefill_dp_rank: int = 0,
    decode_dp_rank: int = 0,
    replica_offset: int = 0,
) -> Plan:
    """The plan of ``num_tokens`` tokens with block-table indices where the block ids go
    (``src_block``/``dst_block``), made of cached per-period plans. Its arrays may be the
    cache's (read-only): copy before changing them."""
    args = (prefill, decode, prefill_dp_rank, decode_dp_rank, replica_offset % _replica_period(prefill))
    cycle = period(prefill, decode)
    if num_tokens < cycle:
        return _period_plan(*args, num_tokens)
    copies, rest = divmod(num_tokens, cycle)
    whole = _whole_periods(*args, copies)
    if not rest:
        return whole
    full = _period_plan(*args, cycle)
    steps = (cycle // prefill.virtual_block_size, cycle // decode.virtual_block_size)
    # the last, partial period keeps the full period's readers (``need``), so its reads
    # are the full period's, cut short
    tail = _copies(_period_plan(*args, rest, need=full.need), 1, *steps, first=copies)
    return _join([whole, tail], num_tokens)


@lru_cache(maxsize=64)
def _whole_periods(
    prefill: CPLayout,
    decode: CPLayout,
    prefill_dp_rank: int,
    decode_dp_rank: int,
    replica_offset: int,
    copies: int,
) -> Plan:
    """The plan of ``copies`` whole periods (cached: requests of as many blocks share it)."""
    cycle = period(prefill, decode)
    steps = (cycle // prefill.virtual_block_size, cycle // decode.virtual_block_size)
    return _read_only(
        _copies(
            _period_plan(prefill, decode, prefill_dp_rank, decode_dp_rank, replica_offset, cycle),
            copies,
            *steps,
        )
    )


def _read_only(plan: Plan) -> Plan:
    for column in vars(plan).values():
        if isinstance(column, np.ndarray):
            column.flags.writeable = False  # cached: shared by every request of this shape
    return plan


def _copies(shape: Plan, copies: int, src_step: int, dst_step: int, first: int = 0) -> Plan:
    """``shape`` (the plan of one period, or less) repeated for periods ``first ..
    first + copies - 1``: block-table indices, positions and rows shifted per period."""
    k = np.arange(first, first + copies, dtype=np.int64)
    tokens, runs = shape.positions.size, shape.run_token.size
    cycle = src_step * shape.prefill.virtual_block_size

    def shifted(column, step):  # a column of ids or positions, ``step`` further per period
        if copies == 1:
            return column + first * step
        return (column[None, :] + k[:, None] * step).ravel()

    def rows(column, size):  # row indices into columns ``size`` rows longer per copy
        return column if copies == 1 else (column[None, :] + (k - first)[:, None] * size).ravel()

    def tile(column):  # one copy (a request's last, partial period): the column itself
        return column if copies == 1 else np.tile(column, copies)

    return shape.with_columns(
        num_tokens=(first + copies - 1) * cycle + shape.num_tokens,
        decode_rank=tile(shape.decode_rank),
        prefill_rank=tile(shape.prefill_rank),
        src_block=shifted(shape.src_block, src_step),
        dst_block=shifted(shape.dst_block, dst_step),
        head0=tile(shape.head0),
        head1=tile(shape.head1),
        token_start=rows(shape.token_start, tokens),
        token_count=tile(shape.token_count),
        positions=shifted(shape.positions, cycle),
        src_offsets=tile(shape.src_offsets),
        dst_offsets=tile(shape.dst_offsets),
        runs_start=rows(shape.runs_start, runs),
        runs_count=tile(shape.runs_count),
        run_token=rows(shape.run_token, tokens),
        run_length=tile(shape.run_length),
        group=tile(shape.group),
    )


@lru_cache(maxsize=512)
def _period_plan(
    prefill: CPLayout,
    decode: CPLayout,
    prefill_dp_rank: int,
    decode_dp_rank: int,
    replica_offset: int,
    num_tokens: int,
    need: bytes | None = None,
) -> Plan:
    """The plan of tokens ``0 .. num_tokens - 1`` worked out token by token, block-table
    indices for block ids; ``need`` (``Plan.need`` of a longer plan) fixes which decode CP
    ranks count as readers of which prefill CP rank's tokens."""
    p_base = prefill_dp_rank * prefill.ranks_per_replica
    d_base = decode_dp_rank * decode.ranks_per_replica
    need_p = -(-num_tokens // prefill.virtual_block_size)
    need_d = -(-num_tokens // decode.virtual_block_size)

    t = np.arange(num_tokens, dtype=np.int64)
    c_p = owner(t, prefill.cp, prefill.interleave)
    src_blk, src_off = block_and_offset(t, prefill.block_size, prefill.cp, prefill.interleave)
    c_d = owner(t, decode.cp, decode.interleave)
    dst_blk, dst_off = block_and_offset(t, decode.block_size, decode.cp, decode.interleave)
    # Token groups: one key per (decode CP rank, prefill CP rank, source block, destination
    # block); a stable sort keeps positions ascending inside a group.
    span_p, span_d = max(need_p, 1), max(need_d, 1)
    key = ((c_d * prefill.cp + c_p) * span_p + src_blk) * span_d + dst_blk
    order = np.argsort(key, kind="stable")
    key = key[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if num_tokens else np.zeros(0, np.int64)
    counts = np.diff(np.r_[starts, num_tokens])
    g = key[starts]
    g_dst, g = g % span_d, g // span_d
    g_src, g = g % span_p, g // span_p
    g_cp, g_cd = g % prefill.cp, g // prefill.cp
    # runs: slots contiguous on both sides inside a token group
    positions, src_offsets, dst_offsets = t[order], src_off[order], dst_off[order]
    run_first = _run_starts(src_offsets, dst_offsets)
    run_first[starts] = True
    run_token = np.flatnonzero(run_first)
    run_length = np.diff(np.r_[run_token, num_tokens])
    group_runs = np.searchsorted(run_token, starts)
    group_run_count = np.diff(np.r_[group_runs, run_token.size])

    # Every (decode rank, head piece) takes the groups of its CP rank (contiguous: the key
    # sorts by decode CP rank first).
    if need is None:
        readers = np.zeros((decode.cp, prefill.cp), dtype=bool)
        readers[g_cd, g_cp] = True
        need = readers.tobytes()
    t_rank, t_cp, t_h0, t_h1, t_src_tp = _targets(prefill, decode, replica_offset, need)
    lo = np.searchsorted(g_cd, t_cp, side="left")
    hi = np.searchsorted(g_cd, t_cp, side="right")
    n = hi - lo
    target = np.repeat(np.arange(t_rank.size), n)
    group = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n - lo, n)
    p_cp = g_cp[group]
    src_tp = t_src_tp[target, p_cp]
    prefill_rank = p_base + (p_cp // prefill.dcp) * prefill.tp + src_tp

    plan = Plan(
        prefill,
        decode,
        num_tokens,
        prefill_dp_rank,
        decode_dp_rank,
        replica_offset,
        decode_rank=d_base + t_rank[target],
        prefill_rank=prefill_rank,
        src_block=g_src[group],
        dst_block=g_dst[group],
        head0=t_h0[target],
        head1=t_h1[target],
        token_start=starts[group],
        token_count=counts[group],
        positions=positions,
        src_offsets=src_offsets,
        dst_offsets=dst_offsets,
        runs_start=group_runs[group],
        runs_count=group_run_count[group],
        run_token=run_token,
        run_length=run_length,
        need=need,
    )
    return _read_only(plan)


def build_group_plan(
    prefill: CPLayout,
    decode: CPLayout,
    num_tokens: int,
    prefill_tables,
    decode_tables,
    prefill_dp_rank: int = 0,
    decode_dp_rank: int = 0,
    replica_offset: int = 0,
) -> Plan:
    """One request's pull over every KV-cache group: ``*_tables[g]`` is group ``g``'s block
    table on each side. Tokens whose decode block is the null block are not read (the group
    keeps nothing there); a token the decode side keeps but the prefill side does not is a
    ``LayoutError``. Read ids run over all groups; ``Plan.group`` tells them apart."""
    if len(prefill_tables) != len(decode_tables):
        raise LayoutError(
            f"the prefill instance sent block tables for {len(prefill_tables)} KV-cache groups, "
            f"this instance has {len(decode_tables)}: run both with the same hybrid KV-cache "
            "manager setting (--disable-hybrid-kv-cache-manager on both or neither)"
        )
    parts = []
    for g, (src, dst) in enumerate(zip(prefill_tables, decode_tables)):
        plan = build_plan(
            prefill, decode, num_tokens, src, dst, prefill_dp_rank, decode_dp_rank, replica_offset
        )
        if _holds_null(src) or _holds_null(dst):  # a windowed group's tables (else nothing to drop)
            needed = plan.dst_block != NULL_BLOCK
            lost = needed & (plan.src_block == NULL_BLOCK)
            if lost.any():
                first = int(plan.first_position[lost].min())
                raise LayoutError(
                    f"KV-cache group {g}: the prefill instance kept no block for token {first}, which "
                    "this instance needs (the two sides disagree on the group's window)"
                )
            if not needed.all():
                plan = plan.subset(needed)
        if g:
            plan = plan.with_columns(group=np.full(len(plan), g, dtype=np.int64))
        parts.append(plan)
    return _join(parts).with_columns(num_groups=len(parts)) if len(parts) != 1 else parts[0]


def _holds_null(block_ids) -> bool:
    """A block table (a list, as the wire carries it, or an array) with the null block in it."""
    if isinstance(block_ids, np.ndarray):
        return bool((block_ids == NULL_BLOCK).any())
    return NULL_BLOCK in block_ids


def _join(plans: list[Plan], num_tokens: int | None = None) -> Plan:
    """The reads of several plans of one request (one per KV-cache group, or consecutive
    periods) as one plan; ``num_tokens``: the request's (default: the first plan's)."""
    if not plans:
        raise LayoutError("a request with no KV-cache group has nothing to transfer")
    token_base = np.cumsum([0] + [p.positions.size for p in plans[:-1]])
    run_base = np.cumsum([0] + [p.run_token.size for p in plans[:-1]])

    def cat(name, bases=None):
        columns = [getattr(p, name) for p in plans]
        if bases is not None:
            columns = [c + b for c, b in zip(columns, bases)]
        return np.concatenate(columns)

    return plans[0].with_columns(
        num_tokens=plans[0].num_tokens if num_tokens is None else num_tokens,
        decode_rank=cat("decode_rank"),
        prefill_rank=cat("prefill_rank"),
        src_block=cat("src_block"),
        dst_block=cat("dst_block"),
        head0=cat("head0"),
        head1=cat("head1"),
        token_start=cat("token_start", token_base),
        token_count=cat("token_count"),
        positions=cat("positions"),
        src_offsets=cat("src_offsets"),
        dst_offsets=cat("dst_offsets"),
        runs_start=cat("runs_start", run_base),
        runs_count=cat("runs_count"),
        run_token=cat("run_token", token_base),
        run_length=cat("run_length"),
        group=cat("group"),
    )


if __name__ == "__main__":
    import sys

    # The inspector (which imports this module) is the command; say where it went.
    sys.exit("the plan inspector is `python -m vllm.ascend.kv_transfer.inspector` (same arguments)")
