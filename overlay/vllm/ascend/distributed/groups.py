"""Process groups of the Ascend distribution beside upstream's (TP, DP, EP, ...).

MC2: torch_npu's MoE dispatch/combine ops need an EP communication domain that carries
no other operator ("the EP comm domain used by dispatch/combine may carry no other
operator", torch_npu npu_moe_distribute_dispatch_v2 docs), so the MC2 strategy gets its
own group with exactly the EP group's ranks. Its communicator (and the HCCL buffers
``HCCL_BUFFSIZE`` sizes) is created by the worker before the KV cache is sized
(``init_mc2_communicator``), so the memory profile sees it; it is the only group without
HCCL options of its own: the MC2 ops lay out their buffer by HCCL_BUFFSIZE.

HCCL buffers of the other groups: upstream creates every group through
``Platform.device_group_options`` (this distribution's hook patch on
``vllm/distributed/parallel_state.py``); on an NPU each group but MC2's gets
``ProcessGroupHCCL.Options`` with ``hccl_config={"hccl_buffer_size": MB}``
(``VLLM_ASCEND_GROUP_HCCL_BUFFSIZE_MB``, default 200), as vllm-ascend does, so a large
HCCL_BUFFSIZE for MC2 does not multiply over world/TP/DP/EP/PP/CP groups.

Context parallel: one sequence's KV cache is spread over the PCP x DCP ranks that share
a TP rank's heads (``vllm.ascend.context_parallel.placement``); attention gathers and
combines over exactly those ranks, ordered by context-parallel rank
``pcp_rank x DCP + dcp_rank``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vllm.distributed.parallel_state import (
    GroupCoordinator,
    get_ep_group,
    get_world_group,
    init_model_parallel_group,
)

_MC2: GroupCoordinator | None = None
MC2_GROUP_NAME = "mc2"


def device_group_options(group_name: str, backend) -> object | None:
    """The process-group options of a device group: HCCL groups other than MC2's get their
    own buffer size; gloo groups (host emulation) and MC2's get None (the defaults)."""
    if str(backend) != "hccl" or group_name.split(":")[0] == MC2_GROUP_NAME:
        return None
    return hccl_group_options(group_name)


def hccl_group_options(group_name: str) -> object:
    """``torch_npu``'s ``ProcessGroupHCCL.Options`` with this group's HCCL buffer (MB)."""
    import importlib

    from vllm.ascend import envs
    from vllm.ascend.device.npu_runtime import load_torch_npu

    if load_torch_npu() is None:
        raise RuntimeError("HCCL process groups need torch_npu")
    c10d = importlib.import_module("torch_npu._C._distributed_c10d")
    options = c10d.ProcessGroupHCCL.Options()
    options.hccl_config = {"hccl_buffer_size": envs.group_hccl_buffsize_mb()}
    return options


def agreed_minimum(value: int) -> int:
    """The smallest ``value`` over every rank of the world (the MC2 plan must be the same
    on every rank even where nodes set HCCL_BUFFSIZE differently)."""
    world = get_world_group()
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=world.cpu_group)
    return int(t.item())


def init_mc2_group(backend: str) -> None:
    """Create the MC2 group (collective over the whole world: every rank takes part in
    creating every EP rank list's group). Call once per worker after upstream's groups;
    like upstream's groups it lives until the worker process exits."""
    global _MC2
    if _MC2 is not None:
        return
    ep = get_ep_group()
    world = get_world_group()
    mine = torch.tensor(ep.ranks, dtype=torch.int64)
    every = torch.empty(world.world_size * ep.world_size, dtype=torch.int64)
    dist.all_gather_into_tensor(every, mine, group=world.cpu_group)
    rank_lists = sorted({tuple(r) for r in every.view(world.world_size, ep.world_size).tolist()})
    _MC2 = init_model_parallel_group(
        [list(r) for r in rank_lists], world.local_rank, backend, group_name=MC2_GROUP_NAME
    )


def init_mc2_communicator() -> str:
    """Create the MC2 group's collective-library communicator now (on an NPU: the HCCL
    communicator with its HCCL_BUFFSIZE buffers, which ``get_hccl_comm_name`` creates) and
    return its name, the ``group_ep`` of the MC2 ops."""
    from vllm.ascend import device as ascend_device

    return ascend_device.current().comm_name(get_mc2_group().device_group)


def get_mc2_group() -> GroupCoordinator:
    if _MC2 is None:
        raise RuntimeError(
            "the MC2 group is not initialised: MC2 needs expert parallelism "
            "(--enable-expert-parallel with an EP size above 1)"
        )
    return _MC2


_CP: GroupCoordinator | None = None


def context_parallel_rank_lists(world_size: int, tp: int, pcp: int, dcp: int) -> list[list[int]]:
    """Every context-parallel group, each in context-parallel rank order. Upstream's rank
    order is (ExternalDP x DP x PP) x PCP x TP, so each block of PCP x TP consecutive
    ranks is one replica of the model."""
    block = pcp * tp
    return [
        [base + p * tp + first + d for p in range(pcp) for d in range(dcp)]
        for base in range(0, world_size, block)
        for first in range(0, tp, dcp)
    ]


def init_context_parallel_group(parallel_config, backend: str) -> None:
    """Create the context-parallel groups (collective over the world, once per worker)."""
    global _CP
    pcp, dcp = parallel_config.prefill_context_parallel_size, parallel_config.decode_context_parallel_size
    if _CP is not None or pcp * dcp == 1:
        return
    world = get_world_group()
    lists = context_parallel_rank_lists(world.world_size, parallel_config.tensor_parallel_size, pcp, dcp)
    _CP = init_model_parallel_group(lists, world.local_rank, backend, group_name="ascend_cp")


def get_context_parallel_group() -> GroupCoordinator:
    if _CP is None:
        raise RuntimeError(
            "the context-parallel group is not initialised: it exists when "
            "--prefill-context-parallel-size x --decode-context-parallel-size > 1"
        )
    return _CP
