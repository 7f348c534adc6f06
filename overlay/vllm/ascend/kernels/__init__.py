"""Kernels facade: one module per op, each with an NPU and a reference implementation.

Every op module exposes the same contract twice: ``npu_*`` (torch_npu, for Ascend
hosts; written against the torch_npu documentation and only verified where a test
marked ``npu`` ran on an NPU) and ``reference_*`` (plain torch, the oracle, and what
host emulation runs). Callers use the unprefixed name, bound once at import by
``pick`` (the mode of a process never changes).
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.ascend import envs


def pick(reference: Callable, npu: Callable) -> Callable:
    """Reference kernel in host emulation, NPU kernel on an NPU."""
    return reference if envs.emulate() else npu
