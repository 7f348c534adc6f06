"""Byte addressing of a P/D pull (pure): which byte ranges a decode rank copies from a
prefill rank for the reads of a plan, given both ranks' KV planes.

A plane (attention/kv_layout.py) is ``num_blocks`` blocks, each ``heads`` x ``head_bytes``
(head-major: one head's slots of a block are contiguous, ``head_bytes / block_size``
bytes per slot). A read of heads ``[h0, h1)`` and a run of slots becomes, per layer and
plane, one range per head; ranges contiguous on both sides are merged.

One route from a plan to its ranges: a *template* per piece of the plan (plan.py: a
shape of block-table indices) and decode rank, its ranges with every block at 0 and per
range its block-table index and its plane's block bytes on each side; a request's ranges
are each template address plus its block id times the block bytes (gathers and one
multiply-add per side), rank after rank, merged. The planner of a prefill replica
(``planner.ReplicaPlanner``) keeps the templates of its shapes; layer-wise reads (some
layers at a time) make theirs for the layers they read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.plan import NULL_BLOCK, Piece, TransferPlan
from vllm.ascend.kv_transfer.transport import Region, TransferError


def plane_table(mine: dict, theirs: list, group: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and plane, ``(plane start, block bytes, head bytes)`` on the prefill side
    (``theirs``: RankInfo layers) and here (``mine``: name -> (base, LayerLayout), the
    layers of KV-cache group ``group``), matched by layer name: two read-only int64 arrays
    of one row per plane (built once per prefill rank; every pull indexes them)."""
    by_name = {layer.name: layer for layer in theirs}
    src, dst = [], []
    for name, (base, layer) in mine.items():
        their = by_name.get(name)
        if their is None or len(their.planes) != len(layer.planes):
            raise RuntimeError(
                f"the prefill instance has no KV layer {name!r} like this one: not the same model"
            )
        if their.group != group:
            raise RuntimeError(
                f"KV layer {name!r} is in KV-cache group {their.group} on the prefill instance and "
                f"{group} here: run both with the same hybrid KV-cache manager setting"
            )
        offset_s = 0
        for index, (plane, their_plane) in enumerate(zip(layer.planes, their.planes)):
            src.append(
                (their.base + offset_s, their_plane.heads * their_plane.head_bytes, their_plane.head_bytes)
            )
            dst.append((base + layer.plane_offset(index), plane.block_bytes, plane.head_bytes))
            offset_s += their_plane.heads * their_plane.head_bytes * their.num_blocks
    src_table, dst_table = (np.array(rows, dtype=np.int64).reshape(-1, 3) for rows in (src, dst))
    return _frozen(src_table), _frozen(dst_table)


def _frozen(table: np.ndarray) -> np.ndarray:
    table.setflags(write=False)  # read-only: what is worked out from it once stays true
    return table


def plane_layers(mine: dict, theirs: list) -> list[int]:
    """Per row of ``plane_table(mine, theirs)``, the index of its layer in ``theirs`` (the
    prefill rank's RankInfo layers, which layer-wise progress names by index)."""
    index = {layer.name: i for i, layer in enumerate(theirs)}
    return [index[name] for name, (_, layer) in mine.items() for _ in layer.planes]


@dataclasses.dataclass(frozen=True)
class RankTables:
    """One prefill rank's planes and this rank's, per KV-cache group: ``plane_table`` of
    each group's layers, and per row the index of its layer in the prefill rank's
    RankInfo (what layer-wise progress names)."""

    src: dict[int, np.ndarray]
    dst: dict[int, np.ndarray]
    layer_of_row: dict[int, list[int]]

    @classmethod
    def build(cls, mine_by_group: dict[int, dict], theirs: list) -> RankTables:
        """``mine_by_group[g]``: this rank's layers of group ``g`` (name -> (base, LayerLayout));
        ``theirs``: the prefill rank's RankInfo layers."""
        src, dst, rows = {}, {}, {}
        for g, mine in mine_by_group.items():
            src[g], dst[g] = plane_table(mine, theirs, group=g)
            rows[g] = plane_layers(mine, theirs)
        return cls(src, dst, rows)

    def only(self, layers: set) -> RankTables | None:
        """The tables restricted to these layers (None: none of them is read here)."""
        src, dst = {}, {}
        for g, rows in self.layer_of_row.items():
            keep = [i for i, layer in enumerate(rows) if layer in layers]
            src[g], dst[g] = self.src[g][keep], self.dst[g][keep]
        if not any(len(rows) for rows in src.values()):
            return None
        return RankTables(src, dst, self.layer_of_row)

    @property
    def layers(self) -> set:
        return {layer for rows in self.layer_of_row.values() for layer in rows}


@dataclasses.dataclass(frozen=True, eq=False)
class Template:
    """One shape's unmerged ranges for one decode rank, rank after rank (plane-major within
    a rank): addresses with every block at 0, and per range its block-table index and its
    plane's block bytes on each side."""

    ranks: tuple[int, ...]  # prefill ranks (global) read from, ascending
    bounds: tuple[int, ...]  # where each rank's ranges start, then the total
    local: np.ndarray
    remote: np.ndarray
    lengths: np.ndarray
    src_index: np.ndarray
    dst_index: np.ndarray
    src_bytes: np.ndarray
    dst_bytes: np.ndarray

    @property
    def nbytes(self) -> int:
        arrays = (self.local, self.remote, self.lengths, self.src_index, self.dst_index)
        return sum(a.nbytes for a in (*arrays, self.src_bytes, self.dst_bytes))


def make_template(
    shape: TransferPlan,
    decode_rank: int,
    tp_rank: int,
    first_token: int,
    group: int,
    tables: Callable[[int], RankTables | None],
    whole_blocks: bool = False,
) -> Template:
    """The ranges of ``shape``'s reads that decode rank ``decode_rank`` (TP rank ``tp_rank``)
    makes of tokens from ``first_token`` on, with every block at 0. ``tables(rank in
    replica)`` gives a prefill rank's tables, or None to read nothing from it now; a rank
    whose tables have no row of ``group`` is skipped too (layer-wise: some layers).
    ``whole_blocks``: one range per block and plane, for transports that move nothing smaller."""
    mine = _reads_of(shape, decode_rank, first_token)
    mine = mine[shape.group[mine] == group] if shape.num_groups > 1 else mine
    p_base = shape.prefill_ranks.start
    d_heads = shape.decode.heads(tp_rank).start
    block_sizes = (shape.prefill.block_size, shape.decode.block_size)
    p_of = shape.prefill_rank[mine]
    ranks: list[int] = []
    fields: list[list[np.ndarray]] = [[] for _ in range(7)]
    bounds = [0]
    for p in np.unique(p_of).tolist():
        t = tables(p - p_base)
        if t is None or not len(t.src.get(group, ())):
            continue
        s, d = t.src[group], t.dst[group]
        ids = mine[p_of == p]
        p_heads = shape.prefill.heads((p - p_base) % shape.prefill.tp).start
        if whole_blocks:
            local, remote, lengths, read = _whole_block_matrix(
                shape, ids, s, d, p_heads, d_heads, block_sizes
            )
        else:
            local, remote, lengths, read = _range_matrix(shape, ids, s, d, p_heads, d_heads, block_sizes)
        column = ids if read is None else ids[read]
        planes = s.shape[0]
        for field, value in zip(
            fields,
            (
                local.ravel(),
                remote.ravel(),
                lengths.ravel(),
                np.tile(shape.src_block[column], planes),
                np.tile(shape.dst_block[column], planes),
                np.repeat(s[:, 1], column.size),
                np.repeat(d[:, 1], column.size),
            ),
        ):
            field.append(value)
        ranks.append(p)
        bounds.append(bounds[-1] + local.size)
    arrays = [_frozen(np.concatenate(f)) if f else np.zeros(0, dtype=np.int64) for f in fields]
    return Template(tuple(ranks), tuple(bounds), *arrays)


def _range_matrix(plan, ids, s, d, src_head0: int, dst_head0: int, block_sizes):
    """The ranges of reads ``ids`` at block 0, before merging: (local, remote, lengths),
    each planes x (read, run, head) in read order, and per column the index of its read
    in ``ids`` (None: one column per read)."""
    slot, src_heads, dst_heads = _pair_facts(s, d, block_sizes)
    counts = plan.runs_count[ids]
    h0 = plan.head0[ids]
    heads = plan.head1[ids] - h0
    if not ids.size or (counts.max() == 1 and heads.max() == 1):  # one run of one head per read
        run_row, head, read = plan.runs_start[ids], h0, None
    else:  # each run of a read, once per head of the read
        counts = counts.astype(np.int64)
        run_read = np.repeat(np.arange(ids.size), counts)
        run_row = np.arange(run_read.size) + np.repeat(plan.runs_start[ids] - _starts(counts), counts)
        per_run = heads[run_read]
        run = np.repeat(np.arange(run_read.size), per_run)
        head = h0[run_read][run] + np.arange(run.size) - np.repeat(_starts(per_run), per_run)
        read = run_read[run]
        run_row = run_row[run]
    first = plan.run_token[run_row]
    lengths = slot[:, None] * plan.run_length[run_row]
    # in slots: head and slot per column, planes' block and head sizes per row
    remote = _addresses(s, slot, block_sizes[0], src_heads, head - src_head0, plan.src_offsets[first])
    local = _addresses(d, slot, block_sizes[1], dst_heads, head - dst_head0, plan.dst_offsets[first])
    return local, remote, lengths, read


def _pair_facts(s, d, block_sizes):
    """(bytes per slot per plane, heads per block of every src plane, of every dst plane):
    a count is 0 where the planes differ in it or a block is not heads x block size slots."""
    slot = s[:, 2] // block_sizes[0]
    if np.any(slot != d[:, 2] // block_sizes[1]):
        raise ValueError("prefill and decode store a head's token with different sizes: not the same model")

    def common_heads(table, block_size):
        if not len(table):
            return 0
        heads = table[:, 1] // table[:, 2]
        uniform = (heads == heads[0]).all() and (heads * table[:, 2] == table[:, 1]).all()
        return int(heads[0]) if uniform and (slot * block_size == table[:, 2]).all() else 0

    return slot, common_heads(s, block_sizes[0]), common_heads(d, block_sizes[1])


def _addresses(table, slot, block_size, heads_per_block, head, offset):
    """planes x columns addresses in block 0: plane start + head x head bytes + slot x slot
    bytes. When every plane has as many heads per block, one product."""
    if heads_per_block:
        return table[:, :1] + slot[:, None] * (head * block_size + offset)
    return table[:, :1] + head * table[:, 2:3] + offset * slot[:, None]


def _whole_block_matrix(plan, ids, s, d, src_head0: int, dst_head0: int, block_sizes):
    """The reads ``ids`` as whole blocks at block 0 (planes x reads), allowed when a read's
    heads are all of both ranks' heads and every token sits in the same slot."""
    tokens = np.concatenate(
        [np.arange(a, a + n) for a, n in zip(plan.token_start[ids].tolist(), plan.token_count[ids].tolist())]
        or [np.zeros(0, dtype=np.int64)]
    )
    heads = plan.head1[ids] - plan.head0[ids]
    if (
        block_sizes[0] != block_sizes[1]
        or np.any(plan.src_offsets[tokens] != plan.dst_offsets[tokens])
        or np.any(plan.head0[ids] != src_head0)
        or np.any(plan.head0[ids] != dst_head0)
        or np.any(s[:, 1:2] != heads * s[:, 2:3])
        or np.any(d[:, 1:2] != heads * d[:, 2:3])
        or np.any(s[:, 1] != d[:, 1])
    ):
        raise TransferError(
            "the llmdatadist transport moves whole blocks only: prefill and decode need the "
            "same block size, KV heads per rank and context-parallel layout (or use transport "
            "'mooncake')"
        )
    columns = np.zeros((1, ids.size), dtype=np.int64)
    return d[:, :1] + columns, s[:, :1] + columns, s[:, 1:2] + columns, None


def _reads_of(plan: TransferPlan, decode_rank: int, first_token: int) -> np.ndarray:
    mine = plan.read_ids_of(decode_rank)
    return mine[plan.first_position[mine] >= first_token] if first_token > 0 else mine


def decode_rank_sources(plan: TransferPlan, decode_rank: int, first_token: int) -> list[int]:
    """The prefill ranks (in their replica) one decode rank reads from for ``plan``."""
    mine = _reads_of(plan, decode_rank, first_token)
    return (np.unique(plan.prefill_rank[mine]) - plan.prefill_ranks.start).tolist()


def own_pieces(plan: TransferPlan) -> tuple[Piece, ...]:
    """What ``plan`` is made of; for a plan cut from another, itself (one piece per group,
    block ids in place of indices)."""
    if plan.pieces:
        return plan.pieces
    return tuple(
        Piece(None, plan.subset(plan.group == g) if plan.num_groups > 1 else plan, g, None, None)
        for g in range(plan.num_groups)
    )


def addressed(template: Template, piece: Piece) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """The template's ranges with the piece's block ids put in: (local, remote, lengths,
    bounds per rank), unmerged. A piece that skips the null block drops the ranges into it."""
    src_index = template.src_index + piece.src_shift if piece.src_shift else template.src_index
    dst_index = template.dst_index + piece.dst_shift if piece.dst_shift else template.dst_index
    src_ids = src_index if piece.src_ids is None else piece.src_ids[src_index]
    dst_ids = dst_index if piece.dst_ids is None else piece.dst_ids[dst_index]
    local = template.local + template.dst_bytes * dst_ids
    remote = template.remote + template.src_bytes * src_ids
    lengths, bounds = template.lengths, list(template.bounds)
    if piece.skip_null:
        keep = dst_ids != NULL_BLOCK
        if not keep.all():
            local, remote, lengths = local[keep], remote[keep], lengths[keep]
            bounds = np.r_[0, np.cumsum(keep)][bounds].tolist()
    return local, remote, lengths, bounds


def joined(parts: list[tuple[Template, Piece]], prefill_base: int) -> list:
    """The ranges of several pieces' templates: per prefill rank read from, ``(rank in
    replica, local addresses, remote addresses, lengths)``, each piece's ranges in order,
    merged (never across two ranks)."""
    addressed_parts = [(template.ranks, addressed(template, piece)) for template, piece in parts]
    ranks = sorted({p for rank_list, _ in addressed_parts for p in rank_list})
    if not ranks:
        return []
    if len(addressed_parts) == 1:
        local, remote, lengths, bounds = addressed_parts[0][1]
    else:
        columns: tuple[list, list, list] = ([], [], [])
        bounds = [0]
        for p in ranks:
            size = 0
            for rank_list, (a_local, a_remote, a_lengths, a_bounds) in addressed_parts:
                if p in rank_list:
                    i = rank_list.index(p)
                    a, b = a_bounds[i], a_bounds[i + 1]
                    for column, values in zip(columns, (a_local, a_remote, a_lengths)):
                        column.append(values[a:b])
                    size += b - a
            bounds.append(bounds[-1] + size)
        local, remote, lengths = (np.concatenate(c) for c in columns)
    sizes = np.diff(bounds)
    if not sizes.all():  # a rank all of whose ranges were into the null block
        ranks = [p for p, size in zip(ranks, sizes.tolist()) if size]
        bounds = [0, *np.cumsum(sizes[sizes > 0]).tolist()]
    if not ranks:
        return []
    merged, edges = _merged(local, remote, lengths, np.asarray(bounds))
    return [(p - prefill_base, *(x[a:b] for x in merged)) for p, a, b in zip(ranks, edges, edges[1:])]


def read_ranges(
    plan: TransferPlan,
    read_ids: Sequence[int] | np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    src_head0: int,
    dst_head0: int,
    block_sizes: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local addresses, remote addresses, lengths) of ``read_ids`` of ``plan``, all from
    one prefill rank (its first KV head ``src_head0``; this rank's ``dst_head0``) whose
    planes are ``src`` (``dst`` here): per layer and plane ``(plane start, block bytes,
    head bytes)``. The template of those reads with the plan's block ids put in, merged."""
    ids = np.asarray(read_ids, dtype=np.int64).ravel()
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    local, remote, lengths, read = _range_matrix(plan, ids, s, d, src_head0, dst_head0, block_sizes)
    column = ids if read is None else ids[read]
    local = local + d[:, 1:2] * plan.dst_block[column]
    remote = remote + s[:, 1:2] * plan.src_block[column]
    return merge_ranges(local.ravel(), remote.ravel(), np.broadcast_to(lengths, local.shape).ravel())


def layer_regions(layers: dict, layer_group: dict | None = None) -> list:
    """This rank's layers (name -> (base, LayerLayout)) as the handshake describes them,
    each with its KV-cache group (``layer_group``; None: all in group 0)."""
    return [
        wire.LayerRegion(
            name,
            base,
            layer.num_blocks,
            [wire.PlaneSpec(p.heads, p.head_bytes) for p in layer.planes],
            (layer_group or {}).get(name, 0),
        )
        for name, (base, layer) in layers.items()
    ]


def plane_regions(layers: Iterable[wire.LayerRegion]) -> list[Region]:
    """A rank's planes (from ``LayerRegion``s) as transport regions, each once (layers may
    share a cache)."""
    out = {}
    for layer in layers:
        offset = 0
        for plane in layer.planes:
            block_bytes = plane.heads * plane.head_bytes
            out[layer.base + offset] = Region(layer.base + offset, layer.num_blocks, block_bytes)
            offset += block_bytes * layer.num_blocks
    return list(out.values())


def _starts(counts: np.ndarray) -> np.ndarray:
    """Where each of consecutive groups of ``counts`` items starts (an exclusive cumsum)."""
    starts = np.zeros(counts.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    return starts


def merge_ranges(
    local: np.ndarray, remote: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Neighbouring ranges contiguous on both sides as one."""
    if local.size == 0:
        return local, remote, lengths
    return _merged(local, remote, lengths, np.array([0, local.size]))[0]


def _merged(local, remote, lengths, bounds: np.ndarray):
    """``merge_ranges`` over ranges in consecutive parts that start at ``bounds`` (ending with
    the total), never joining two parts: the merged ranges and where each part starts in them."""
    start = np.empty(local.size, dtype=bool)
    start[0] = True
    ends = local[:-1] + lengths[:-1]
    np.not_equal(ends, local[1:], out=start[1:])
    ends += remote[:-1] - local[:-1]  # the remote ends
    start[1:] |= ends != remote[1:]
    start[bounds[:-1]] = True
    first = np.flatnonzero(start)
    if first.size == local.size:  # nothing to merge (fragmented block ids)
        return (local, remote, lengths), bounds.tolist()
    merged = local[first], remote[first], np.add.reduceat(lengths, first)
    return merged, np.searchsorted(first, bounds).tolist()
