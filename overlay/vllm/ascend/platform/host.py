"""Host emulation (``VLLM_ASCEND_EMULATE=1``): the NPU platform, run on the host CPU.

For development and CI, not a CPU inference product: it runs the same worker, model
runner, attention backends, MoE method and communicator as NPU mode, with the device
layer answering for the CPU, gloo instead of HCCL, and the reference kernels.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from vllm.ascend.platform.npu import NPUPlatform

HOST_BLOCK_SIZE = 16


class HostEmulationPlatform(NPUPlatform):
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    # as on an NPU host: clusters declare `--resources '{"NPU": N}'` (Ray reserves "CPU")
    ray_device_key: str = "NPU"
    dist_backend: str = "gloo"
    emulated: bool = True

    def __init__(self) -> None:
        # This process's current_platform: from here on upstream's torch.accelerator
        # calls (synchronise, empty_cache at shutdown and in test fixtures) are answered
        # for the CPU, in every process: API server, engine core, workers, tests.
        from vllm.ascend import device
        from vllm.ascend.device.host import answer_accelerator_calls, skip_final_collection_at_exit

        answer_accelerator_calls(lambda: device.current().accelerator_memory_info())
        skip_final_collection_at_exit()

    @classmethod
    def default_block_size(cls) -> int:
        from vllm.ascend.kernels import npu_kernels

        return super().default_block_size() if npu_kernels() else HOST_BLOCK_SIZE

    @classmethod
    def block_size_reason(cls) -> str:
        from vllm.ascend.kernels import npu_kernels

        if npu_kernels():
            return "host emulation running the NPU kernels: the torch_npu attention block size"
        return (
            "host emulation: small blocks so tiny test prompts exercise block "
            "boundaries and prefix-cache hits"
        )

    @classmethod
    def inference_mode(cls) -> AbstractContextManager:
        import torch

        return torch.no_grad()
