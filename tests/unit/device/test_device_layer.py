"""The device layer's choice per mode, and the NPU device class in NPU-path mode: its
runtime answers (SoC, streams, events, communicator names) come from torch_npu -- here
the contract double -- while tensors and memory figures stay the host's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

torch_npu = pytest.importorskip("torch_npu")
if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
    pytest.skip("needs the torch_npu contract double", allow_module_level=True)

from vllm.ascend import device as ascend_device  # noqa: E402
from vllm.ascend.device.host import HostDevice  # noqa: E402
from vllm.ascend.device.npu import NPUDevice, NPUPathDevice  # noqa: E402


@pytest.fixture
def fresh_current():
    ascend_device.current.cache_clear()
    yield ascend_device.current
    ascend_device.current.cache_clear()


@pytest.mark.parametrize("kernels, expected", [("npu", NPUPathDevice), ("reference", HostDevice)])
def test_host_emulation_picks_the_device_class_by_kernels(kernels, expected, fresh_current, monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_EMULATE", "1")
    monkeypatch.setenv("VLLM_ASCEND_KERNELS", kernels)
    dev = fresh_current()
    assert type(dev) is expected
    assert dev.torch_device(1) == torch.device("cpu")  # tensors stay on the CPU either way


@pytest.mark.parametrize("soc, version", [("A2", 223), ("A3", 250)])
def test_npu_path_device_reports_the_doubles_soc(soc, version, monkeypatch):
    monkeypatch.setenv("TORCH_NPU_DOUBLE_SOC", soc)
    dev = NPUPathDevice()
    assert isinstance(dev, NPUDevice)
    assert torch_npu.npu.get_soc_version() == version
    assert dev.soc_generation() == soc


def test_npu_path_device_streams_events_and_host_memory():
    dev = NPUPathDevice()
    side = dev.stream()
    assert isinstance(side, torch_npu.npu.Stream)
    assert dev.current_stream() is torch_npu.npu.default_stream()
    with dev.stream_context(side):
        assert dev.current_stream() is side
    assert dev.current_stream() is torch_npu.npu.default_stream()
    event = dev.event(blocking=True)
    event.record()
    event.synchronize()
    assert event.query()
    side.wait_stream(dev.current_stream())
    free, total = dev.mem_get_info()  # the host's figures, not the double's NPU memory
    assert 0 < free <= total == HostDevice().total_memory() == dev.total_memory()


def test_npu_path_comm_name_resolves_to_the_gloo_group():
    """NPUDevice.comm_name asks the group's backend for its HCCL name; on gloo the double
    answers the c10d name, which its MC2 ops resolve back to the group."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0], backend="gloo")
        name = NPUPathDevice().comm_name(group)
        assert name == group.group_name == HostDevice().comm_name(group)
        assert _resolve_process_group(name) is group
    finally:
        dist.destroy_process_group()


def test_unknown_soc_name_is_refused(monkeypatch):
    monkeypatch.setenv("TORCH_NPU_DOUBLE_SOC", "A9")
    with pytest.raises(ValueError, match="TORCH_NPU_DOUBLE_SOC"):
        NPUPathDevice().soc_generation()
