"""Environment variables of the vLLM Ascend distribution (documented in docs/runtime.md)."""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}
KERNEL_CHOICES = ("auto", "npu", "reference")


def emulate() -> bool:
    """VLLM_ASCEND_EMULATE=1: run the NPU platform on the host CPU (development and CI)."""
    return os.environ.get("VLLM_ASCEND_EMULATE", "0").strip().lower() in _TRUE


def kernels() -> str:
    """VLLM_ASCEND_KERNELS: which implementation of every kernel-facade op runs.

    ``auto`` (default): the NPU kernels (torch_npu) on an NPU, the reference kernels
    (plain torch) in host emulation. ``npu`` in host emulation runs the NPU kernels on
    the CPU, which needs a torch_npu that imports on the host: the torch_npu contract
    double of the test suite ("NPU-path mode"). ``reference`` on an NPU runs the plain
    torch kernels on the device (slow; for debugging a kernel).
    """
    value = os.environ.get("VLLM_ASCEND_KERNELS", "auto").strip().lower()
    if value not in KERNEL_CHOICES:
        raise ValueError(f"VLLM_ASCEND_KERNELS must be one of {', '.join(KERNEL_CHOICES)}, got {value!r}")
    if value == "auto":
        return "reference" if emulate() else "npu"
    return value


def host_kv_cache_bytes() -> int:
    """VLLM_ASCEND_HOST_KV_CACHE_MB: KV cache size in host mode (default 256 MiB), unless
    --kv-cache-memory-bytes is given. Host memory is shared with everything else, so
    host mode does not size the cache from --gpu-memory-utilization."""
    raw = os.environ.get("VLLM_ASCEND_HOST_KV_CACHE_MB", "256")
    try:
        mb = int(raw)
    except ValueError:
        raise ValueError(f"VLLM_ASCEND_HOST_KV_CACHE_MB must be an integer (MiB), got {raw!r}") from None
    if mb <= 0:
        raise ValueError(f"VLLM_ASCEND_HOST_KV_CACHE_MB must be positive, got {mb}")
    return mb * (1 << 20)
