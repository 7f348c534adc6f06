"""Stub of ``torch_npu.npu``, the device runtime API (no device behind it).

Every call that would touch the NPU runtime is recorded in ``runtime_calls`` so a
test can assert that a process never initialised the runtime (the API server must
not). ``TORCH_NPU_DOUBLE_DEVICES`` sets what ``device_count()`` reports (default 0,
so the double never makes a host look like an Ascend host by accident).
``TORCH_NPU_DOUBLE_MEMORY_MB`` sets the total memory ``mem_get_info`` reports.
"""

from __future__ import annotations

import os

runtime_calls: list[str] = []
_current_device: int | None = None
_allocated = 0


def _record(name: str) -> None:
    runtime_calls.append(name)


def device_count() -> int:
    # Counting devices does not create a context (aclrtGetDeviceCount); not recorded.
    return int(os.environ.get("TORCH_NPU_DOUBLE_DEVICES", "0"))


def is_available() -> bool:
    return device_count() > 0


def set_device(index) -> None:
    global _current_device
    _record("set_device")
    _current_device = int(getattr(index, "index", index) or 0)


def current_device() -> int:
    _record("current_device")
    return _current_device or 0


def synchronize(device=None) -> None:
    _record("synchronize")


def mem_get_info(device=None) -> tuple[int, int]:
    _record("mem_get_info")
    total = int(os.environ.get("TORCH_NPU_DOUBLE_MEMORY_MB", "65536")) << 20
    return total - _allocated, total


def memory_allocated(device=None) -> int:
    _record("memory_allocated")
    return _allocated


def empty_cache() -> None:
    _record("empty_cache")


def get_device_name(device=None) -> str:
    _record("get_device_name")
    return "Ascend910B3 (contract double)"


class Stream:
    def __init__(self, *args, **kwargs) -> None:
        _record("Stream")

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Event:
    def __init__(self, *args, **kwargs) -> None:
        _record("Event")

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True
