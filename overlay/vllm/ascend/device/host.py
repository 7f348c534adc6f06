"""Host emulation: the NPU runtime's device calls, answered by the CPU.

There is nothing to synchronise or cache on a CPU, so streams, events and
synchronisation are no-ops; memory figures come from the operating system.
"""

from __future__ import annotations

import os

import psutil
import torch

from vllm.ascend.device.base import Device


class _HostStream:
    device = torch.device("cpu")

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _HostEvent:
    def __init__(self, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def query(self) -> bool:
        return True


class HostDevice(Device):
    type = "cpu"

    def set_device(self, index: int) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    def memory_allocated(self) -> int:
        return int(psutil.Process(os.getpid()).memory_info().rss)

    def device_name(self, index: int = 0) -> str:
        return "host CPU (Ascend NPU emulation)"

    def stream(self) -> object:
        return _HostStream()

    def event(self, **kwargs) -> object:
        return _HostEvent(**kwargs)


def make_accelerator_calls_noops() -> None:
    """torch.accelerator.synchronize/empty_cache raise on a torch with no accelerator;
    upstream's GPU runner calls them on its generic paths (sampler warm-up, profiling
    clean-up, shutdown). In host mode there is nothing to synchronise or free."""

    def synchronize(*args, **kwargs) -> None:
        pass

    def empty_cache(*args, **kwargs) -> None:
        pass

    def empty_host_cache(*args, **kwargs) -> None:
        pass

    torch.accelerator.synchronize = synchronize
    torch.accelerator.empty_cache = empty_cache
    torch.accelerator.empty_host_cache = empty_host_cache
