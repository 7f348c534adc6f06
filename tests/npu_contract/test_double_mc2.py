"""The contract double's MC2 environment: ``comm_alg`` as the docs resolve it, HCCL_BUFFSIZE,
and the HCCL group options."""

from __future__ import annotations

import pytest
import torch

from tests.npu_contract.contract_cases import BF16

torch_npu = pytest.importorskip("torch_npu")
if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
    pytest.skip("the real torch_npu is active on this host", allow_module_level=True)

from torch_npu._rules import ContractViolation  # noqa: E402


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def _mc2_dispatch(group, hidden=256, bs=4, ep=1, k=2, **change):
    args = dict(
        x=torch.randn(bs, hidden, dtype=BF16),
        expert_ids=torch.arange(k, dtype=torch.int32).repeat(bs, 1),
        group_ep=group,
        ep_world_size=ep,
        ep_rank_id=0,
        moe_expert_num=16,
        x_active_mask=torch.ones(bs, dtype=torch.bool),
        global_bs=0,
        comm_alg="fullmesh",
    )
    args.update(change)
    return torch_npu.npu_moe_distribute_dispatch_v2(**args)


@pytest.mark.parametrize(
    ("env", "change", "rule"),
    [
        # the buffer each rank needs, against HCCL_BUFFSIZE (MB; 200 unset)
        ({"HCCL_BUFFSIZE": "4"}, {}, "MC2.buffsize_a2"),
        # unset (200 MB): 2*(512*1*min(16, 16)*7168*2 + 2 MB) = 228 MB
        ({}, {"hidden": 7168, "bs": 512, "k": 16, "comm_alg": ""}, "MC2.buffsize_a2"),
        (
            {"TORCH_NPU_DOUBLE_SOC": "A3", "HCCL_BUFFSIZE": "8"},  # 16 tokens of H 7168 need 9 MB
            {"comm_alg": "", "hidden": 7168, "bs": 16},
            "MC2.buffsize_a3",
        ),
        # comm_alg per SoC; "" on A2 follows HCCL_INTRA_PCIE_ENABLE / HCCL_INTRA_ROCE_ENABLE
        ({"TORCH_NPU_DOUBLE_SOC": "A3"}, {}, "MC2.comm_alg_a3"),  # "fullmesh" is A2's name
        ({}, {"comm_alg": "fullmesh_v1"}, "MC2.comm_alg_a2"),
        (
            {"HCCL_INTRA_PCIE_ENABLE": "1", "HCCL_INTRA_ROCE_ENABLE": "0"},
            {"comm_alg": ""},
            "MC2.hierarchy_mask",
        ),
        ({}, {"comm_alg": "hierarchy", "x_active_mask": None}, "MC2.hierarchy_ep"),
        ({}, {"comm_alg": "hierarchy", "x_active_mask": None, "ep": 16}, "MC2.hierarchy_expert_scales"),
    ],
)
def test_mc2_environment_rules(one_rank_group, monkeypatch, env, change, rule):
    for name in ("HCCL_BUFFSIZE", "TORCH_NPU_DOUBLE_SOC", "HCCL_INTRA_PCIE_ENABLE", "HCCL_INTRA_ROCE_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    _mc2_dispatch(one_rank_group, comm_alg="fullmesh")  # the baseline passes
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ContractViolation, match=rule.replace(".", r"\.")):
        _mc2_dispatch(one_rank_group, **change)


def test_mc2_algorithms_the_double_models(one_rank_group, monkeypatch):
    for name in ("HCCL_BUFFSIZE", "TORCH_NPU_DOUBLE_SOC", "HCCL_INTRA_PCIE_ENABLE", "HCCL_INTRA_ROCE_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    _mc2_dispatch(one_rank_group, comm_alg="")  # A2 "" without the PCIe/RoCE pair: fullmesh
    monkeypatch.setenv("HCCL_INTRA_PCIE_ENABLE", "1")
    _mc2_dispatch(one_rank_group, comm_alg="fullmesh")  # explicit: the variables do not matter
    with pytest.raises(NotImplementedError, match="hierarchy"):  # allowed, but not modelled
        _mc2_dispatch(
            one_rank_group, comm_alg="hierarchy", x_active_mask=None, ep=16, expert_scales=torch.ones(4, 2)
        )
    monkeypatch.setenv("TORCH_NPU_DOUBLE_SOC", "A3")
    out = _mc2_dispatch(one_rank_group, comm_alg="", hidden=1024)
    expand_x, _, assist, _, ep_recv, _, _ = out
    with pytest.raises(ContractViolation, match=r"MC2\.combine_comm_alg_a3"):
        torch_npu.npu_moe_distribute_combine_v2(
            expand_x,
            torch.arange(2, dtype=torch.int32).repeat(4, 1),
            assist,
            ep_recv,
            torch.ones(4, 2),
            one_rank_group,
            1,
            0,
            16,
            comm_alg="fullmesh_v1",
        )


def test_hccl_group_options_are_checked(monkeypatch):
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL

    from vllm.ascend.distributed import groups

    monkeypatch.setenv("VLLM_ASCEND_GROUP_HCCL_BUFFSIZE_MB", "64")
    assert groups.hccl_group_options("tp").hccl_config == {"hccl_buffer_size": 64}
    assert groups.device_group_options("mc2", "hccl") is None  # MC2 keeps HCCL_BUFFSIZE
    assert groups.device_group_options("mc2:0", "hccl") is None
    assert groups.device_group_options("tp", "gloo") is None  # host emulation
    assert groups.device_group_options("world", "hccl").hccl_config == {"hccl_buffer_size": 64}
    with pytest.raises(ContractViolation, match=r"HCCL\.buffer_size"):
        ProcessGroupHCCL.Options().hccl_config = {"hccl_buffer_size": 0}
    with pytest.raises(ContractViolation, match=r"HCCL\.buffer_size"):
        ProcessGroupHCCL.Options().hccl_config = {"hccl_buffer_size": "200"}
