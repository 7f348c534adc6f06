"""Device communicator: collectives on the device process group.

The group's backend is the platform's ``dist_backend``: HCCL on an NPU, gloo in host
emulation. The torch.distributed calls are the same for both, which is why one class
serves both modes; upstream's base class already issues them on ``device_group``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase


class NPUCommunicator(DeviceCommunicatorBase):
    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(input_, group=self.device_group)
        return input_
