"""The Ascend worker: upstream's GPU worker with the device set up through vllm.ascend.device."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from vllm.config import set_current_vllm_config
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

from vllm.ascend import device as ascend_device
from vllm.ascend import envs
from vllm.ascend.kernels import npu_kernels
from vllm.ascend.registration import register_runtime_components

logger = init_logger(__name__)


def device_local_rank(parallel_config, local_rank: int) -> int:
    """The device index of this worker on its node.

    With data parallelism launched by vLLM's own multiprocessing on one node, every
    DP rank's workers start counting local ranks at 0; DP rank ``d`` owns devices
    ``d * (TP x PCP x PP) ...``, as upstream's GPU worker computes it."""
    if (parallel_config.data_parallel_size <= 1
            or parallel_config.distributed_executor_backend in ("ray", "external_launcher")
            or parallel_config.data_parallel_backend == "ray"
            or parallel_config.nnodes_within_dp != 1):
        return local_rank
    dp_local_rank = parallel_config.data_parallel_rank_local
    if dp_local_rank is None:
        dp_local_rank = parallel_config.data_parallel_index
    per_dp_rank = (parallel_config.pipeline_parallel_size * parallel_config.prefill_context_parallel_size
                   * parallel_config.tensor_parallel_size)
    return local_rank + dp_local_rank * per_dp_rank


class NPUWorker(Worker):
    def __init__(self, *args, **kwargs) -> None:
        register_runtime_components()
        super().__init__(*args, **kwargs)

    def init_device(self) -> None:
        dev = ascend_device.current()
        if not envs.emulate():
            self.local_rank = device_local_rank(self.parallel_config, self.local_rank)
            visible = ascend_device.npu_device_count()
            if self.local_rank >= visible:
                raise RuntimeError(
                    f"worker needs NPU {self.local_rank} but {visible} are visible; check "
                    "ASCEND_RT_VISIBLE_DEVICES against TP x PCP x PP x local DP ranks")
        self.device = dev.torch_device(self.local_rank)
        dev.set_device(self.local_rank)
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank,
            current_platform.dist_backend,
        )
        from vllm.ascend.distributed.groups import init_context_parallel_group

        init_context_parallel_group(self.parallel_config, current_platform.dist_backend)
        if self.model_config.is_moe:
            from vllm.ascend.distributed.groups import init_mc2_group
            from vllm.ascend.moe.step import worker_layout

            if worker_layout(self.vllm_config)[0].expert_parallel:
                init_mc2_group(current_platform.dist_backend)
        set_random_seed(self.model_config.seed)
        self._init_workspace_and_model_runner()

    def _make_model_runner(self):
        from vllm.ascend.worker.model_runner import NPUModelRunner

        return NPUModelRunner(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str) -> AbstractContextManager:
        # No sleep-mode memory pool on Ascend (sleep mode is refused at config time).
        return nullcontext()

    def determine_available_memory(self) -> int:
        dev = ascend_device.current()
        if npu_kernels():
            # One forward of the largest batch, attention included, inside the config
            # context the model layers read: it sizes NPU workspaces, and in host
            # emulation it runs the NPU kernels' shapes through the contract double.
            with set_current_vllm_config(self.vllm_config):
                self.model_runner.profile_run()
            dev.synchronize()
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            return int(explicit)
        if envs.emulate():
            size = envs.host_kv_cache_bytes()
            logger.info("Host emulation: %d MiB for the KV cache (VLLM_ASCEND_HOST_KV_CACHE_MB)",
                        size >> 20)
            return size
        # NPU: what the utilisation budget leaves after the profile (the caching
        # allocator keeps the profile's peak reserved). Not verified on an NPU.
        free, total = dev.mem_get_info(self.local_rank)
        budget = int(total * self.cache_config.gpu_memory_utilization) - (total - free)
        if budget <= 0:
            raise ValueError(
                f"no NPU memory left for the KV cache ({free >> 20} MiB free of {total >> 20} MiB "
                f"at gpu_memory_utilization={self.cache_config.gpu_memory_utilization}); raise "
                "--gpu-memory-utilization or use a smaller model / --max-model-len")
        return budget

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # Eager execution: nothing to compile or capture (see the platform's config log).
        set_random_seed(self.model_config.seed)
        return CompilationTimes(
            language_model=self.compilation_config.compilation_time,
            encoder=self.compilation_config.encoder_compilation_time,
        )

    def sleep(self, level: int = 1) -> None:
        raise RuntimeError("sleep mode is not supported on Ascend")

    def wake_up(self, tags: list[str] | None = None) -> None:
        raise RuntimeError("sleep mode is not supported on Ascend")
