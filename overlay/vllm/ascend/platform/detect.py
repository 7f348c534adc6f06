"""Which platform this process runs: called by vLLM's builtin platform detection."""

from __future__ import annotations

from contextlib import contextmanager

from vllm.ascend import envs

NPU = "vllm.ascend.platform.npu.NPUPlatform"
HOST = "vllm.ascend.platform.host.HostEmulationPlatform"
UNAVAILABLE = "vllm.ascend.platform.unavailable.NoNPUPlatform"


class NoNPUError(RuntimeError):
    """Serving was asked for on a host with no usable NPU and no host-emulation opt-in."""


def detect_platform() -> str:
    """Always a platform of this distribution: the wheel exists to run on Ascend.

    Without an NPU and without ``VLLM_ASCEND_EMULATE=1`` the stand-in platform lets
    ``--version``, ``--help`` and ``collect-env`` work and refuses to start an engine.
    """
    if envs.emulate():
        return HOST
    from vllm.ascend.device import npu_device_count

    return NPU if npu_device_count() > 0 else UNAVAILABLE


def no_npu_message() -> str:
    from vllm.ascend.device.npu_runtime import failure_reason

    reason = failure_reason() or "torch_npu sees no NPU"
    return (
        f"no Ascend NPU is available ({reason}); on an Ascend host install CANN and "
        "check ASCEND_RT_VISIBLE_DEVICES, or set VLLM_ASCEND_EMULATE=1 to run on the "
        "host CPU (development and CI only)"
    )


@contextmanager
def exit_on_missing_npu():
    """Turn :class:`NoNPUError` into one ``error:`` line and exit status 1 (CLI hook)."""
    try:
        yield
    except NoNPUError as exc:
        raise SystemExit(f"error: {exc}") from None
