"""Host emulation: the NPU runtime's device calls, answered by the CPU.

There is nothing to synchronise on a CPU, so streams, events and synchronisation are
no-ops; memory figures come from the C allocator (the bytes it has handed out and not
taken back stand for device memory in use) and the operating system (free memory), and
emptying the cache returns the C heap's free memory.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import cache

import psutil
import torch

from vllm.ascend.device.base import Device


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def _malloc_trim() -> None:
    """Return the C heap's free memory to the system (glibc; elsewhere nothing)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(ctypes.c_size_t(0))


class _MallInfo2(ctypes.Structure):
    # glibc's struct mallinfo2 (2.33+), every field a size_t
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _bytes_in_use() -> int:
    """Bytes the C allocator has handed out and not taken back, over all arenas.

    Not the RSS: whether freed or never-touched pages are resident depends on the kernel,
    the allocator's thresholds and the sandbox, while what a sleep released must show as
    a fall here. Where glibc's ``mallinfo2`` is missing (another libc or an older glibc),
    the RSS stands in.
    """
    libc = _libc()
    mallinfo2 = getattr(libc, "mallinfo2", None) if libc is not None else None
    if mallinfo2 is None:
        return int(psutil.Process(os.getpid()).memory_info().rss)
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


class _HostStream:
    device = torch.device("cpu")

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _HostEvent()

    def wait_event(self, event) -> None:
        pass


class _HostEvent:
    """Host work runs in program order, so an event is complete when recorded; its time is
    the host clock's at recording (what ``elapsed_time`` compares, in ms)."""

    def __init__(self, **kwargs) -> None:
        self._recorded_at: float | None = None

    def record(self, *args, **kwargs) -> None:
        self._recorded_at = time.perf_counter()

    def elapsed_time(self, end: _HostEvent) -> float:
        if self._recorded_at is None or end._recorded_at is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end._recorded_at - self._recorded_at) * 1000.0

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

    def empty_cache(self) -> None:
        # The NPU allocator hands its cached blocks back here; on the host, glibc keeps
        # freed chunks below its (adaptive) mmap threshold in the heap, resident.
        _malloc_trim()

    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    def memory_allocated(self) -> int:
        return _bytes_in_use()

    def device_name(self, index: int = 0) -> str:
        return "host CPU (Ascend NPU emulation)"

    def total_memory(self, index: int = 0) -> int | None:
        return self.mem_get_info(index)[1]

    def stream(self) -> object:
        return _HostStream()

    def event(self, **kwargs) -> object:
        return _HostEvent(**kwargs)

    def current_stream(self) -> object:
        return _HostStream()

    def stream_context(self, stream) -> AbstractContextManager:
        return nullcontext()

    def set_stream(self, stream) -> None:
        pass

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        pass  # host tensors are freed when their last reference goes

    def soc_generation(self) -> str:
        return "host"

    def comm_name(self, group) -> str:
        # The c10d name: the contract double resolves it back to the (gloo) group.
        return group.group_name


def answer_accelerator_calls(memory_info: Callable[[], tuple[int, int]]) -> None:
    """torch.accelerator.synchronize/empty_cache/current_device_index/get_memory_info raise
    on a torch with no accelerator, and upstream calls them on generic paths (sampler
    warm-up, profiling clean-up, shutdown, ``cleanup_dist_env_and_memory``, KV connectors,
    graph-memory measurements). On the host there is nothing to synchronise or free, each
    process has one emulated device, index 0, and memory is what the device layer says
    (``memory_info``: the caller passes ``Device.accelerator_memory_info`` of its device,
    which this module cannot import without a cycle). Only when no accelerator exists;
    idempotent."""
    if torch.accelerator.is_available() or getattr(torch.accelerator, "_ascend_host_answers", False):
        return

    def nothing(*args, **kwargs) -> None:
        pass

    torch.accelerator.synchronize = nothing
    torch.accelerator.empty_cache = nothing
    torch.accelerator.empty_host_cache = nothing
    torch.accelerator.current_device_index = lambda: 0
    torch.accelerator.get_memory_info = lambda device=None: memory_info()
    torch.accelerator._ascend_host_answers = True


def skip_final_collection_at_exit() -> None:
    """At interpreter exit, freeze the heap instead of collecting it. A process that
    imported vLLM spends ~2 s of a 2-core host's time in that last collection, which
    pushes engine shutdown past upstream's 5 s grace into a force-kill; the memory goes
    back to the OS either way. Registered first, so it runs after every other handler."""
    atexit.register(gc.freeze)
