"""What the runtime needs from a device, whichever one it is."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager

import torch


class Device(ABC):
    type: str  # torch device type: "npu" or "cpu"

    def torch_device(self, index: int) -> torch.device:
        return torch.device(self.type, index) if self.type != "cpu" else torch.device("cpu")

    @abstractmethod
    def set_device(self, index: int) -> None: ...

    def bind_thread(self) -> None:
        """Make the device ``set_device`` chose current on the calling thread too (an NPU's
        device context is per thread: a thread that never set one queries events and
        streams of device 0, or of none). Nothing to do on a host."""
        return None

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def empty_cache(self) -> None:
        """Return cached, unused device memory to the device."""

    @abstractmethod
    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        """(free, total) bytes of device memory."""

    @abstractmethod
    def memory_allocated(self) -> int: ...

    @abstractmethod
    def device_name(self, index: int = 0) -> str:
        """A name for logs and defaults; must not initialise a device runtime."""

    @abstractmethod
    def total_memory(self, index: int = 0) -> int | None:
        """Total device memory, or None where asking would initialise the runtime."""

    @abstractmethod
    def stream(self) -> object:
        """A new stream (what upstream's runner gets for ``torch.cuda.Stream()``)."""

    @abstractmethod
    def event(self, **kwargs) -> object: ...

    @abstractmethod
    def current_stream(self) -> object:
        """The stream work is being queued on (``torch.cuda.current_stream()``)."""

    @abstractmethod
    def stream_context(self, stream) -> AbstractContextManager:
        """Queue work on ``stream`` inside the block (``torch.cuda.stream(s)``)."""

    @abstractmethod
    def set_stream(self, stream) -> None:
        """Make ``stream`` the current one (``torch.cuda.set_stream(s)``)."""

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Keep ``tensor``'s memory until the work queued on ``stream`` is done."""
        tensor.record_stream(stream)

    @abstractmethod
    def soc_generation(self) -> str:
        """ "A2", "A3", "other" (another Ascend SoC) or "host" (emulation): what the MoE
        strategy selector and the MC2 arguments depend on."""

    # -- graphs (vllm/ascend/graph): the NPU's ACL graphs; no such thing on a host CPU --
    def new_graph(self) -> object:
        raise NotImplementedError(f"{type(self).__name__} captures no graphs: graphs need the NPU kernels")

    def graph_pool_handle(self) -> object:
        raise NotImplementedError(f"{type(self).__name__} captures no graphs: graphs need the NPU kernels")

    def capture_graph(self, graph, pool, stream) -> AbstractContextManager:
        raise NotImplementedError(f"{type(self).__name__} captures no graphs: graphs need the NPU kernels")

    def replay_graph(self, graph, host_args: dict | None) -> None:
        raise NotImplementedError(f"{type(self).__name__} captures no graphs: graphs need the NPU kernels")

    def is_capturing(self) -> bool:
        return False

    @property
    def graphs_captured(self) -> int:
        """Graphs this process captured so far (the start-up log counts them)."""
        return 0

    def accelerator_memory_info(self) -> tuple[int, int]:
        """(free, total) as upstream's ``torch.accelerator.get_memory_info`` should answer it
        in host emulation (graph memory measurements read it)."""
        return self.mem_get_info()

    @abstractmethod
    def comm_name(self, group) -> str:
        """The name under which the collective-communication library knows ``group``
        (the HCCL communicator name that torch_npu's MC2 ops take as ``group_ep``)."""
