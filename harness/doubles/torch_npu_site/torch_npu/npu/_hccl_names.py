"""HCCL communicator names for the double's gloo process groups.

On an NPU, torch_npu's ``ProcessGroupHCCL.get_hccl_comm_name(rank)`` gives the name
under which HCCL knows a group; MC2 ops take it as ``group_ep`` (torch_npu's
``_op_plugin_docs.py`` examples: ``default_pg._get_backend(torch.device("npu"))
.get_hccl_comm_name(rank)``). In NPU-path mode the groups are gloo groups on the CPU,
so the double gives gloo's backend the same method, answering the c10d name of the
group the backend belongs to; the double's MC2 ops resolve that name back to the group
(``_ops.mc2._mc2_group``). The NPU device class (``vllm/ascend/device/npu.py``) thus runs
its own ``comm_name`` unchanged.
"""

from __future__ import annotations


def get_hccl_comm_name(backend, rank_id: int, init_comm: bool = True) -> str:
    import torch
    from torch.distributed import distributed_c10d as c10d

    for group, name in c10d._world.pg_names.items():
        try:
            if group._get_backend(torch.device("cpu")) is backend:
                return name
        except RuntimeError:  # a group without a CPU backend
            continue
    raise RuntimeError("contract double: get_hccl_comm_name on a backend of no registered process group")


def _install() -> None:
    from torch.distributed import ProcessGroupGloo

    if not hasattr(ProcessGroupGloo, "get_hccl_comm_name"):
        ProcessGroupGloo.get_hccl_comm_name = get_hccl_comm_name


_install()
