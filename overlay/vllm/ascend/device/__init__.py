"""Device layer: the only place that touches torch_npu.

``current()`` is the device of this process's mode: :class:`NPUDevice` on an Ascend
NPU, :class:`HostDevice` in host emulation, and in NPU-path mode (host emulation with
``VLLM_ASCEND_KERNELS=npu``) :class:`NPUPathDevice`: the NPU device class with its
runtime answers (SoC, streams, events, communicator names) from the torch_npu that
imports on the host -- the contract double -- and host tensors and memory figures.
Everything above this layer (worker, runner, communicator) asks it for streams,
events, memory figures and synchronisation instead of calling ``torch.npu`` or
``torch.cuda`` itself.
"""

from __future__ import annotations

from functools import cache

from vllm.ascend import envs
from vllm.ascend.device.base import Device


@cache
def current() -> Device:
    if envs.emulate():
        if envs.kernels() == "npu":
            from vllm.ascend.device.npu import NPUPathDevice

            return NPUPathDevice()
        from vllm.ascend.device.host import HostDevice

        return HostDevice()
    from vllm.ascend.device.npu import NPUDevice

    return NPUDevice()


def npu_device_count() -> int:
    """Number of NPUs torch_npu sees, 0 if torch_npu cannot load on this host."""
    from vllm.ascend.device.npu_runtime import load_torch_npu

    torch_npu = load_torch_npu()
    if torch_npu is None:
        return 0
    try:
        return int(torch_npu.npu.device_count())
    except Exception:  # a driver that cannot enumerate devices counts as none
        return 0
