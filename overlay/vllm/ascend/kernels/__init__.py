"""Kernels facade: one module per op, each with an NPU and a reference implementation.

Every op module exposes the same contract twice: ``npu_*`` (torch_npu, for Ascend
hosts; written against the torch_npu documentation and only verified where a test
marked ``npu`` ran on an NPU) and ``reference_*`` (plain torch, the oracle, and what
host emulation runs). Callers use the unprefixed name, bound by ``use_reference()``.
"""

from __future__ import annotations

from vllm.ascend import envs


def use_reference() -> bool:
    """Reference kernels in host emulation, NPU kernels on an NPU."""
    return envs.emulate()
