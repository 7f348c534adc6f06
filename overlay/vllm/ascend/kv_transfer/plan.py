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
in separate groups, each with its own block table): ``PlanShapes.group_plan`` plans every
group from its own tables and joins the plans, so read ids stay unique per request; a
read's ``group`` says which layers it is for. A sliding-window group's table names vLLM's
null block where the group keeps no block (before the window); such tokens are not read.

Shapes: a request's plan depends on its block tables only through the block ids, and on
its length through whole *periods* of ``lcm`` of both sides' virtual block sizes (the
placement repeats every period). So a plan is made of *shapes*, plans of block-table
indices: the plan of whole periods and of a partial last period, each worked out once
per layout pair by ``PlanShapes`` and kept by whoever owns it (the decode worker's
``planner.ReplicaPlanner``, one per connected prefill replica); a request's plan is its
shapes with its block ids put in, and remembers them as its ``pieces`` (the byte ranges
are worked out per shape too, ``addressing.py``).

Run ``python -m vllm.ascend.kv_transfer.inspector --help`` to inspect a plan (docs/pd_plan.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from vllm.ascend.context_parallel.placement import CPLayout, LayoutError, block_and_offset, owner

# vLLM's block pool reserves block 0 as its null block: a block table names it where a
# KV-cache group keeps no block for the request (tokens before a sliding window)
NULL_BLOCK = 0

# A plan's columns are the rows of three int64 matrices, one column per read, per token
# and per run: copying, shifting and joining plans is a numpy call per matrix
READ_ROWS = (
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
TOKEN_ROWS = ("positions", "src_offsets", "dst_offsets")
RUN_ROWS = ("run_token", "run_length")
_SRC, _DST, _GROUP = READ_ROWS.index("src_block"), READ_ROWS.index("dst_block"), READ_ROWS.index("group")


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


@dataclass(frozen=True, eq=False)
class Piece:
    """Part of a request's plan: a shape (a plan of block-table indices) with its indices
    moved on by ``src_shift``/``dst_shift`` blocks and its positions by ``first_position``,
    whose block ids are ``src_ids``/``dst_ids`` (the request's tables of KV-cache group
    ``group``). ``key`` names the shape for whoever keeps it (None: kept by no one)."""

    key: Hashable
    shape: TransferPlan
    group: int
    src_ids: np.ndarray | None  # None: the shape's block columns are block ids already
    dst_ids: np.ndarray | None
    src_shift: int = 0
    dst_shift: int = 0
    first_position: int = 0
    # the group's decode table names the null block: the shape's reads into it are not made
    skip_null: bool = False


def _row(matrix: str, index: int, doc: str) -> property:
    return property(lambda plan: getattr(plan, matrix)[index], doc=doc)


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """One request's reads as columns, one per read (read id = column index); a read's
    tokens are columns ``token_start .. token_start + token_count`` of the token rows, its
    runs (slots contiguous on both sides) columns ``runs_start .. runs_start + runs_count``
    of the run rows (``run_token``: a run's first token; ``run_length``: its tokens)."""

    prefill: CPLayout
    decode: CPLayout
    num_tokens: int
    prefill_dp_rank: int
    decode_dp_rank: int
    replica_offset: int
    read_rows: np.ndarray  # READ_ROWS x reads
    token_rows: np.ndarray  # TOKEN_ROWS x tokens
    run_rows: np.ndarray  # RUN_ROWS x runs
    # which decode CP ranks read which prefill CP rank's tokens (decode.cp x prefill.cp
    # booleans): it orders the readers of replicas, so a partial period is planned with
    # the full period's
    need: bytes = b""
    num_groups: int = 1  # KV-cache groups planned (``group`` runs below it)
    pieces: tuple[Piece, ...] = ()  # what the plan is made of (empty: cut from another)

    decode_rank = _row("read_rows", 0, "per read: the global decode rank that makes it")
    prefill_rank = _row("read_rows", 1, "per read: the global prefill rank it reads")
    src_block = _row("read_rows", 2, "per read: the prefill block id")
    dst_block = _row("read_rows", 3, "per read: the decode block id")
    head0 = _row("read_rows", 4, "per read: its first global KV head")
    head1 = _row("read_rows", 5, "per read: its KV heads' end")
    token_start = _row("read_rows", 6, "per read: its first token column")
    token_count = _row("read_rows", 7, "per read: its tokens")
    runs_start = _row("read_rows", 8, "per read: its first run column")
    runs_count = _row("read_rows", 9, "per read: its runs")
    group = _row("read_rows", 10, "per read: its KV-cache group")
    positions = _row("token_rows", 0, "per token: its position, ascending within a read")
    src_offsets = _row("token_rows", 1, "per token: its slot in the source block")
    dst_offsets = _row("token_rows", 2, "per token: its slot in the destination block")
    run_token = _row("run_rows", 0, "per run: its first token column")
    run_length = _row("run_rows", 1, "per run: its tokens")

    def __len__(self) -> int:
        return int(self.read_rows.shape[1])

    def subset(self, rows: np.ndarray) -> TransferPlan:
        """The plan of the reads ``rows`` (a boolean mask or ascending indices), renumbered
        from 0; token and run rows are shared, not copied. Cut, it is made of no pieces."""
        rows = np.flatnonzero(rows) if rows.dtype == bool else np.asarray(rows, dtype=np.int64)
        return dataclasses.replace(self, read_rows=_read_only(self.read_rows[:, rows]), pieces=())

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

    def reads(self) -> Iterator[Read]:
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
        starts: list[int] = np.flatnonzero(np.r_[True, changed]).tolist() if len(self) else []
        ends = starts[1:] + [len(self)]
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


def _read_only(matrix: np.ndarray) -> np.ndarray:
    matrix.setflags(write=False)  # shared by every plan made of it: what is worked out stays true
    return matrix


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


def _head_pieces(prefill: CPLayout, decode: CPLayout, tp_rank: int) -> list[tuple[int, int]]:
    """A decode TP rank's KV heads, cut where prefill TP ranks' head ranges end."""
    heads = decode.heads(tp_rank)
    if prefill.kv_heads is None:
        return [(heads.start, heads.stop)]
    step = max(1, prefill.kv_heads // prefill.tp)
    cuts = sorted({heads.start, heads.stop} | {h for h in heads if h % step == 0})
    return list(zip(cuts, cuts[1:]))


def _targets(prefill: CPLayout, decode: CPLayout, replica_offset: int, needs: bytes):
    """Per (decode rank, head piece) of one replica: the rank, its CP rank, the heads, and
    for every prefill CP rank the prefill TP rank to read from. ``needs[d, p]``: decode CP
    rank ``d`` takes tokens from prefill CP rank ``p`` (only those count as readers)."""
    need = np.frombuffer(needs, dtype=bool).reshape(decode.cp, prefill.cp)
    rows: list[tuple[int, int, int, int, list[int]]] = []
    readers: dict[tuple[int, int], int] = {}
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
    return (
        np.array([r[0] for r in rows], dtype=np.int64),  # rank
        np.array([r[1] for r in rows], dtype=np.int64),  # CP rank
        np.array([r[2] for r in rows], dtype=np.int64),  # first head
        np.array([r[3] for r in rows], dtype=np.int64),  # heads' end
        np.array([r[4] for r in rows], dtype=np.int64).reshape(len(rows), prefill.cp),  # source TP rank
    )


def period_plan(
    prefill: CPLayout,
    decode: CPLayout,
    prefill_dp_rank: int,
    decode_dp_rank: int,
    replica_offset: int,
    num_tokens: int,
    need: bytes | None = None,
) -> TransferPlan:
    """The plan of tokens ``0 .. num_tokens - 1`` worked out token by token, block-table
    indices for block ids (a shape); ``need`` (``TransferPlan.need`` of a longer plan)
    fixes which decode CP ranks count as readers of which prefill CP rank's tokens."""
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
    columns = {
        "decode_rank": d_base + t_rank[target],
        "prefill_rank": p_base + (p_cp // prefill.dcp) * prefill.tp + src_tp,
        "src_block": g_src[group],
        "dst_block": g_dst[group],
        "head0": t_h0[target],
        "head1": t_h1[target],
        "token_start": starts[group],
        "token_count": counts[group],
        "runs_start": group_runs[group],
        "runs_count": group_run_count[group],
        "group": np.zeros(group.size, dtype=np.int64),
    }
    return TransferPlan(
        prefill,
        decode,
        num_tokens,
        prefill_dp_rank,
        decode_dp_rank,
        replica_offset,
        read_rows=_stacked([columns[name] for name in READ_ROWS]),
        token_rows=_stacked([positions, src_offsets, dst_offsets]),
        run_rows=_stacked([run_token, run_length]),
        need=need,
    )


def _stacked(rows: list) -> np.ndarray:
    return _read_only(np.stack(rows).astype(np.int64, copy=False).reshape(len(rows), -1))


def _row_vector(rows: tuple[str, ...], **values: int) -> np.ndarray:
    vector = np.zeros((len(rows), 1), dtype=np.int64)
    for name, value in values.items():
        vector[rows.index(name)] = value
    return _read_only(vector)


# a request's DP replicas on both sides and its replica offset (modulo the replica period)
Replicas = tuple[int, int, int]


def _keep_nothing(key: Hashable, make: Callable[[], TransferPlan]) -> TransferPlan:
    return make()


class PlanShapes:
    """A layout pair that ``check_pair`` passed, and the shapes its requests' plans are
    made of: the plan of one period, of whole periods, of a partial last period.
    ``keep(key, make)`` answers ``make()`` or what it kept under ``key`` (its owner decides
    what it keeps and for how long; by default nothing is kept)."""

    def __init__(
        self,
        prefill: CPLayout,
        decode: CPLayout,
        keep: Callable[[Hashable, Callable[[], TransferPlan]], TransferPlan] = _keep_nothing,
    ):
        check_pair(prefill, decode)
        self.prefill, self.decode = prefill, decode
        self.cycle = period(prefill, decode)
        self.virtual_block_sizes = (prefill.virtual_block_size, decode.virtual_block_size)
        self.replica_period = _replica_period(prefill)
        self._keep = keep

    # -- shapes ---------------------------------------------------------------------
    def _period(self, replicas: Replicas, tokens: int) -> tuple[Hashable, TransferPlan]:
        key = ("period", *replicas, tokens)
        return key, self._keep(key, lambda: period_plan(self.prefill, self.decode, *replicas, tokens))

    def _steps(self, full: TransferPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """How far each row of the three matrices moves from one period to the next: block
        indices by the blocks of a period, positions by the period, token and run columns by
        the full period's (column vectors, one per matrix)."""
        size_p, size_d = self.virtual_block_sizes
        tokens, runs = full.token_rows.shape[1], full.run_rows.shape[1]
        return (
            _row_vector(
                READ_ROWS,
                src_block=self.cycle // size_p,
                dst_block=self.cycle // size_d,
                token_start=tokens,
                runs_start=runs,
            ),
            _row_vector(TOKEN_ROWS, positions=self.cycle),
            _row_vector(RUN_ROWS, run_token=tokens),
        )

    def _whole(self, replicas: Replicas, copies: int) -> tuple[Hashable, TransferPlan]:
        """The shape of ``copies`` whole periods (requests of as many blocks share it)."""
        if copies == 1:
            return self._period(replicas, self.cycle)

        def make() -> TransferPlan:
            full = self._period(replicas, self.cycle)[1]
            k = np.arange(copies, dtype=np.int64)
            rows = [
                _read_only((m[:, None, :] + step[:, :, None] * k[None, :, None]).reshape(m.shape[0], -1))
                for m, step in zip(_matrices(full), self._steps(full))
            ]
            return _with_matrices(full, rows, num_tokens=copies * self.cycle)

        key = ("periods", *replicas, copies)
        return key, self._keep(key, make)

    def _partial(self, replicas: Replicas, tokens: int) -> tuple[Hashable, TransferPlan]:
        """A last period of ``tokens`` tokens. It keeps the full period's readers (``need``),
        so its reads are the full period's, cut short."""
        key = ("partial", *replicas, tokens)

        def make() -> TransferPlan:
            need = self._period(replicas, self.cycle)[1].need
            return period_plan(self.prefill, self.decode, *replicas, tokens, need=need)

        return key, self._keep(key, make)

    # -- a request's plan -----------------------------------------------------------------
    def plan(
        self,
        num_tokens: int,
        prefill_block_ids: Sequence[int] | np.ndarray,
        decode_block_ids: Sequence[int] | np.ndarray,
        prefill_dp_rank: int = 0,
        decode_dp_rank: int = 0,
        replica_offset: int = 0,
        group: int = 0,
    ) -> TransferPlan:
        """Plan one request's pull: ``num_tokens`` tokens, the request's block tables on both
        sides (``*_block_ids[i]`` is block-table entry ``i``), and the DP replicas holding it.
        Raises ``LayoutError`` (one line, naming the constraint) for plans that cannot be made."""
        if num_tokens < 0:
            raise LayoutError(f"num_tokens must be non-negative, got {num_tokens}")
        for side, dp_rank, layout in (
            ("prefill", prefill_dp_rank, self.prefill),
            ("decode", decode_dp_rank, self.decode),
        ):
            if not 0 <= dp_rank < layout.dp:
                raise LayoutError(f"{side} dp_rank {dp_rank} is outside data_parallel_size {layout.dp}")
        size_p, size_d = self.virtual_block_sizes
        need_p, need_d = -(-num_tokens // size_p), -(-num_tokens // size_d)
        if len(prefill_block_ids) < need_p or len(decode_block_ids) < need_d:
            raise LayoutError(
                f"{num_tokens} tokens need {need_p} prefill blocks ({size_p} tokens each) "
                f"and {need_d} decode blocks ({size_d} tokens each), got "
                f"{len(prefill_block_ids)} and {len(decode_block_ids)}"
            )
        src_ids = np.asarray(prefill_block_ids, dtype=np.int64)
        dst_ids = np.asarray(decode_block_ids, dtype=np.int64)
        replicas: Replicas = (prefill_dp_rank, decode_dp_rank, replica_offset % self.replica_period)

        def piece(made: tuple[Hashable, TransferPlan], periods: int = 0) -> Piece:
            shift = periods * self.cycle
            return Piece(made[0], made[1], group, src_ids, dst_ids, shift // size_p, shift // size_d, shift)

        if num_tokens < self.cycle:
            pieces = [piece(self._period(replicas, num_tokens))]
            rows = list(_matrices(pieces[0].shape))
        else:
            copies, rest = divmod(num_tokens, self.cycle)
            pieces = [piece(self._whole(replicas, copies))]
            rows = list(_matrices(pieces[0].shape))
            if rest:  # the partial last period, moved ``copies`` periods on and appended
                pieces.append(piece(self._partial(replicas, rest), copies))
                full = self._period(replicas, self.cycle)[1]
                rows = [
                    np.concatenate([w, p + copies * step], axis=1)
                    for w, p, step in zip(rows, _matrices(pieces[1].shape), self._steps(full))
                ]
        reads = rows[0] if rows[0].flags.writeable else rows[0].copy()  # a kept shape's: copied
        reads[_SRC] = src_ids[reads[_SRC]]
        reads[_DST] = dst_ids[reads[_DST]]
        if group:
            reads[_GROUP] = group
        shape = pieces[0].shape
        return TransferPlan(
            self.prefill,
            self.decode,
            num_tokens,
            prefill_dp_rank,
            decode_dp_rank,
            replica_offset,
            _read_only(reads),
            _read_only(rows[1]),
            _read_only(rows[2]),
            shape.need,
            pieces=tuple(pieces),
        )

    def group_plan(
        self,
        num_tokens: int,
        prefill_tables: Sequence[Sequence[int] | np.ndarray],
        decode_tables: Sequence[Sequence[int] | np.ndarray],
        prefill_dp_rank: int = 0,
        decode_dp_rank: int = 0,
        replica_offset: int = 0,
    ) -> TransferPlan:
        """One request's pull over every KV-cache group: ``*_tables[g]`` is group ``g``'s block
        table on each side. Tokens whose decode block is the null block are not read (the group
        keeps nothing there); a token the decode side keeps but the prefill side does not is a
        ``LayoutError``. Read ids run over all groups; ``TransferPlan.group`` tells them apart."""
        if len(prefill_tables) != len(decode_tables):
            raise LayoutError(
                f"the prefill instance sent block tables for {len(prefill_tables)} KV-cache groups, "
                f"this instance has {len(decode_tables)}: run both with the same hybrid KV-cache "
                "manager setting (--disable-hybrid-kv-cache-manager on both or neither)"
            )
        parts = []
        for g, (src, dst) in enumerate(zip(prefill_tables, decode_tables)):
            plan = self.plan(num_tokens, src, dst, prefill_dp_rank, decode_dp_rank, replica_offset, group=g)
            if _holds_null(src) or _holds_null(dst):  # a windowed group's tables (else nothing to drop)
                needed = plan.dst_block != NULL_BLOCK
                lost = needed & (plan.src_block == NULL_BLOCK)
                if lost.any():
                    first = int(plan.first_position[lost].min())
                    raise LayoutError(
                        f"KV-cache group {g}: the prefill instance kept no block for token {first}, "
                        "which this instance needs (the two sides disagree on the group's window)"
                    )
                if not needed.all():  # still made of its pieces, less their reads into the null block
                    pieces = tuple(dataclasses.replace(p, skip_null=True) for p in plan.pieces)
                    plan = dataclasses.replace(plan.subset(needed), pieces=pieces)
            parts.append(plan)
        return _join(parts) if len(parts) != 1 else parts[0]


def _matrices(plan: TransferPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return plan.read_rows, plan.token_rows, plan.run_rows


def _with_matrices(template: TransferPlan, rows: list, **fields) -> TransferPlan:
    return dataclasses.replace(
        template, read_rows=rows[0], token_rows=rows[1], run_rows=rows[2], pieces=(), **fields
    )


def _holds_null(block_ids) -> bool:
    """A block table (a list, as the wire carries it, or an array) with the null block in it."""
    if isinstance(block_ids, np.ndarray):
        return not block_ids.all()  # one reduction: the null block, 0, is the only falsy id
    return NULL_BLOCK in block_ids


def _join(plans: list[TransferPlan]) -> TransferPlan:
    """The reads of several plans of one request (one per KV-cache group) as one plan."""
    if not plans:
        raise LayoutError("a request with no KV-cache group has nothing to transfer")
    token_base = run_base = 0
    parts: tuple[list, list, list] = ([], [], [])
    for plan in plans:  # each plan's columns moved past the plans before it
        reads, tokens, runs = _matrices(plan)
        parts[0].append(reads + _row_vector(READ_ROWS, token_start=token_base, runs_start=run_base))
        parts[1].append(tokens)
        parts[2].append(runs + _row_vector(RUN_ROWS, run_token=token_base))
        token_base += tokens.shape[1]
        run_base += runs.shape[1]
    rows = [_read_only(np.concatenate(matrices, axis=1)) for matrices in parts]
    joined = _with_matrices(plans[0], rows, num_groups=len(plans))
    return dataclasses.replace(joined, pieces=tuple(p for plan in plans for p in plan.pieces))


def build_plan(
    prefill: CPLayout,
    decode: CPLayout,
    num_tokens: int,
    prefill_block_ids: Sequence[int] | np.ndarray,
    decode_block_ids: Sequence[int] | np.ndarray,
    prefill_dp_rank: int = 0,
    decode_dp_rank: int = 0,
    replica_offset: int = 0,
) -> TransferPlan:
    """``PlanShapes.plan`` of a layout pair, keeping nothing (the inspector; tests)."""
    return PlanShapes(prefill, decode).plan(
        num_tokens, prefill_block_ids, decode_block_ids, prefill_dp_rank, decode_dp_rank, replica_offset
    )


def build_group_plan(
    prefill: CPLayout,
    decode: CPLayout,
    num_tokens: int,
    prefill_tables: Sequence[Sequence[int] | np.ndarray],
    decode_tables: Sequence[Sequence[int] | np.ndarray],
    prefill_dp_rank: int = 0,
    decode_dp_rank: int = 0,
    replica_offset: int = 0,
) -> TransferPlan:
    """``PlanShapes.group_plan`` of a layout pair, keeping nothing."""
    return PlanShapes(prefill, decode).group_plan(
        num_tokens, prefill_tables, decode_tables, prefill_dp_rank, decode_dp_rank, replica_offset
    )


if __name__ == "__main__":
    import sys

    # The inspector (which imports this module) is the command; say where it went.
    sys.exit("the plan inspector is `python -m vllm.ascend.kv_transfer.inspector` (same arguments)")
