"""Environment variables of the vLLM Ascend distribution (documented in docs/install.md)."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable

_TRUE = {"1", "true", "yes", "on"}
KERNEL_CHOICES = ("auto", "npu", "reference")


def emulate() -> bool:
    """VLLM_ASCEND_EMULATE=1: run the NPU platform on the host CPU (development and CI)."""
    return os.environ.get("VLLM_ASCEND_EMULATE", "0").strip().lower() in _TRUE


def check_host_seq_lens() -> bool:
    """VLLM_ASCEND_CHECK_HOST_SEQ_LENS=1 (host emulation, tests): every attention metadata
    build compares the host sequence lengths it hands the kernels with the device's and
    fails on a difference (on an NPU that read would wait for the device: ignored there)."""
    flag = os.environ.get("VLLM_ASCEND_CHECK_HOST_SEQ_LENS", "0").strip().lower() in _TRUE
    return flag and emulate()


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


def _int_setting(name: str, default: int, unit: str, low: int = 1, high: int | None = None) -> int:
    """An integer environment variable in ``[low, high]``, or a ValueError naming it."""
    raw = os.environ.get(name, "").strip() or str(default)
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer ({unit}), got {raw!r}") from None
    if value < low or (high is not None and value > high):
        allowed = "positive" if high is None and low == 1 else f"in {low}..{high}"
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def host_kv_cache_bytes() -> int:
    """VLLM_ASCEND_HOST_KV_CACHE_MB: KV cache size in host mode (default 256 MiB), unless
    --kv-cache-memory-bytes is given. Host memory is shared with everything else, so
    host mode does not size the cache from --gpu-memory-utilization."""
    return _int_setting("VLLM_ASCEND_HOST_KV_CACHE_MB", 256, "MiB") * (1 << 20)


PREFILL_CHUNK_DEFAULT = 8192


def prefill_chunk_tokens(high: int) -> int:
    """VLLM_ASCEND_PREFILL_CHUNK_TOKENS: how many tokens of a prefill's history (cached
    context and the step's own tokens) attention expands (MLA ``kv_b_proj``) or gathers
    (context parallelism) at once, per layer (default 8192, at most ``high``: the dense
    attention kernel's row limit, kernels/mla.NPU_DENSE_MAX_T). Longer histories are
    processed chunk by chunk and merged by log-sum-exp, so the transient memory is
    bounded by this setting, not by the context length."""
    return _int_setting("VLLM_ASCEND_PREFILL_CHUNK_TOKENS", PREFILL_CHUNK_DEFAULT, "tokens", high=high)


HCCL_DEFAULT_BUFFSIZE_MB = 200  # CANN's, when HCCL_BUFFSIZE is unset: "不配置时默认为200MB"


def hccl_buffsize_mb() -> int:
    """HCCL_BUFFSIZE (CANN's variable, MB per communicator; 200 when unset): the buffer the
    MC2 group's communicator gets. Read here to check it against the MC2 requirement."""
    return _int_setting("HCCL_BUFFSIZE", HCCL_DEFAULT_BUFFSIZE_MB, "MB")


def group_hccl_buffsize_mb() -> int:
    """VLLM_ASCEND_GROUP_HCCL_BUFFSIZE_MB: the HCCL buffer (MB) of every process group but
    MC2's (world, TP, DP, EP, PP, context parallel), set through the group's options so a
    large HCCL_BUFFSIZE for MC2 does not apply to them (default 200, HCCL's own default)."""
    return _int_setting("VLLM_ASCEND_GROUP_HCCL_BUFFSIZE_MB", HCCL_DEFAULT_BUFFSIZE_MB, "MB")


# Every VLLM_* variable the distribution reads (docs/install.md), besides upstream's own
# (vllm.envs). The builder's two (docs/builder.md) are listed too: they are often exported
# in the shell that then runs `vllm serve`, and are harmless there.
DISTRIBUTION_VARIABLES = (
    "VLLM_ASCEND_EMULATE",
    "VLLM_ASCEND_KERNELS",
    "VLLM_ASCEND_HOST_KV_CACHE_MB",
    "VLLM_ASCEND_PREFILL_CHUNK_TOKENS",
    "VLLM_ASCEND_GROUP_HCCL_BUFFSIZE_MB",
    "VLLM_ASCEND_KV_SECRET",  # P/D's shared secret (kv_transfer/trust.py)
    "VLLM_ASCEND_CHECK_HOST_SEQ_LENS",  # tests: host lengths against the device's
    "VLLM_ASCEND_BUILD_CACHE",
    "VLLM_ASCEND_SDIST",
)


def unknown_variables(names: Iterable[str], upstream: Iterable[str]) -> dict[str, str | None]:
    """The VLLM_* names neither upstream nor this distribution reads, each with the known
    name it most likely misspells (or None)."""
    known = set(upstream) | set(DISTRIBUTION_VARIABLES)
    unknown = sorted(n for n in names if n.startswith("VLLM_") and n not in known)
    return {n: next(iter(difflib.get_close_matches(n, known, n=1, cutoff=0.85)), None) for n in unknown}
