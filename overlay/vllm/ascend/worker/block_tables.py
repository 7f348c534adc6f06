"""Model Runner V2's block tables for the Ascend runner (hook: the runner's
``block_tables_cls``).

Upstream's ``BlockTables`` gathers the batch's rows, maps tokens to KV slots and
applies multi-group staged writes with Triton kernels that read tables of raw
``data_ptr()`` values. This subclass keeps upstream's state (the staged per-group
tables, the block counts, the forward-pass buffers) and does those three steps with
torch ops on the tables themselves, with no reads back to the host. Slots under
context parallelism follow ``vllm.ascend.context_parallel.placement`` over the whole
PCP x DCP group (upstream's V2 counts DCP only: its PCP keeps full replicas).
"""

from __future__ import annotations

import torch

from vllm.v1.attention.backends.utils import PAD_SLOT_ID
from vllm.v1.worker.gpu.block_table import BlockTables

from vllm.ascend.context_parallel.placement import block_and_offset, owner
from vllm.ascend.kernels import request_of_token


class NPUBlockTables(BlockTables):
    _num_dirty_rows: int  # upstream's (annotation only)

    def __init__(self, *args, layout: tuple[int, int] | None = None, **kwargs) -> None:
        """``layout``: (ranks, this rank) of the PCP x DCP group slots are placed over,
        instead of the DCP group the runner passes."""
        if layout is not None:
            kwargs["cp_size"], kwargs["cp_rank"] = layout
        super().__init__(*args, **kwargs)
        sharded = kwargs.get("dcp_sharded")
        self._dcp_sharded = list(sharded) if sharded is not None else [True] * self.num_kv_cache_groups

    def init_block_table_layout_tensors(self) -> None:
        # upstream's per-group pointer tables are for its Triton kernels only
        self.block_sizes_tensor = torch.tensor(self.block_sizes, dtype=torch.int32, device=self.device)
        self.slot_mapping_enabled = torch.tensor(
            self._slot_mapping_enabled, dtype=torch.bool, device=self.device
        )
        self.sliding_window_reach = torch.tensor(
            self._sliding_window_reach, dtype=torch.int32, device=self.device
        )

    def apply_staged_writes(self) -> None:
        if self.num_kv_cache_groups == 0:
            return
        for table in self.block_tables:  # one group at a time: no pointer table
            table.apply_write()
        self.num_blocks.copy_to_uva()

    def gather_block_tables(
        self,
        idx_mapping: torch.Tensor,
        num_reqs_padded: int,
        out: tuple[torch.Tensor, ...] | None = None,
        out_ptrs: torch.Tensor | None = None,
        num_computed_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        if self.num_kv_cache_groups == 0:
            return ()
        num_reqs = idx_mapping.shape[0]
        num_rows = num_reqs_padded
        if out is None:
            out = tuple(self.input_block_tables)
            num_rows = max(num_rows, self._num_dirty_rows)
            self._num_dirty_rows = num_reqs
        window_start = num_computed_tokens if self.has_sliding_window_groups else None
        self._write_rows(idx_mapping.long(), None, self.num_blocks.gpu, window_start, out)
        for dst in out:
            dst[num_reqs:num_rows] = 0  # rows a larger batch left behind
        return tuple(t[:num_reqs_padded] for t in out)

    def gather_padded_rows(
        self, idx_mapping: torch.Tensor, num_blocks: torch.Tensor, num_computed_tokens: torch.Tensor
    ) -> None:
        """``gather_block_tables`` into rows ``[:len(idx_mapping)]`` of the forward's tables
        for a batch padded with ``-1`` entries (zero rows, as upstream leaves padded rows), in
        fixed shapes and without host state, so a graph can capture it; ``num_blocks``: a
        copy of the per-request block counts (their upstream buffer moves every step).
        Rows a larger batch left behind are the caller's (``clear_rows_beyond``)."""
        if self.num_kv_cache_groups == 0:
            return
        real = idx_mapping >= 0
        window_start = num_computed_tokens if self.has_sliding_window_groups else None
        self._write_rows(
            idx_mapping.clamp(min=0).long(), real, num_blocks, window_start, self.input_block_tables
        )

    def clear_rows_beyond(self, num_rows: int, num_reqs: int) -> None:
        """After ``gather_padded_rows`` over ``num_rows`` rows for ``num_reqs`` requests:
        zero the rows past them a larger batch left behind, as ``gather_block_tables`` does."""
        for dst in self.input_block_tables[: self.num_kv_cache_groups]:
            if self._num_dirty_rows > num_rows:
                dst[num_rows : self._num_dirty_rows] = 0
        self._num_dirty_rows = num_reqs

    def _write_rows(
        self,
        req: torch.Tensor,
        real: torch.Tensor | None,
        num_blocks: torch.Tensor,
        window_start: torch.Tensor | None,
        out,
    ) -> None:
        """Rows ``[:len(req)]`` of each group's ``out`` table: request ``req[i]``'s blocks
        (zeros where ``real`` is false)."""
        num_reqs = req.shape[0]
        counts = num_blocks[:, req].to(torch.int64)  # [groups, num_reqs]
        for group, (table, dst) in enumerate(zip(self.block_tables, out)):
            width = dst.shape[1]
            col = torch.arange(width, device=dst.device)[None, :]
            rows = table.gpu[req, :width]
            if window_start is not None and self._sliding_window_reach[group] > 0:
                # entries no query of this step can attend may be freed blocks already
                reach, block = self._sliding_window_reach[group], self.block_sizes[group]
                first = window_start[req].to(torch.int64)
                attended = col >= ((first - reach).clamp(min=0) // block)[:, None]
                rows = torch.where(attended, rows, torch.zeros_like(rows))
            # columns past a request's blocks keep what they held, as upstream's kernel does
            keep = col < counts[group][:, None]
            if real is not None:
                rows = torch.where(real[:, None], rows, 0)
                keep = keep | ~real[:, None]
            dst[:num_reqs] = torch.where(keep, rows, dst[:num_reqs])

    def compute_slot_mappings(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        slot_mappings = self.slot_mappings if out is None else out
        num_reqs = idx_mapping.shape[0]
        if self.num_kv_cache_groups == 0 or num_reqs == 0:
            slot_mappings.fill_(PAD_SLOT_ID)
            return slot_mappings[:, :num_tokens_padded]
        size = slot_mappings.shape[1]
        row, _, inside = request_of_token(query_start_loc[1 : num_reqs + 1], size)
        req = idx_mapping.long()[row]
        real = inside & (req >= 0)  # -1: a dummy request that owns no blocks
        req = req.clamp(min=0)
        pos = positions[:size].to(torch.int64) if positions.shape[0] >= size else _padded(positions, size)
        for group, table in enumerate(self.block_tables):
            block_size = self.block_sizes[group]
            if not self._slot_mapping_enabled[group]:
                slot_mappings[group].fill_(PAD_SLOT_ID)
                continue
            sharded = self.cp_size > 1 and self._dcp_sharded[group]
            if sharded:
                keep = real & (owner(pos, self.cp_size, self.cp_interleave) == self.cp_rank)
                index, offset = block_and_offset(pos, block_size, self.cp_size, self.cp_interleave)
            else:
                keep = real
                index, offset = pos // block_size, pos % block_size
            index = index.clamp(0, table.gpu.shape[1] - 1)
            blocks = table.gpu[req, index].to(torch.int64)
            slots = blocks * block_size + offset
            slot_mappings[group] = torch.where(keep, slots, PAD_SLOT_ID)
        return slot_mappings[:, :num_tokens_padded]


def _padded(positions: torch.Tensor, size: int) -> torch.Tensor:
    out = positions.new_zeros(size, dtype=torch.int64)
    out[: positions.shape[0]] = positions
    return out
