"""Stand-in platform on a host with no usable NPU and no host-emulation opt-in."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.platforms.interface import Platform, PlatformEnum

from vllm.ascend.errors import NoNPUError
from vllm.ascend.platform.detect import no_npu_message

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class NoNPUPlatform(Platform):
    """Lets the CLI build its parsers (device type "cpu" only so that default
    configs construct) and refuses any engine with a message that says what to do."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        raise NoNPUError(no_npu_message())

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "none"
