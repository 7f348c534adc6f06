"""Which platform this process runs: called by vLLM's builtin platform detection."""

from __future__ import annotations

import importlib.metadata
import re

from vllm.ascend import envs

NPU = "vllm.ascend.platform.npu.NPUPlatform"
HOST = "vllm.ascend.platform.host.HostEmulationPlatform"
UNAVAILABLE = "vllm.ascend.platform.unavailable.NoNPUPlatform"


def detect_platform() -> str:
    """Always a platform of this distribution: the wheel exists to run on Ascend.

    Without an NPU and without ``VLLM_ASCEND_EMULATE=1`` the stand-in platform lets
    ``--version``, ``--help`` and ``collect-env`` work and refuses to start an engine.
    """
    if envs.emulate():
        return HOST
    from vllm.ascend.device import npu_device_count

    return NPU if npu_device_count() > 0 else UNAVAILABLE


def torch_npu_requirement() -> str:
    """The torch-npu requirement of this wheel's ``npu`` extra, e.g. ``torch-npu==2.14.0``."""
    try:
        for req in importlib.metadata.requires("vllm") or []:
            if req.startswith("torch-npu") and re.search(r"""extra\s*==\s*["']npu["']""", req):
                return req.split(";", 1)[0].replace(" ", "")
    except importlib.metadata.PackageNotFoundError:
        pass
    return "torch-npu"


def no_npu_message() -> str:
    from vllm.ascend.device.npu_runtime import failure_reason

    reason = failure_reason() or "torch_npu sees no NPU"
    if reason == "torch_npu is not installed":
        install = (
            f"on an Ascend host with CANN, install it with `pip install '{torch_npu_requirement()}'` "
            "(or install this wheel with its `npu` extra)"
        )
    else:
        install = "on an Ascend host install CANN and check ASCEND_RT_VISIBLE_DEVICES"
    return (
        f"no Ascend NPU is available ({reason}); {install}, or set VLLM_ASCEND_EMULATE=1 to run "
        "on the host CPU (development and CI only)"
    )
