"""Byte addressing of a P/D pull (pure): which byte ranges a decode rank copies from a
prefill rank for the reads of a plan, given both ranks' KV planes.

A plane (attention/kv_layout.py) is ``num_blocks`` blocks, each ``heads`` x ``head_bytes``
(head-major: one head's slots of a block are contiguous, ``head_bytes / block_size``
bytes per slot). A read of heads ``[h0, h1)`` and a run of slots becomes, per layer and
plane, one range per head; ranges contiguous on both sides are merged.
"""

from __future__ import annotations

import numpy as np

from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.transport import Region, TransferError


def plane_table(mine: dict, theirs: list, group: int = 0) -> tuple[list, list]:
    """Per layer and plane, ``(plane start, block bytes, head bytes)`` on the prefill side
    (``theirs``: RankInfo layers) and here (``mine``: name -> (base, LayerLayout), the
    layers of KV-cache group ``group``), matched by layer name."""
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
    return src, dst


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
    s = np.asarray(src, dtype=np.int64)
    d = np.asarray(dst, dtype=np.int64)
    slot = s[:, 2] // block_sizes[0]
    if np.any(slot != d[:, 2] // block_sizes[1]):
        raise ValueError("prefill and decode store a head's token with different sizes: not the same model")
    # the reads' runs (the plan keeps them: no per-token work here)
    counts = plan.runs_count[ids].astype(np.int64)
    run_read = np.repeat(np.arange(ids.size), counts)
    before = np.r_[0, np.cumsum(counts)[:-1]]
    run_row = np.arange(run_read.size) + np.repeat(plan.runs_start[ids] - before, counts)
    first_token = plan.run_token[run_row]
    run_len = plan.run_length[run_row]
    src_first, dst_first = plan.src_offsets[first_token], plan.dst_offsets[first_token]
    # each run once per head of its read
    h0 = plan.head0[ids][run_read]
    heads = plan.head1[ids][run_read] - h0
    run = np.repeat(np.arange(run_read.size), heads)
    head = h0[run] + np.arange(run.size) - np.repeat(np.r_[0, np.cumsum(heads)[:-1]], heads)
    read = run_read[run]
    remote = (
        s[:, :1]
        + plan.src_block[ids][read] * s[:, 1:2]
        + (head - src_head0) * s[:, 2:3]
        + src_first[run] * slot[:, None]
    )
    local = (
        d[:, :1]
        + plan.dst_block[ids][read] * d[:, 1:2]
        + (head - dst_head0) * d[:, 2:3]
        + dst_first[run] * slot[:, None]
    )
    lengths = run_len[run] * slot[:, None]
    return merge_ranges(local.ravel(), remote.ravel(), lengths.ravel())


def decode_rank_ranges(
    plan, global_rank: int, first_token: int, tp_rank: int, tables, whole_blocks: bool = False
):
    """What one decode rank (``global_rank``, TP rank ``tp_rank``) copies for ``plan``: per
    prefill rank it reads from, ``(prefill rank in its replica, local addresses, remote
    addresses, lengths)``, every KV-cache group in one batch. Reads of tokens before
    ``first_token`` (cached here already) are skipped. ``tables(rank_in_replica)`` gives
    that prefill rank's plane tables per group, ``(src, dst)`` (``plane_table``), or None to
    read nothing from it now; a group with no rows is skipped (layer-wise: some layers)."""
    mine = _reads_of(plan, global_rank, first_token)
    p_base = plan.prefill_ranks.start
    d_heads = plan.decode.heads(tp_rank).start
    block_sizes = (plan.prefill.block_size, plan.decode.block_size)
    for p in np.unique(plan.prefill_rank[mine]).tolist():
        tabled = tables(p - p_base)
        if tabled is None:
            continue
        src, dst = tabled
        p_heads = plan.prefill.heads((p - p_base) % plan.prefill.tp).start
        from_p = mine[plan.prefill_rank[mine] == p]
        parts = [
            read_ranges(
                plan,
                from_p[plan.group[from_p] == g],
                src[g],
                dst[g],
                p_heads,
                d_heads,
                block_sizes,
                whole_blocks,
            )
            for g in np.unique(plan.group[from_p]).tolist()
            if src[g]
        ]
        if not parts:
            continue
        yield (p - p_base, *(np.concatenate([part[k] for part in parts]) for k in range(3)))


def _reads_of(plan, global_rank: int, first_token: int) -> np.ndarray:
    mine = plan.read_ids_of(global_rank)
    return mine[plan.first_position[mine] >= first_token]


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


def merge_ranges(local: np.ndarray, remote: np.ndarray, lengths: np.ndarray):
    if local.size == 0:
        return local, remote, lengths
    ends_l, ends_r = local[:-1] + lengths[:-1], remote[:-1] + lengths[:-1]
    start = np.r_[True, (ends_l != local[1:]) | (ends_r != remote[1:])]
    first = np.flatnonzero(start)
    return local[first], remote[first], np.add.reduceat(lengths, first)
