"""Device communicator: collectives on the device process group.

The group's backend is the platform's ``dist_backend``: HCCL on an NPU, gloo in host
emulation. The torch.distributed calls are the same for both, which is why one class
serves both modes; upstream's base class already issues them on ``device_group``.

Uneven gathers and reduce-scatters (MoE under data parallelism) pad every rank's part
to the largest one and use the equal-size collectives, which both HCCL and gloo
provide (gloo's list ``all_gather`` rejects unequal sizes).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager
from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
from vllm.logger import init_logger

logger = init_logger(__name__)

# The gather/reduce-scatter manager is the only upstream one that runs here; the
# Ascend AllToAll and MC2 strategies live in vllm.ascend.moe and use this group directly.
_SUPPORTED_ALL2ALL = ("allgather_reducescatter", "naive")


class NPUCommunicator(DeviceCommunicatorBase):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.use_all2all:
            if self.all2all_backend not in _SUPPORTED_ALL2ALL:
                logger.warning(
                    "--all2all-backend %s is not available on Ascend; MoE layers use the Ascend "
                    "strategies (additional_config moe_comm_method) and, for the "
                    "gather/reduce-scatter path, allgather_reducescatter",
                    self.all2all_backend,
                )
            self.all2all_manager = AgRsAll2AllManager(self.cpu_group)

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(input_, group=self.device_group)
        return input_

    # -- uneven collectives (sizes along ``dim``, one per rank) -----------------------------
    def all_gatherv(
        self, input_: torch.Tensor | list[torch.Tensor], dim: int = 0, sizes: list[int] | None = None
    ):
        if not isinstance(input_, (list, tuple)):
            return self._all_gatherv_one(input_, dim, sizes)
        if dim != 0 or len(input_) == 1 or len({t.shape[0] for t in input_}) != 1:
            return [self._all_gatherv_one(t, dim, sizes) for t in input_]
        # Rows of several tensors (MoE: hidden states, routing weights, expert ids) travel
        # as one byte matrix: one collective instead of one per tensor.
        rows = input_[0].shape[0]
        parts = [t.contiguous().reshape(-1).view(torch.uint8).reshape(rows, _row_bytes(t)) for t in input_]
        packed = self._all_gatherv_one(torch.cat(parts, dim=1), 0, sizes)
        out, start = [], 0
        for t, part in zip(input_, parts):
            width = part.shape[1]
            chunk = packed[:, start : start + width].contiguous()
            out.append(chunk.view(t.dtype).reshape(packed.shape[0], *t.shape[1:]))
            start += width
        return out

    def _all_gatherv_one(self, tensor: torch.Tensor, dim: int, sizes: list[int] | None) -> torch.Tensor:
        world = self.world_size
        if sizes is None:
            sizes = [tensor.shape[dim]] * world
        _check_sizes(sizes, world, tensor.shape[dim], self.rank_in_group, "all_gatherv")
        moved = tensor.movedim(dim, 0)
        longest = max(sizes)
        padded = _pad_rows(moved, longest)
        gathered = torch.empty((world * longest, *padded.shape[1:]), dtype=padded.dtype, device=padded.device)
        dist.all_gather_into_tensor(gathered, padded, group=self.device_group)
        parts = [gathered[r * longest : r * longest + n] for r, n in enumerate(sizes)]
        return torch.cat(parts).movedim(0, dim).contiguous()

    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor:
        world = self.world_size
        moved = input_.movedim(dim, 0)
        if sizes is None:
            if moved.shape[0] % world:
                raise ValueError(
                    f"reduce_scatterv: {moved.shape[0]} rows do not split evenly over {world} ranks"
                )
            sizes = [moved.shape[0] // world] * world
        if len(sizes) != world or sum(sizes) != moved.shape[0]:
            raise ValueError(
                f"reduce_scatterv: sizes {sizes} do not cover {moved.shape[0]} rows on {world} ranks"
            )
        longest = max(sizes)
        starts = [sum(sizes[:r]) for r in range(world)]
        padded = torch.cat([_pad_rows(moved[s : s + n], longest) for s, n in zip(starts, sizes)]).contiguous()
        out = torch.empty((longest, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
        dist.reduce_scatter_tensor(out, padded, group=self.device_group)
        return out[: sizes[self.rank_in_group]].movedim(0, dim).contiguous()

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
    ) -> torch.Tensor:
        dist.all_to_all_single(output, input_, output_split_sizes, input_split_sizes, group=self.device_group)
        return output

    # -- MoE dispatch/combine of upstream's naive path: through the manager -----------------
    def dispatch_router_logits(
        self, hidden_states, router_logits, is_sequence_parallel=False, extra_tensors=None
    ):
        if self.all2all_manager is None:
            return super().dispatch_router_logits(
                hidden_states, router_logits, is_sequence_parallel, extra_tensors
            )
        return self.all2all_manager.dispatch_router_logits(
            hidden_states, router_logits, is_sequence_parallel, extra_tensors
        )

    def dispatch(self, hidden_states, topk_weights, topk_ids, is_sequence_parallel=False, extra_tensors=None):
        if self.all2all_manager is None:
            return super().dispatch(
                hidden_states, topk_weights, topk_ids, is_sequence_parallel, extra_tensors
            )
        return self.all2all_manager.dispatch(
            hidden_states, topk_weights, topk_ids, is_sequence_parallel, extra_tensors=extra_tensors
        )

    def combine(self, hidden_states, is_sequence_parallel=False):
        if self.all2all_manager is None:
            return super().combine(hidden_states, is_sequence_parallel)
        return self.all2all_manager.combine(hidden_states, is_sequence_parallel)

    def combine_into_output(self, hidden_states, output, is_sequence_parallel=False):
        if self.all2all_manager is None:
            return super().combine_into_output(hidden_states, output, is_sequence_parallel)
        return self.all2all_manager.combine_into_output(hidden_states, output, is_sequence_parallel)

    def destroy(self):
        if self.all2all_manager is not None:
            self.all2all_manager.destroy()
            self.all2all_manager = None


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad])


def _check_sizes(sizes: list[int], world: int, local: int, rank: int, what: str) -> None:
    if len(sizes) != world or sizes[rank] != local:
        raise ValueError(f"{what}: sizes {sizes} do not match {world} ranks with {local} rows on rank {rank}")
