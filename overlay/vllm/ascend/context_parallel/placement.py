"""Where each token's KV lives under context parallelism: the one placement rule.

Pure (no process groups, no device): the model runner's slot mapping, the attention
backends' gathers and the P/D transfer planner all call it, so what is stored and what
is planned cannot drift apart.

A layout is TP x PCP x DCP (x DP) with an interleave size ``I`` and a KV block size
``B``. One sequence's KV is spread over the ``CP = PCP x DCP`` ranks of a
context-parallel group; context-parallel rank ``c = pcp_rank x DCP + dcp_rank``.

* Owner: token ``t`` belongs to CP rank ``(t // I) % CP`` (runs of ``I`` consecutive
  tokens go round robin over the group).
* Block: the scheduler hands out blocks of ``B x CP`` tokens (a virtual block); every
  CP rank uses the same block id for its ``B`` tokens of it. Token ``t`` is in the
  request's block-table entry ``t // (B x CP)``.
* Offset: inside the virtual block, with ``o = t % (B x CP)``, the owner stores it at
  ``(o // (CP x I)) x I + o % I``, so each rank's tokens stay in position order.

Ranks: DCP groups are consecutive TP ranks (``dcp_rank = tp_rank % DCP``), and within
one DP replica rank ``pcp_rank x TP + tp_rank`` (upstream's PP=1 rank order). A token's
KV is held by the TP ranks of its PCP rank whose ``tp_rank % DCP`` is its DCP rank: for
MLA every one of them holds the single latent head (``TP / DCP`` replicas); for GQA
each holds the KV heads of its TP rank (with TP > KV heads a head lives on ``TP / KV``
consecutive ranks, so it needs ``DCP`` to divide ``TP / KV``).
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A context-parallel layout that cannot be built; the message names the constraint."""


@dataclass(frozen=True)
class RankLayout:
    """One rank's place in its context-parallel group (``CPLayout.rank_of``)."""

    pcp: int = 1
    pcp_rank: int = 0
    dcp: int = 1
    dcp_rank: int = 0
    interleave: int = 1

    @property
    def cp(self) -> int:
        return self.pcp * self.dcp

    @property
    def cp_rank(self) -> int:
        return self.pcp_rank * self.dcp + self.dcp_rank


@dataclass(frozen=True)
class CPLayout:
    tp: int = 1
    pcp: int = 1
    dcp: int = 1
    dp: int = 1
    interleave: int = 1
    block_size: int = 128
    kv_heads: int | None = None  # None: MLA (one latent head, the same on every TP rank)

    @property
    def mla(self) -> bool:
        return self.kv_heads is None

    @property
    def cp(self) -> int:
        return self.pcp * self.dcp

    @property
    def virtual_block_size(self) -> int:
        return self.block_size * self.cp

    @property
    def ranks_per_replica(self) -> int:
        """Ranks of one DP replica (PP=1)."""
        return self.pcp * self.tp

    def check(self) -> CPLayout:
        """This layout, or a LayoutError naming the first constraint it breaks."""
        for name in ("tp", "pcp", "dcp", "dp", "interleave", "block_size"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.tp % self.dcp:
            raise LayoutError(
                f"decode_context_parallel_size {self.dcp} must divide tensor_parallel_size "
                f"{self.tp}: DCP ranks are TP ranks"
            )
        if self.block_size % self.interleave:
            raise LayoutError(
                f"cp_kv_cache_interleave_size {self.interleave} must divide the block size {self.block_size}"
            )
        if self.kv_heads is not None:
            kv = self.kv_heads
            if kv < 1:
                raise LayoutError(f"kv_heads must be at least 1, got {kv}")
            if kv % self.tp and self.tp % kv:
                raise LayoutError(
                    f"tensor_parallel_size {self.tp} and the model's {kv} KV heads must divide one another"
                )
            if self.dcp > 1 and self.tp % (kv * self.dcp):
                raise LayoutError(
                    f"decode_context_parallel_size {self.dcp} needs every KV head on at least {self.dcp} "
                    f"TP ranks: tensor_parallel_size {self.tp} must be a multiple of KV heads {kv} x DCP "
                    f"{self.dcp}"
                )
        return self

    # -- ranks and heads --------------------------------------------------------------
    def rank_of(self, pcp_rank: int, tp_rank: int) -> RankLayout:
        return RankLayout(self.pcp, pcp_rank, self.dcp, tp_rank % self.dcp, self.interleave)

    def cp_rank(self, pcp_rank: int, tp_rank: int) -> int:
        return self.rank_of(pcp_rank, tp_rank).cp_rank

    def rank(self, pcp_rank: int, tp_rank: int) -> int:
        """Rank inside one DP replica; globally ``dp_rank x ranks_per_replica + rank``."""
        return pcp_rank * self.tp + tp_rank

    def heads(self, tp_rank: int) -> range:
        """The KV heads a TP rank holds (MLA: its one latent head)."""
        if self.kv_heads is None:
            return range(1)
        if self.tp >= self.kv_heads:
            head = tp_rank // (self.tp // self.kv_heads)
            return range(head, head + 1)
        per_rank = self.kv_heads // self.tp
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)

    def cp_group_tp_ranks(self, tp_rank: int) -> list[int]:
        """The TP ranks of ``tp_rank``'s DCP group (same heads, same PCP rank)."""
        first = tp_rank - tp_rank % self.dcp
        return list(range(first, first + self.dcp))


# -- the rule (works on ints and on integer tensors alike) --------------------------------
def owner(position, cp: int, interleave: int):
    """Context-parallel rank that stores ``position``."""
    return (position // interleave) % cp


def local_slot(position, cp: int, interleave: int):
    """Index of ``position`` among the positions its owner stores (storage order)."""
    return (position // (cp * interleave)) * interleave + position % interleave


def block_and_offset(position, block_size: int, cp: int, interleave: int):
    """(index into the request's block table, offset inside the owner's local block);
    the interleave divides the block size, so a rank's blocks fill one after another."""
    slot = local_slot(position, cp, interleave)
    return slot // block_size, slot % block_size


def local_count(seq_len, cp_rank: int, cp: int, interleave: int):
    """How many of positions ``0 .. seq_len - 1`` CP rank ``cp_rank`` stores (``seq_len``
    an int, or an integer tensor of lengths, elementwise)."""
    cycle = cp * interleave
    rest = seq_len % cycle - cp_rank * interleave
    held = rest.clamp(0, interleave) if hasattr(rest, "clamp") else min(max(rest, 0), interleave)
    return seq_len // cycle * interleave + held


def local_positions(seq_len: int, cp_rank: int, cp: int, interleave: int) -> list[int]:
    """Positions ``< seq_len`` that CP rank ``cp_rank`` stores, in storage order."""
    cycle = cp * interleave
    first = cp_rank * interleave
    return [
        start + i for start in range(first, seq_len, cycle) for i in range(min(interleave, seq_len - start))
    ]


@dataclass(frozen=True)
class Holder:
    rank: int  # inside the DP replica: pcp_rank x TP + tp_rank
    pcp_rank: int
    tp_rank: int
    heads: range


@dataclass(frozen=True)
class Placement:
    position: int
    cp_rank: int
    pcp_rank: int
    dcp_rank: int
    block_index: int  # entry of the request's block table (the same block id on every CP rank)
    offset: int  # slot inside that block on the owner
    holders: tuple[Holder, ...]  # every rank that stores it (MLA and replicated GQA heads: several)


def place(layout: CPLayout, position: int) -> Placement:
    """Which ranks hold token ``position``'s KV, for which heads, at which block and offset."""
    if position < 0:
        raise ValueError(f"position must be non-negative, got {position}")
    c = owner(position, layout.cp, layout.interleave)
    block, offset = block_and_offset(position, layout.block_size, layout.cp, layout.interleave)
    pcp_rank, dcp_rank = divmod(c, layout.dcp)
    holders = tuple(
        Holder(layout.rank(pcp_rank, t), pcp_rank, t, layout.heads(t))
        for t in range(dcp_rank, layout.tp, layout.dcp)
    )
    return Placement(position, c, pcp_rank, dcp_rank, block, offset, holders)


def context_parallel_layout(vllm_config) -> CPLayout:
    """The layout an engine config asks for (the KV heads only for GQA: MLA has one latent head)."""
    pc, model = vllm_config.parallel_config, vllm_config.model_config
    return CPLayout(
        tp=pc.tensor_parallel_size,
        pcp=pc.prefill_context_parallel_size,
        dcp=pc.decode_context_parallel_size,
        dp=pc.data_parallel_size,
        interleave=pc.cp_kv_cache_interleave_size,
        block_size=vllm_config.cache_config.block_size,
        kv_heads=None if model.use_mla else model.get_total_num_kv_heads(),
    )
