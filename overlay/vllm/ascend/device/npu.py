"""The Ascend NPU, through torch_npu (not verified on an NPU from this repository's CI)."""

from __future__ import annotations

from contextlib import contextmanager

from vllm.logger import init_logger

from vllm.ascend.device.base import Device
from vllm.ascend.device.npu_runtime import load_torch_npu

logger = init_logger(__name__)


class NPUDevice(Device):
    """The NPU runtime is initialised by ``set_device`` (a worker choosing its NPU).
    Until then nothing here touches the runtime: the API server and engine-core
    processes must not create NPU contexts of their own."""

    type = "npu"

    def __init__(self) -> None:
        torch_npu = load_torch_npu()
        if torch_npu is None:
            from vllm.ascend.device.npu_runtime import failure_reason

            raise RuntimeError(f"Ascend NPU requested but {failure_reason()}")
        self._npu = torch_npu.npu
        self._initialised = False
        self._index: int | None = None
        self._graphs_captured = 0

    def set_device(self, index: int) -> None:
        self._npu.set_device(index)
        self._initialised, self._index = True, index
        logger.info(
            "Ascend device %d: SoC version %s (%s)", index, self._npu.get_soc_version(), self.soc_generation()
        )

    def bind_thread(self) -> None:
        if self._index is not None:
            self._npu.set_device(self._index)

    def synchronize(self) -> None:
        self._npu.synchronize()

    def empty_cache(self) -> None:
        self._npu.empty_cache()

    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        free, total = self._npu.mem_get_info(index)
        return int(free), int(total)

    def memory_allocated(self) -> int:
        return int(self._npu.memory_allocated())

    def device_name(self, index: int = 0) -> str:
        if not self._initialised:
            return "Ascend NPU"
        return str(self._npu.get_device_name(index))

    def total_memory(self, index: int = 0) -> int | None:
        if not self._initialised:
            return None
        return self.mem_get_info(index)[1]

    def stream(self) -> object:
        return self._npu.Stream()

    def event(self, **kwargs) -> object:
        return self._npu.Event(**kwargs)

    def current_stream(self) -> object:
        return self._npu.current_stream()

    def stream_context(self, stream):
        return self._npu.stream(stream)

    def set_stream(self, stream) -> None:
        self._npu.set_stream(stream)

    # -- graphs: torch_npu's NPUGraph (vllm/ascend/graph) --------------------------------
    def new_graph(self) -> object:
        return self._npu.NPUGraph()

    def graph_pool_handle(self) -> object:
        return self._npu.graph_pool_handle()

    @contextmanager
    def capture_graph(self, graph, pool, stream):
        # auto_dispatch_capture: torch_npu records each fused-attention call as a task group
        # its update can rewrite (npu/graphs.py, _GraphDispatchMode)
        with self._npu.graph(graph, pool=pool, stream=stream, auto_dispatch_capture=True):
            yield
        self._graphs_captured += 1

    @property
    def graphs_captured(self) -> int:
        return self._graphs_captured

    def replay_graph(self, graph, host_args: dict | None) -> None:
        """Replay the graph, then rewrite its fused-attention tasks with this step's host
        arguments. Each such task waits in the graph for an external event that torch_npu's
        update records after re-issuing it on the update stream, so the replay is launched
        first and its attention tasks run as their updates land (the host does not re-tile
        every layer before the launch; torch_npu's ``CapturedGraphUpdateAndReplay`` and
        vllm-ascend order them so). The update stream's wait for the work queued so far comes
        before the replay: it keeps an earlier replay still running from seeing this step's
        arguments, and taken after the replay it would wait for the replay that waits for it."""
        mode = graph.graph_dispatch_mode
        if not mode.graph_dispatch_records:
            graph.replay()
            return
        if host_args is None:
            raise RuntimeError(
                "an NPU graph with fused-attention tasks was replayed before any attention "
                "metadata gave their host arguments"
            )
        mode.update_stream.wait_stream(self._npu.current_stream())
        graph.replay()
        graph.update(cpu_update_input=[host_args])

    def is_capturing(self) -> bool:
        return bool(self._npu.is_current_stream_capturing())

    def soc_generation(self) -> str:
        # torch_npu.npu.get_soc_version() returns torch_npu's c10_npu::SocVersion: Atlas A2
        # parts are Ascend910B1 = 220 .. Ascend910B4_1 = 225, A3 parts Ascend910_9391 = 250
        # .. Ascend910_9362 = 255 (the ranges vllm-ascend's device-type detection uses).
        version = int(self._npu.get_soc_version())
        if 220 <= version <= 225:
            return "A2"
        if 250 <= version <= 255:
            return "A3"
        return "other"

    def comm_name(self, group) -> str:
        import torch
        import torch.distributed as dist

        # The group's backend for this device's tensors: HCCL on an NPU (torch_npu's
        # documented way to name a communicator for its MC2 ops).
        backend = group._get_backend(torch.device(self.type))
        return backend.get_hccl_comm_name(dist.get_rank(group=group))

    def cann_version(self) -> str:
        try:
            from torch_npu.npu.utils import get_cann_version  # documented in torch_npu

            return str(get_cann_version())
        except Exception as exc:
            return f"unknown ({exc})"


class NPUPathDevice(NPUDevice):
    """NPU-path mode (host emulation running the torch_npu kernels; tests only): this
    NPUDevice's runtime calls -- SoC generation, streams, events, synchronisation,
    HCCL communicator names -- are answered by the torch_npu that imports on the host
    (the test suite's contract double), while tensors stay on the CPU, collectives run
    on gloo and the memory figures are the host's, as in host emulation."""

    type = "cpu"

    def __init__(self) -> None:
        super().__init__()
        from vllm.ascend.device.host import HostDevice

        self._host = HostDevice()

    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        return self._host.mem_get_info(index)

    def memory_allocated(self) -> int:
        return self._host.memory_allocated()

    def accelerator_memory_info(self) -> tuple[int, int]:
        # The double's device memory (its graph pools count against it): upstream's
        # graph-memory measurements then see what the graphs hold, not the host's noise.
        free, total = self._npu.mem_get_info()
        return int(free), int(total)

    def record_stream(self, tensor, stream) -> None:
        self._host.record_stream(tensor, stream)  # the tensors are host tensors

    def device_name(self, index: int = 0) -> str:
        return f"{super().device_name(index)} (NPU-path mode on the host CPU)"

    def total_memory(self, index: int = 0) -> int | None:
        return self._host.total_memory(index)
