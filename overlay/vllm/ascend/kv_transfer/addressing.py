"""Byte addressing of a P/D pull (pure): which byte ranges a decode rank copies from a
prefill rank for the reads of a plan, given both ranks' KV planes.

A plane (attention/kv_layout.py) is ``num_blocks`` blocks, each ``heads`` x ``head_bytes``
(head-major: one head's slots of a block are contiguous, ``head_bytes / block_size``
bytes per slot). A read of heads ``[h0, h1)`` and a run of slots becomes, per layer and
plane, one range per head; ranges contiguous on both sides are merged. A whole pull's
ranges come from templates kept per plan piece (see ``_TEMPLATES``): only the block ids
are put in per request.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from vllm.ascend.kv_transfer import wire
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


# Facts about read-only plane tables (one prefill rank's, built once per connection), by
# the tables' identity. Each entry holds its tables, so no id is reused while it lives.
_TABLE_FACTS: dict = {}


def _of_tables(fact, tables: tuple, *args):
    """``fact(*tables, *args)``, worked out once per set of read-only tables."""
    if any(t.flags.writeable for t in tables):  # a table that may change: no memo
        return fact(*tables, *args)
    key = (fact, *map(id, tables), *args)
    hit = _TABLE_FACTS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], tables)):
        return hit[1]
    value = fact(*tables, *args)
    if len(_TABLE_FACTS) >= 1024:  # layer-wise subsets are new tables each time
        _TABLE_FACTS.clear()
    _TABLE_FACTS[key] = (tables, value)
    return value


def plane_layers(mine: dict, theirs: list) -> list[int]:
    """Per row of ``plane_table(mine, theirs)``, the index of its layer in ``theirs`` (the
    prefill rank's RankInfo layers, which layer-wise progress names by index)."""
    index = {layer.name: i for i, layer in enumerate(theirs)}
    return [index[name] for name, (_, layer) in mine.items() for _ in layer.planes]


def read_ranges(
    plan,
    read_ids,
    src: list,
    dst: list,
    src_head0: int,
    dst_head0: int,
    block_sizes: tuple[int, int],
    whole_blocks: bool = False,
):
    """(local addresses, remote addresses, lengths) of ``read_ids`` of ``plan`` (all from one
    prefill rank, whose first KV head is ``src_head0``; this rank's is ``dst_head0``).

    ``src``/``dst``: per layer and plane ``(plane start address, block bytes, head bytes)``.
    One range per plane, head and run of slots contiguous on both sides, computed for all
    reads at once from the plan's runs; neighbouring ranges contiguous on both sides are
    merged (a layer's consecutive blocks, where both sides' block ids are consecutive,
    become one range)."""
    ids = np.asarray(read_ids, dtype=np.int64).ravel()
    if whole_blocks:
        parts = [
            whole_block_ranges(
                (int(plan.head0[i]), int(plan.head1[i])),
                plan.runs(i),
                src,
                dst,
                int(plan.src_block[i]),
                int(plan.dst_block[i]),
                src_head0,
                dst_head0,
                block_sizes,
            )
            for i in ids.tolist()
        ]
        if parts:
            return tuple(np.concatenate([p[k] for p in parts]) for k in range(3))
    if ids.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    local, remote, lengths, _ = _range_matrix(plan, ids, s, d, s[:, :1], src_head0, dst_head0, block_sizes)
    return merge_ranges(local.ravel(), remote.ravel(), lengths.ravel())


def _range_matrix(plan, ids, s, d, src_starts, src_head0, dst_head0, block_sizes):
    """The ranges of reads ``ids`` before merging: (local, remote, lengths), each planes x
    (read, run, head) in read order, and per column the index of its read in ``ids`` (None:
    one column per read). ``src_starts``: the prefill planes' starts, planes x 1
    or planes x columns (several prefill ranks, which differ only there); ``src_head0``:
    the prefill rank's first KV head, or per read."""
    slot, src_heads, dst_heads = _of_tables(_pair_facts, (s, d), block_sizes)
    counts = plan.runs_count[ids]
    h0 = plan.head0[ids]
    heads = plan.head1[ids] - h0
    if counts.max() == 1 and heads.max() == 1:  # one run of one head per read: no expansion
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
    src_block, dst_block = plan.src_block[ids], plan.dst_block[ids]
    if read is not None:
        src_block, dst_block = src_block[read], dst_block[read]
        if np.ndim(src_head0):
            src_head0 = src_head0[read]
    if src_starts.shape[1] > 1 and read is not None:  # per read (several prefill ranks)
        src_starts = src_starts[:, read]
    lengths = slot[:, None] * plan.run_length[run_row]
    # in slots: block, head and slot per column, planes' block and head sizes per row
    remote = _addresses(
        src_starts, s, slot, block_sizes[0], src_heads, src_block, head - src_head0, plan.src_offsets[first]
    )
    local = _addresses(
        d[:, :1], d, slot, block_sizes[1], dst_heads, dst_block, head - dst_head0, plan.dst_offsets[first]
    )
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

    return _frozen(slot), common_heads(s, block_sizes[0]), common_heads(d, block_sizes[1])


def _addresses(starts, table, slot, block_size, heads_per_block, block, head, offset):
    """planes x columns addresses: plane start + block x block bytes + head x head bytes +
    slot x slot bytes. When every plane has as many heads per block, one product."""
    if heads_per_block:
        column = (block * heads_per_block + head) * block_size + offset
        return starts + slot[:, None] * column
    return starts + block * table[:, 1:2] + head * table[:, 2:3] + offset * slot[:, None]


def decode_rank_ranges(
    plan,
    global_rank: int,
    first_token: int,
    tp_rank: int,
    tables,
    whole_blocks: bool = False,
    stable_tables: bool = False,
):
    """What one decode rank (``global_rank``, TP rank ``tp_rank``) copies for ``plan``: per
    prefill rank it reads from, ``(prefill rank in its replica, local addresses, remote
    addresses, lengths)``, every KV-cache group in one batch. Reads of tokens before
    ``first_token`` (cached here already) are skipped. ``tables(rank_in_replica)`` gives
    that prefill rank's plane tables per group, ``(src, dst)`` (``plane_table``), or None to
    read nothing from it now; a group with no rows is skipped (layer-wise: some layers).

    The same ranges as ``read_ranges`` per prefill rank, worked out for all of them at
    once where their tables differ only in where the planes start (one rank's layout).
    ``stable_tables``: ``tables`` gives the same read-only arrays on every call (a whole
    pull, not layer-wise), so the ranges come from templates kept per plan shape (below)."""
    if stable_tables and not whole_blocks:
        batches = _from_templates(plan, global_rank, first_token, tp_rank, tables)
        if batches is not None:
            yield from batches
            return
    mine = _reads_of(plan, global_rank, first_token)
    if not mine.size:
        return
    p_base = plan.prefill_ranks.start
    d_heads = plan.decode.heads(tp_rank).start
    block_sizes = (plan.prefill.block_size, plan.decode.block_size)
    p_of = plan.prefill_rank[mine]
    if (p_of[1:] < p_of[:-1]).any():
        order = np.argsort(p_of, kind="stable")  # by prefill rank, in read order within one
        mine, p_of = mine[order], p_of[order]
    starts = [0, *(np.flatnonzero(p_of[1:] != p_of[:-1]) + 1).tolist()]
    bounds = {int(p_of[a]): (a, b) for a, b in zip(starts, [*starts[1:], mine.size])}
    tabled = {p: tables(p - p_base) for p in bounds}
    groups = plan.group[mine] if plan.num_groups > 1 else None
    parts: dict[int, list] = {p: [] for p in bounds}
    for g in range(plan.num_groups):
        by_rank = {
            p: (
                mine[a:b] if groups is None else mine[a:b][groups[a:b] == g],
                t[0][g],
                t[1][g],
                plan.prefill.heads((p - p_base) % plan.prefill.tp).start,
            )
            for p, (a, b) in bounds.items()
            if (t := tabled[p]) is not None and len(t[0][g])
        }
        by_rank = {p: v for p, v in by_rank.items() if v[0].size}
        if not by_rank:  # layer-wise: none of this group's layers is ready yet
            continue
        if whole_blocks or len(by_rank) == 1:
            rank_starts = None
        else:  # the ranks' plane starts when they share one layout
            rank_starts = _of_tables(_one_layout_starts, tuple(t for v in by_rank.values() for t in v[1:3]))
        if rank_starts is None:
            for p, (ids, src, dst, p_heads) in by_rank.items():
                parts[p].append(read_ranges(plan, ids, src, dst, p_heads, d_heads, block_sizes, whole_blocks))
            continue
        for p, part in zip(
            by_rank, _ranges_by_rank(plan, list(by_rank.values()), rank_starts, d_heads, block_sizes)
        ):
            parts[p].append(part)
    for p, pieces in parts.items():
        if len(pieces) == 1:
            yield (p - p_base, *pieces[0])
        elif pieces:
            yield (p - p_base, *(np.concatenate([piece[k] for piece in pieces]) for k in range(3)))


def _one_layout_starts(*tables) -> np.ndarray | None:
    """``tables``: src, dst of each of several prefill ranks in turn. Where the ranks' prefill
    tables differ only in their plane starts and their decode tables not at all, those
    starts as planes x ranks; else None."""
    src, dst = tables[0::2], tables[1::2]
    one = all(
        t.shape == src[0].shape and np.array_equal(t[:, 1:], src[0][:, 1:]) and np.array_equal(u, dst[0])
        for t, u in zip(src[1:], dst[1:])
    )
    return _frozen(np.stack([t[:, 0] for t in src], axis=1)) if one else None


def _ranges_by_rank(plan, by_rank: list, rank_starts, dst_head0: int, block_sizes: tuple[int, int]) -> list:
    """``read_ranges`` of several prefill ranks at once: ``by_rank`` lists per rank (its
    read ids, src table, dst table, first KV head), ``rank_starts`` their planes' starts
    (planes x ranks); per rank its merged ranges."""
    ids = np.concatenate([v[0] for v in by_rank])
    sizes = [v[0].size for v in by_rank]
    rank_of_read = np.repeat(np.arange(len(by_rank)), sizes)
    src_head0 = np.array([v[3] for v in by_rank], dtype=np.int64)[rank_of_read]
    local, remote, lengths, read = _range_matrix(
        plan,
        ids,
        by_rank[0][1],
        by_rank[0][2],
        rank_starts[:, rank_of_read],
        src_head0,
        dst_head0,
        block_sizes,
    )
    # each rank's columns are one slice (reads in rank order; a read's columns together):
    # the ranks' ranges rank after rank, merged in one pass that never joins two ranks
    first_reads = list(itertools.accumulate(sizes, initial=0))
    cuts = tuple(first_reads if read is None else np.searchsorted(read, first_reads).tolist())
    order, bounds = _rank_major(*local.shape, cuts)
    merged, edges = _merged(local.ravel()[order], remote.ravel()[order], lengths.ravel()[order], bounds)
    return [tuple(x[a:b] for x in merged) for a, b in zip(edges, edges[1:])]


@functools.lru_cache(maxsize=256)
def _rank_major(planes: int, columns: int, cuts: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The planes x columns matrix's flat indices with the column slices ``cuts`` one
    after another (each plane-major), and where each slice starts in that order."""
    grid = np.arange(planes * columns).reshape(planes, columns)
    order = _frozen(np.concatenate([grid[:, a:b].ravel() for a, b in zip(cuts, cuts[1:])]))
    return order, _frozen(planes * np.asarray(cuts, dtype=np.int64))


# Address templates. A request's plan is made of cached pieces (plan.py: the plan of its
# whole periods, and of its partial last period shifted on), whose reads name block-table
# indices; for a decode rank and stable plane tables, a piece's ranges are worked out once
# with every block at 0 (a template), and a request's are each range's template address
# plus its block id times its plane's block bytes: gathers and one multiply-add per side,
# whatever the layouts, instead of planning the ranges again.
_TEMPLATES: dict = {}
TEMPLATE_BYTES = 256 * 2**20  # kept at most (a 32k-token GQA prompt's is about 1.4 MiB)


@dataclasses.dataclass(frozen=True)
class _Template:
    """One piece's unmerged ranges for one decode rank, rank after rank (plane-major within
    a rank): addresses with every block at 0, and per range its block-table index and its
    plane's block bytes on each side."""

    ranks: tuple  # prefill ranks (global) read from, ascending
    bounds: tuple  # where each rank's ranges start, then the total
    tables: tuple  # the (src, dst) tables of each rank the template was made from
    local: np.ndarray
    remote: np.ndarray
    lengths: np.ndarray
    src_index: np.ndarray
    dst_index: np.ndarray
    src_bytes: np.ndarray
    dst_bytes: np.ndarray


_TEMPLATE_ARRAYS = ("local", "remote", "lengths", "src_index", "dst_index", "src_bytes", "dst_bytes")


def _from_templates(plan, global_rank: int, first_token: int, tp_rank: int, tables):
    """``decode_rank_ranges`` of a plan made of cached pieces, from their templates; None
    where templates do not apply (several KV-cache groups, a plan cut down, a prefix cached
    here that ends inside the partial last period, a rank with nothing to read now)."""
    made = plan.__dict__.get("_pieces")
    if made is None or plan.num_groups != 1:
        return None
    pieces, src_ids, dst_ids = made
    parts = []
    for piece, src_shift, dst_shift, piece_first in pieces:
        if piece_first and first_token > piece_first:
            return None  # the prefix cached here ends inside this (shifted) piece
        # a shifted piece's positions start at 0: every token of it is at or after first_token
        template = _template(piece, global_rank, 0 if piece_first else first_token, tp_rank, tables)
        if template is None:
            return None
        if template.ranks:
            parts.append((template, src_shift, dst_shift))
    p_base = plan.prefill_ranks.start
    ranks = sorted({p for template, *_ in parts for p in template.ranks})
    if not ranks:
        return []
    # each piece's ranges at once, then rank after rank (a rank's: each piece's, in order)
    addressed = []
    for template, src_shift, dst_shift in parts:
        src_index = template.src_index + src_shift if src_shift else template.src_index
        dst_index = template.dst_index + dst_shift if dst_shift else template.dst_index
        local = template.local + template.dst_bytes * dst_ids[dst_index]
        remote = template.remote + template.src_bytes * src_ids[src_index]
        addressed.append((template, local, remote))
    if len(addressed) == 1:
        template, local, remote = addressed[0]
        lengths, bounds = template.lengths, template.bounds
    else:
        columns, bounds = ([], [], []), [0]
        for p in ranks:
            size = 0
            for template, local, remote in addressed:
                if p in template.ranks:
                    i = template.ranks.index(p)
                    a, b = template.bounds[i], template.bounds[i + 1]
                    for column, values in zip(columns, (local, remote, template.lengths)):
                        column.append(values[a:b])
                    size += b - a
            bounds.append(bounds[-1] + size)
        local, remote, lengths = (np.concatenate(c) for c in columns)
    merged, edges = _merged(local, remote, lengths, np.asarray(bounds))
    return [(p - p_base, *(x[a:b] for x in merged)) for p, a, b in zip(ranks, edges, edges[1:])]


def _template(piece, global_rank: int, first_token: int, tp_rank: int, tables) -> _Template | None:
    """The piece's template for this decode rank, kept while the tables it was made from
    are the ones ``tables`` gives; None if some rank has nothing to give now."""
    key = (id(piece), global_rank, first_token, tp_rank)
    hit = _TEMPLATES.get(key)
    if hit is not None and hit[0] is piece:
        template = hit[1]
        current = []
        for p in template.ranks:
            t = tables(p - piece.prefill_ranks.start)
            if t is None or len(t[0]) != 1:
                return None
            current.append((t[0][0], t[1][0]))
        if all(a is c for pair, now in zip(template.tables, current) for a, c in zip(pair, now)):
            return template
    template = _make_template(piece, global_rank, first_token, tp_rank, tables)
    if template is not None:
        size = sum(getattr(template, f).nbytes for f in _TEMPLATE_ARRAYS)
        if len(_TEMPLATES) >= 256 or size + sum(entry[2] for entry in _TEMPLATES.values()) > TEMPLATE_BYTES:
            _TEMPLATES.clear()
        _TEMPLATES[key] = (piece, template, size)  # holds the piece: its id is not reused meanwhile
    return template


def _make_template(piece, global_rank: int, first_token: int, tp_rank: int, tables) -> _Template | None:
    mine = _reads_of(piece, global_rank, first_token)
    p_base = piece.prefill_ranks.start
    d_heads = piece.decode.heads(tp_rank).start
    block_sizes = (piece.prefill.block_size, piece.decode.block_size)
    at_zero = piece.with_columns(
        src_block=np.zeros_like(piece.src_block), dst_block=np.zeros_like(piece.dst_block)
    )
    p_of = piece.prefill_rank[mine]
    ranks, used, fields = [], [], [[] for _ in range(7)]
    bounds = [0]
    for p in np.unique(p_of).tolist():
        t = tables(p - p_base)
        if t is None or len(t[0]) != 1 or len(t[1]) != 1:
            return None
        src, dst = t[0][0], t[1][0]
        if not len(src):
            return None
        ids = mine[p_of == p]
        s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        p_heads = piece.prefill.heads((p - p_base) % piece.prefill.tp).start
        local, remote, lengths, read = _range_matrix(
            at_zero, ids, s, d, s[:, :1], p_heads, d_heads, block_sizes
        )
        column = ids if read is None else ids[read]
        planes = s.shape[0]
        for field, value in zip(
            fields,
            (
                local.ravel(),
                remote.ravel(),
                lengths.ravel(),
                np.tile(piece.src_block[column], planes),
                np.tile(piece.dst_block[column], planes),
                np.repeat(s[:, 1], column.size),
                np.repeat(d[:, 1], column.size),
            ),
        ):
            field.append(value)
        ranks.append(p)
        used.append((src, dst))
        bounds.append(bounds[-1] + local.size)
    arrays = [_frozen(np.concatenate(f)) if f else np.zeros(0, dtype=np.int64) for f in fields]
    return _Template(tuple(ranks), tuple(bounds), tuple(used), *arrays)


def _reads_of(plan, global_rank: int, first_token: int) -> np.ndarray:
    mine = plan.read_ids_of(global_rank)
    return mine[plan.first_position[mine] >= first_token] if first_token > 0 else mine


def decode_rank_sources(plan, global_rank: int, first_token: int) -> list[int]:
    """The prefill ranks (in their replica) one decode rank reads from for ``plan``."""
    mine = _reads_of(plan, global_rank, first_token)
    return (np.unique(plan.prefill_rank[mine]) - plan.prefill_ranks.start).tolist()


def whole_block_ranges(
    read_heads: tuple[int, int],
    runs: np.ndarray,
    src: list,
    dst: list,
    src_block: int,
    dst_block: int,
    src_head0: int,
    dst_head0: int,
    block_sizes: tuple[int, int],
):
    """The same read as whole blocks, for transports that move nothing smaller: allowed when
    the read's heads are all of both ranks' heads and every token sits in the same slot."""
    s = np.asarray(src, dtype=np.int64)
    d = np.asarray(dst, dtype=np.int64)
    heads = read_heads[1] - read_heads[0]
    if (
        block_sizes[0] != block_sizes[1]
        or np.any(runs[:, 1] != runs[:, 2])
        or read_heads[0] != src_head0
        or read_heads[0] != dst_head0
        or np.any(s[:, 1] != heads * s[:, 2])
        or np.any(d[:, 1] != heads * d[:, 2])
        or np.any(s[:, 1] != d[:, 1])
    ):
        raise TransferError(
            "the llmdatadist transport moves whole blocks only: prefill and decode need the "
            "same block size, KV heads per rank and context-parallel layout (or use transport "
            "'mooncake')"
        )
    return d[:, 0] + dst_block * d[:, 1], s[:, 0] + src_block * s[:, 1], s[:, 1].copy()


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


def plane_regions(layers) -> list[Region]:
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


def merge_ranges(local: np.ndarray, remote: np.ndarray, lengths: np.ndarray):
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
