"""The planner of one connected prefill replica, as one decode rank pulls from it.

Built when the decode rank first meets the replica (its handshake), as NIXL builds a
transfer plan per remote engine: it owns the plan shapes of the layout pair (plan.py),
the plane tables of each prefill rank of the replica (both sides' planes, per KV-cache
group) and the address templates of its shapes for this rank (addressing.py), all kept
under one byte budget with the least recently used dropped first. A request's pull asks
it for the plan (``plan``) and for the byte ranges (``ranges``); nothing is kept at
module level, so two replicas, or two tests, never share or clear each other's state.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from vllm.ascend.context_parallel.placement import CPLayout
from vllm.ascend.kv_transfer.addressing import (
    RankTables,
    Template,
    decode_rank_sources,
    joined,
    make_template,
    own_pieces,
)
from vllm.ascend.kv_transfer.plan import PlanShapes, TransferPlan

# What one planner keeps at most. A 32k-token GQA prompt's shapes and templates take
# about 2 MiB; a deployment has one planner per prefill replica a decode rank pulls from
KEPT_BYTES = 64 * 2**20


class Kept:
    """Values made once and kept by key, least recently used dropped first past ``budget``
    bytes. Safe for the pull threads; a value is made outside the lock (making a template
    may connect a prefill rank), so two threads may make one at once and keep the first."""

    def __init__(self, budget: int):
        self.budget = budget
        self.nbytes = 0
        self.made = 0  # values made (how tests see reuse)
        self._values: OrderedDict = OrderedDict()  # key -> (value, its bytes)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def items(self) -> list[tuple[Hashable, object]]:
        """What is kept now, least recently used first."""
        with self._lock:
            return [(key, value) for key, (value, _) in self._values.items()]

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        with self._lock:
            hit = self._values.get(key)
            if hit is not None:
                self._values.move_to_end(key)
                return hit[0]
        value = make()
        size = _nbytes(value)
        with self._lock:
            hit = self._values.get(key)
            if hit is not None:  # another thread made it meanwhile
                return hit[0]
            self._values[key] = (value, size)
            self.made += 1
            self.nbytes += size
            while self.nbytes > self.budget and len(self._values) > 1:
                _, (_, dropped) = self._values.popitem(last=False)
                self.nbytes -= dropped
        return value


def _nbytes(value) -> int:
    if isinstance(value, Template):
        return value.nbytes
    if isinstance(value, TransferPlan):
        return value.read_rows.nbytes + value.token_rows.nbytes + value.run_rows.nbytes
    raise TypeError(f"a planner keeps plan shapes and address templates, not {type(value).__name__}")


class ReplicaPlanner:
    """Plans and addresses the pulls of decode rank ``decode_rank`` (global; TP rank
    ``tp_rank``) from one prefill replica of layout ``prefill``. ``connect(rank in
    replica)`` connects a prefill rank of the replica the first time it is read from and
    returns its plane tables."""

    def __init__(
        self,
        prefill: CPLayout,
        decode: CPLayout,
        decode_rank: int,
        tp_rank: int,
        connect: Callable[[int], RankTables],
        kept_bytes: int = KEPT_BYTES,
    ):
        self.kept = Kept(kept_bytes)
        self.shapes = PlanShapes(prefill, decode, keep=self.kept.get)
        self.decode_rank, self.tp_rank = decode_rank, tp_rank
        self._connect = connect
        self._tables: dict[int, RankTables] = {}
        self._connecting = threading.Lock()

    def tables(self, rank_in_replica: int) -> RankTables:
        """A prefill rank's plane tables, connected the first time."""
        tables = self._tables.get(rank_in_replica)
        if tables is None:
            with self._connecting:
                tables = self._tables.get(rank_in_replica)
                if tables is None:
                    tables = self._tables[rank_in_replica] = self._connect(rank_in_replica)
        return tables

    def plan(
        self,
        num_tokens: int,
        prefill_tables: Sequence[Sequence[int] | np.ndarray],
        decode_tables: Sequence[Sequence[int] | np.ndarray],
        prefill_dp_rank: int = 0,
        decode_dp_rank: int = 0,
        replica_offset: int = 0,
    ) -> TransferPlan:
        """A request's plan over every KV-cache group (``PlanShapes.group_plan``)."""
        return self.shapes.group_plan(
            num_tokens, prefill_tables, decode_tables, prefill_dp_rank, decode_dp_rank, replica_offset
        )

    def sources(self, plan: TransferPlan, first_token: int) -> list[int]:
        """The prefill ranks (in their replica) this rank reads from for ``plan``."""
        return decode_rank_sources(plan, self.decode_rank, first_token)

    def ranges(
        self,
        plan: TransferPlan,
        first_token: int = 0,
        layers: dict[int, set] | None = None,
        whole_blocks: bool = False,
    ) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """What this rank copies for ``plan``: per prefill rank it reads from, ``(rank in
        replica, local addresses, remote addresses, lengths)``, every KV-cache group in one
        batch. Reads of tokens before ``first_token`` (cached here already) are skipped.
        ``layers``: only these layers of these prefill ranks (rank in replica -> layer
        indices in its RankInfo; layer-wise); ``whole_blocks``: whole blocks only."""

        def tables(rank_in_replica: int) -> RankTables | None:
            if layers is None:
                return self.tables(rank_in_replica)
            if rank_in_replica not in layers:
                return None
            return self.tables(rank_in_replica).only(layers[rank_in_replica])

        parts = []
        for piece in own_pieces(plan):
            # the piece's reads of tokens from ``first_token`` on (its positions start at 0)
            first = max(0, first_token - piece.first_position)

            def make(piece=piece, first=first) -> Template:
                return make_template(
                    piece.shape, self.decode_rank, self.tp_rank, first, piece.group, tables, whole_blocks
                )

            if layers is None and piece.key is not None:  # a whole pull: the replica's tables
                template = self.kept.get(("template", piece.key, piece.group, first, whole_blocks), make)
            else:
                template = make()
            if template.ranks:
                parts.append((template, piece))
        return joined(parts, plan.prefill_ranks.start)
