"""The Ascend section of ``vllm collect-env`` (hook: patch ``collect-env-append-the-ascend-section``)."""

from __future__ import annotations

import importlib.metadata
import os

from vllm.ascend import envs


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not found"


def _cann_version() -> str:
    from vllm.ascend.device.npu_runtime import load_torch_npu

    if load_torch_npu() is None:
        return "not found (torch_npu cannot load, so CANN cannot be asked)"
    from vllm.ascend.device.npu import NPUDevice

    return NPUDevice().cann_version()


def device_mode() -> str:
    from vllm.ascend.device import npu_device_count
    from vllm.ascend.device.npu_runtime import failure_reason

    if envs.emulate():
        return "host emulation (VLLM_ASCEND_EMULATE=1): reference kernels on the CPU, gloo"
    count = npu_device_count()
    if count:
        return f"NPU ({count} device(s) visible)"
    return f"none: {failure_reason() or 'torch_npu sees no NPU'}"


def ascend_env_info() -> str:
    from vllm.ascend import provenance

    prov = provenance()
    build = prov.get("version", "development tree (no provenance)")
    lines = [
        "==============================",
        "      vLLM Ascend",
        "==============================",
        f"Distribution build           : {build}",
        f"torch_npu version            : {_version('torch-npu')}",
        f"CANN version                 : {_cann_version()}",
        f"Device mode                  : {device_mode()}",
        f"ASCEND_RT_VISIBLE_DEVICES    : {os.environ.get('ASCEND_RT_VISIBLE_DEVICES', 'not set')}",
    ]
    return "\n".join(lines)
