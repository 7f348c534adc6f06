"""Host emulation (``VLLM_ASCEND_EMULATE=1``): the NPU platform, run on the host CPU.

For development and CI, not a CPU inference product: it runs the same worker, model
runner, attention backends, MoE method and communicator as NPU mode, with the device
layer answering for the CPU, gloo instead of HCCL, and the reference kernels.
"""

from __future__ import annotations

from vllm.ascend.platform.npu import NPUPlatform

HOST_BLOCK_SIZE = 16


class HostEmulationPlatform(NPUPlatform):
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    ray_device_key: str = "CPU"
    dist_backend: str = "gloo"
    emulated: bool = True

    @classmethod
    def default_block_size(cls) -> int:
        return HOST_BLOCK_SIZE

    @classmethod
    def block_size_reason(cls) -> str:
        return ("host emulation: small blocks so tiny test prompts exercise block "
                "boundaries and prefix-cache hits")

    @classmethod
    def inference_mode(cls):
        import torch

        return torch.no_grad()
