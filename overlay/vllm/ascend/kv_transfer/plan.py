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
import threading
from dataclasses import dataclass, field
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
    # per read: its KV-cache group (None: all group 0). A factory, not a plain default: a
    # plain default is also a class attribute, which a deferred plan (its columns popped)
    # would answer for ``group`` instead of working its columns out (``__getattr__``)
    group: np.ndarray | None = field(default_factory=lambda: None)
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

    def __getattr__(self, name: str):
        # called only for what is not set: a deferred plan's columns, worked out when first read
        if name not in _STACKED_NAMES or "_deferred" not in self.__dict__:
            raise AttributeError(f"'Plan' object has no attribute {name!r}")
        self._work_out_columns()
        return self.__dict__[name]

    def _work_out_columns(self) -> None:
        make = self.__dict__.pop("_deferred", None)
        if make is not None:
            self.__dict__.update(make())

    def deferred(self, make, **fields) -> Plan:
        """This plan with these fields, and columns that ``make()`` (a dict) works out when
        one is first read: a pull's ranges come from its pieces (``_pieces``), so the columns
        are first needed by its done messages, after the pull is reported."""
        plan = self.with_columns(**fields)
        for name in (*_STACKED_NAMES, "_stacked", "_pieces"):
            plan.__dict__.pop(name, None)
        plan.__dict__["_deferred"] = make
        return plan

    def with_columns(self, **columns) -> Plan:
        """This plan with these fields replaced (``dataclasses.replace`` without the
        per-field checks: a request's plan is made of a cached one on every pull)."""
        if columns.keys() & _STACKED_NAMES:
            self._work_out_columns()  # the columns not replaced come from here
        plan = object.__new__(Plan)
        plan.__dict__.update(self.__dict__)
        for name in _CACHED_PROPERTIES:  # worked out from the old columns
            plan.__dict__.pop(name, None)
        if columns.keys() & _STACKED_NAMES:  # no longer its rows, nor made of those pieces
            plan.__dict__.pop("_stacked", None)
            plan.__dict__.pop("_pieces", None)
        plan.__dict__.update(columns)
        return plan

    def subset(self, rows: np.ndarray) -> Plan:
        """The plan of the reads ``rows`` (a boolean mask or ascending indices), renumbered
        from 0; token columns are shared, not copied."""
        rows = np.flatnonzero(rows) if rows.dtype == bool else np.asarray(rows, dtype=np.int64)
        columns = {name: getattr(self, name)[rows] for name in _READ_ROWS}
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
    pair = _pair(prefill, decode)
    if num_tokens < 0:
        raise LayoutError(f"num_tokens must be non-negative, got {num_tokens}")
    for side, dp_rank, layout in (("prefill", prefill_dp_rank, prefill), ("decode", decode_dp_rank, decode)):
        if not 0 <= dp_rank < layout.dp:
            raise LayoutError(f"{side} dp_rank {dp_rank} is outside data_parallel_size {layout.dp}")
    (size_p, size_d) = pair.virtual_block_sizes
    need_p, need_d = -(-num_tokens // size_p), -(-num_tokens // size_d)
    if len(prefill_block_ids) < need_p or len(decode_block_ids) < need_d:
        raise LayoutError(
            f"{num_tokens} tokens need {need_p} prefill blocks ({size_p} tokens each) "
            f"and {need_d} decode blocks ({size_d} tokens each), got "
            f"{len(prefill_block_ids)} and {len(decode_block_ids)}"
        )
    shape = _shape(pair, num_tokens, prefill_dp_rank, decode_dp_rank, replica_offset)
    src_ids = np.asarray(prefill_block_ids, dtype=np.int64)
    dst_ids = np.asarray(decode_block_ids, dtype=np.int64)
    pieces = shape.__dict__.get("_pieces") or ((shape, 0, 0, 0),)
    if "_deferred" in shape.__dict__:  # a partial last period: its columns when first read

        def columns(shape=shape) -> dict:
            out = {name: getattr(shape, name) for name in _STACKED_NAMES}
            out.update(src_block=src_ids[out["src_block"]], dst_block=dst_ids[out["dst_block"]])
            return out

        plan = shape.deferred(columns, replica_offset=replica_offset)
    else:
        plan = shape.with_columns(
            replica_offset=replica_offset,
            src_block=src_ids[shape.src_block],
            dst_block=dst_ids[shape.dst_block],
        )
    # what the plan is made of, for address templates (addressing.py); cut or joined plans
    # drop it (``with_columns`` of read columns)
    plan.__dict__["_pieces"] = (pieces, src_ids, dst_ids)
    return plan


def period(prefill: CPLayout, decode: CPLayout) -> int:
    """Tokens after which both placements repeat (block-table index + 1 on each side per
    virtual block): the plan of tokens ``t + period`` is that of ``t``, blocks shifted."""
    return math.lcm(prefill.virtual_block_size, decode.virtual_block_size)


def _replica_period(prefill: CPLayout) -> int:
    """Replica offsets that choose the same replicas repeat with this period."""
    counts = {
        sum(1 for t in range(dcp_rank, prefill.tp, prefill.dcp) if head in prefill.heads(t))
        for dcp_rank in range(prefill.dcp)
        for head in range(prefill.kv_heads or 1)
    }
    return math.lcm(*(c for c in counts if c))


class _Pair:
    """A layout pair that ``check_pair`` passed, with what all its plans share: the period,
    virtual block sizes, how replica offsets repeat, and the plans of whole periods and of
    partial last periods made so far (the oldest dropped past their limit)."""

    WHOLES_KEPT = 64  # period counts: prompt lengths in blocks
    PARTS_KEPT = 512  # partial periods: up to a period's tokens - 1 of them

    def __init__(self, prefill: CPLayout, decode: CPLayout):
        check_pair(prefill, decode)
        self.prefill, self.decode = prefill, decode
        self.cycle = period(prefill, decode)
        self.virtual_block_sizes = (prefill.virtual_block_size, decode.virtual_block_size)
        self.replica_period = _replica_period(prefill)
        self.wholes: dict = {}  # (dp ranks, replica offset, periods) -> plan
        self.parts: dict = {}  # (dp ranks, replica offset, tokens) -> (matrices, period steps)
        self._making = threading.Lock()  # pull threads plan at once; hits take no lock

    def kept(self, cache: dict, key, make, limit: int):
        value = cache.get(key)
        if value is None:
            with self._making:
                value = cache.get(key)
                if value is None:
                    if len(cache) >= limit:
                        del cache[next(iter(cache))]  # the oldest
                    value = cache[key] = make()
        return value


# By the layouts' identity (a worker keeps one layout per peer: no hashing of two
# dataclasses per request); each entry holds its layouts, so no id is reused while it lives
_PAIRS: dict = {}


def _pair(prefill: CPLayout, decode: CPLayout) -> _Pair:
    hit = _PAIRS.get((id(prefill), id(decode)))
    if hit is not None and hit[0] is prefill and hit[1] is decode:
        return hit[2]
    pair = _pair_by_value(prefill, decode)
    if len(_PAIRS) >= 256:
        _PAIRS.clear()
    _PAIRS[(id(prefill), id(decode))] = (prefill, decode, pair)
    return pair


@lru_cache(maxsize=64)
def _pair_by_value(prefill: CPLayout, decode: CPLayout) -> _Pair:
    return _Pair(prefill, decode)


def clear_plan_caches() -> None:
    """Forget every cached plan and layout pair (tests; memory)."""
    _PAIRS.clear()
    _pair_by_value.cache_clear()
    _period_plan.cache_clear()


def _shape(
    pair: _Pair, num_tokens: int, prefill_dp_rank: int, decode_dp_rank: int, replica_offset: int
) -> Plan:
    """The plan of ``num_tokens`` tokens with block-table indices where the block ids go
    (``src_block``/``dst_block``), made of kept per-period plans. Its arrays may be the
    cache's (read-only): copy before changing them."""
    replicas = (prefill_dp_rank, decode_dp_rank, replica_offset % pair.replica_period)
    if num_tokens < pair.cycle:
        return _period_plan(pair.prefill, pair.decode, *replicas, num_tokens)
    copies, rest = divmod(num_tokens, pair.cycle)
    whole = pair.kept(
        pair.wholes, (*replicas, copies), lambda: _whole_periods(pair, replicas, copies), pair.WHOLES_KEPT
    )
    if not rest:
        return whole
    # the last, partial period, moved ``copies`` periods on and appended in one numpy call
    # per stacked matrix (no per-request plan of it), when a column is first read
    part, steps, part_plan = pair.kept(
        pair.parts, (*replicas, rest), lambda: _partial_period(pair, replicas, rest), pair.PARTS_KEPT
    )

    def columns() -> dict:  # the partial period moved ``copies`` periods on and appended
        stacked = [
            np.concatenate([w, p + copies * step], axis=1) for w, p, step in zip(_stacks(whole), part, steps)
        ]
        return _columns_of(*stacked)

    plan = whole.deferred(columns, num_tokens=num_tokens)
    # the partial piece's block-table indices, ``copies`` periods of blocks further on
    size_p, size_d = pair.virtual_block_sizes
    plan.__dict__["_pieces"] = (
        (whole, 0, 0, 0),
        (part_plan, copies * pair.cycle // size_p, copies * pair.cycle // size_d, copies * pair.cycle),
    )
    return plan


# A plan's columns as the rows of three matrices (per read, per token, per run): cached
# plans keep them, so copying and joining them costs a numpy call per matrix, not per column
_READ_ROWS = (
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
_TOKEN_ROWS = ("positions", "src_offsets", "dst_offsets")
_RUN_ROWS = ("run_token", "run_length")
_STACKED_NAMES = frozenset(_READ_ROWS + _TOKEN_ROWS + _RUN_ROWS)


def _stacks(plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The plan's (read, token, run) matrices: kept ones, else stacked from its columns."""
    stacked = plan.__dict__.get("_stacked")
    if stacked is None:
        stacked = tuple(
            np.stack([getattr(plan, name) for name in rows], dtype=np.int64)
            for rows in (_READ_ROWS, _TOKEN_ROWS, _RUN_ROWS)
        )
    return stacked


def _stacked_plan(template: Plan, reads: np.ndarray, tokens: np.ndarray, runs: np.ndarray, **fields) -> Plan:
    """``template`` with its columns taken from the rows of these matrices (kept with it)."""
    columns = _columns_of(reads, tokens, runs)
    stacked = columns.pop("_stacked")
    plan = template.with_columns(**columns, **fields)
    plan.__dict__["_stacked"] = stacked
    return plan


def _columns_of(reads: np.ndarray, tokens: np.ndarray, runs: np.ndarray) -> dict:
    """The columns that are these matrices' rows, and the matrices (``_stacked``)."""
    columns = dict(zip(_READ_ROWS, reads))
    columns.update(zip(_TOKEN_ROWS, tokens))
    columns.update(zip(_RUN_ROWS, runs))
    columns["_stacked"] = (reads, tokens, runs)
    return columns


def _row_vector(rows: tuple[str, ...], **values: int) -> np.ndarray:
    vector = np.zeros((len(rows), 1), dtype=np.int64)
    for name, value in values.items():
        vector[rows.index(name)] = value
    vector.flags.writeable = False
    return vector


def _period_step(pair: _Pair, replicas: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """How far each row of the stacked matrices moves from one period to the next: block-table
    indices by the blocks of a period, positions by the period, row indices by the full
    period's tokens and runs (column vectors, one per matrix)."""
    full = _period_plan(pair.prefill, pair.decode, *replicas, pair.cycle)
    tokens, runs = full.positions.size, full.run_token.size
    return (
        _row_vector(
            _READ_ROWS,
            src_block=pair.cycle // pair.virtual_block_sizes[0],
            dst_block=pair.cycle // pair.virtual_block_sizes[1],
            token_start=tokens,
            runs_start=runs,
        ),
        _row_vector(_TOKEN_ROWS, positions=pair.cycle),
        _row_vector(_RUN_ROWS, run_token=tokens),
    )


def _whole_periods(pair: _Pair, replicas: tuple, copies: int) -> Plan:
    """The plan of ``copies`` whole periods (kept: requests of as many blocks share it)."""
    shape = _period_plan(pair.prefill, pair.decode, *replicas, pair.cycle)
    if copies == 1:
        return shape
    k = np.arange(copies, dtype=np.int64)
    stacked = [
        (matrix[:, None, :] + step[:, :, None] * k[None, :, None]).reshape(matrix.shape[0], -1)
        for matrix, step in zip(_stacks(shape), _period_step(pair, replicas))
    ]
    return _read_only(_stacked_plan(shape, *stacked, num_tokens=copies * shape.num_tokens))


def _partial_period(pair: _Pair, replicas: tuple, tokens: int) -> tuple:
    """A last period of ``tokens`` tokens: its plan's matrices, the period steps, and the
    plan itself. It keeps the full period's readers (``need``), so its reads are the full
    period's, cut short."""
    full = _period_plan(pair.prefill, pair.decode, *replicas, pair.cycle)
    part = _period_plan(pair.prefill, pair.decode, *replicas, tokens, need=full.need)
    return _stacks(part), _period_step(pair, replicas), part


def _read_only(plan: Plan) -> Plan:
    """Cached: shared by every request of this shape."""
    for column in [*vars(plan).values(), *plan.__dict__.get("_stacked", ())]:
        if isinstance(column, np.ndarray):
            column.flags.writeable = False
    return plan


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
    return _read_only(_stacked_plan(plan, *_stacks(plan)))


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
        return not block_ids.all()  # one reduction: the null block, 0, is the only falsy id
    return NULL_BLOCK in block_ids


def _join(plans: list[Plan], num_tokens: int | None = None) -> Plan:
    """The reads of several plans of one request (one per KV-cache group) as one plan;
    ``num_tokens``: the request's (default: the first plan's)."""
    if not plans:
        raise LayoutError("a request with no KV-cache group has nothing to transfer")
    stacks = [_stacks(p) for p in plans]
    token_base = run_base = 0
    parts: tuple[list, list, list] = ([], [], [])
    for reads, tokens, runs in stacks:  # each plan's row indices moved past the plans before it
        parts[0].append(reads + _row_vector(_READ_ROWS, token_start=token_base, runs_start=run_base))
        parts[1].append(tokens)
        parts[2].append(runs + _row_vector(_RUN_ROWS, run_token=token_base))
        token_base += tokens.shape[1]
        run_base += runs.shape[1]
    stacked = [np.concatenate(matrices, axis=1) for matrices in parts]
    return _stacked_plan(
        plans[0], *stacked, num_tokens=plans[0].num_tokens if num_tokens is None else num_tokens
    )


if __name__ == "__main__":
    import sys

    # The inspector (which imports this module) is the command; say where it went.
    sys.exit("the plan inspector is `python -m vllm.ascend.kv_transfer.inspector` (same arguments)")
