"""The Ascend worker: upstream's GPU worker with the device set up through vllm.ascend.device."""

from __future__ import annotations

import gc
from contextlib import AbstractContextManager, nullcontext

import torch

from vllm.config import set_current_vllm_config
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.mem_utils import MemorySnapshot
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import request_memory
from vllm.v1.worker.worker_base import CompilationTimes

from vllm.ascend import device as ascend_device
from vllm.ascend import envs
from vllm.ascend.kernels import npu_kernels
from vllm.ascend.registration import register_runtime_components, register_state_layer_components

logger = init_logger(__name__)


def device_local_rank(parallel_config, local_rank: int, visible: int | None = None) -> int:
    """The device index of this worker on its node, by upstream's rules for a worker that
    sees every device of its node (its GPU and XPU workers).

    With vLLM's own launcher each DP rank's workers count local ranks from 0, so DP rank
    ``d`` owns devices ``d x replica ...`` (replica: TP x PCP x PP ranks). With an
    external load balancer every DP rank is a process of its own that knows only its
    global DP index: the node holds ``visible // replica`` replicas, filled in DP order.
    Ray and external launchers assign devices themselves. ``visible``: the devices this
    process sees (needed with an external load balancer only)."""
    pc = parallel_config
    if (
        pc.data_parallel_size <= 1
        or pc.distributed_executor_backend in ("ray", "external_launcher")
        or pc.data_parallel_backend == "ray"
        or not (pc.data_parallel_external_lb or pc.nnodes_within_dp == 1)
    ):
        return local_rank
    replica = pc.world_size
    if not pc.data_parallel_external_lb:
        dp_local_rank = pc.data_parallel_rank_local
        if dp_local_rank is None:
            dp_local_rank = pc.data_parallel_index
        return local_rank + dp_local_rank * replica
    if visible is None:
        raise ValueError("an external DP load balancer needs the number of visible NPUs")
    if pc.nnodes_within_dp > 1:
        replica = pc.local_world_size  # the replica spans nodes: its share on this node
    if replica > visible:
        raise RuntimeError(
            f"one DP replica needs {replica} NPUs on this node (TP x PCP x PP) but {visible} are visible; "
            "every DP rank must see all NPUs of its node: check ASCEND_RT_VISIBLE_DEVICES"
        )
    replicas_on_node = visible // replica
    if visible % replica:
        logger.warning(
            "%d visible NPUs hold %d DP replicas of %d NPUs; %d stay unused",
            visible,
            replicas_on_node,
            replica,
            visible % replica,
        )
    return local_rank + (pc.data_parallel_index % replicas_on_node) * replica


class NPUWorker(Worker):
    local_rank: int  # upstream's (annotation only)

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        register_runtime_components()
        if vllm_config.model_config is not None and vllm_config.model_config.is_hybrid:
            register_state_layer_components()  # (importing them costs a second and a half)
        super().__init__(vllm_config, *args, **kwargs)

    def init_device(self) -> None:
        dev = ascend_device.current()
        index = self.local_rank
        if not envs.emulate():
            visible = ascend_device.npu_device_count()
            self.local_rank = device_local_rank(self.parallel_config, self.local_rank, visible)
            assigned = self.parallel_config.assigned_physical_gpu_ids
            if assigned is not None:  # the launcher named this node's devices (upstream's rule)
                from vllm.platforms.interface import set_assigned_physical_gpu_ids

                set_assigned_physical_gpu_ids(assigned)
                if self.local_rank >= len(assigned):
                    raise RuntimeError(
                        f"worker {self.local_rank} has no NPU among the assigned ids {assigned}"
                    )
            elif self.local_rank >= visible:
                raise RuntimeError(
                    f"worker needs NPU {self.local_rank} but {visible} are visible; check "
                    "ASCEND_RT_VISIBLE_DEVICES against TP x PCP x PP x local DP ranks"
                )
            index = current_platform.logical_device_id_to_visible_device_id(self.local_rank)
        self.device = dev.torch_device(index)
        dev.set_device(index)
        self._log_soc_notes(dev)
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            current_platform.dist_backend,
        )
        from vllm.ascend.distributed.groups import init_context_parallel_group

        init_context_parallel_group(self.parallel_config, current_platform.dist_backend)
        if self.model_config.is_moe:
            self._init_moe_plan(dev)
        set_random_seed(self.model_config.seed)
        if not envs.emulate():
            # Upstream's accounting (as its XPU worker does): the snapshot after the
            # communicators exist is what the utilisation budget applies to.
            gc.collect()
            dev.empty_cache()
            self.init_snapshot = MemorySnapshot(device=self.device)
            self.requested_memory = request_memory(self.init_snapshot, self.cache_config)
        self._init_workspace_and_model_runner()

    def _log_soc_notes(self, dev) -> None:
        from vllm.ascend.kernels import npu_kernels, soc_notes

        soc = dev.soc_generation()
        if self.rank == 0 and npu_kernels() and soc in ("A2", "A3"):
            for note in soc_notes(soc):
                logger.warning("Ascend kernels on %s: %s (NPU-unverified here)", soc, note)

    def _init_moe_plan(self, dev) -> None:
        """The MoE layout, worked out once before the model is built; its layers and the
        forward-context hook read it. A forced strategy is checked against the SoC and, on
        an A2/A3 NPU, MC2 against the MC2 group's HCCL buffer (HCCL_BUFFSIZE, the smallest
        any rank has). The MC2 group and its communicator (with that buffer) are made here,
        before the KV cache is sized, and only when some step can use MC2."""
        from vllm.ascend import envs
        from vllm.ascend.distributed import groups
        from vllm.ascend.errors import AscendConfigError
        from vllm.ascend.moe.step import MoEPlan, install_plan

        soc = dev.soc_generation()
        buffsize = groups.agreed_minimum(envs.hccl_buffsize_mb()) if soc in ("A2", "A3") else None
        try:
            plan = MoEPlan.from_config(self.vllm_config, soc, buffsize)
        except ValueError as exc:
            raise AscendConfigError(str(exc)) from None
        install_plan(plan)
        if plan.layout.expert_parallel and plan.may_use_mc2:
            groups.init_mc2_group(current_platform.dist_backend)
            groups.init_mc2_communicator()

    def _make_model_runner(self):
        # the platform refused at start-up whatever Model Runner V2 does not run here
        from vllm.ascend.worker.model_runner import NPUModelRunner as runner_cls

        if self.rank == 0:
            logger.info("Ascend model runner: %s (Model Runner V2)", runner_cls.__name__)
            scheduling = "async" if self.vllm_config.scheduler_config.async_scheduling else "sync"
            logger.info("Ascend model runner scheduling: %s", scheduling)
        return runner_cls(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str) -> AbstractContextManager:
        # Sleep mode releases tensor storages itself (worker/sleep.py): no allocator pool.
        return nullcontext()

    def determine_available_memory(self) -> int:
        if not envs.emulate():
            # Upstream's profile (memory snapshots around one forward of the largest batch)
            # runs this runner's profile_run, which includes attention, so the NPU
            # attention workspaces count. Not verified on an NPU.
            return super().determine_available_memory()
        if npu_kernels():
            # NPU-path mode: the same profile forward runs the NPU kernels' shapes through
            # the contract double, inside the config context the model layers read; then
            # upstream's graph-memory profile (it captures the largest graphs over a minimal
            # KV cache, as on an NPU, where the estimate comes off the KV cache's share).
            with set_current_vllm_config(self.vllm_config):
                self.model_runner.profile_run()
                if self._graphs_on():
                    estimate = self.model_runner.profile_cudagraph_memory()
                    logger.info(
                        "Ascend graphs: %.1f MiB of graph memory estimated before the KV cache is "
                        "sized (host emulation sizes the KV cache by VLLM_ASCEND_HOST_KV_CACHE_MB)",
                        estimate / 2**20,
                    )
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            return int(explicit)
        size = envs.host_kv_cache_bytes()
        logger.info("Host emulation: %d MiB for the KV cache (VLLM_ASCEND_HOST_KV_CACHE_MB)", size >> 20)
        return size

    def _graphs_on(self) -> bool:
        from vllm.config.compilation import CUDAGraphMode

        return (
            self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
            and not self.model_config.enforce_eager
        )

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # Nothing to compile (no torch.compile here); decode graphs are captured when on
        # (vllm/ascend/graph; the platform's config log says whether and why not).
        if self._graphs_on():
            with set_current_vllm_config(self.vllm_config):
                self.model_runner.capture_model()
        set_random_seed(self.model_config.seed)
        return CompilationTimes(
            language_model=self.compilation_config.compilation_time,
            encoder=self.compilation_config.encoder_compilation_time,
        )

    # -- sleep mode (worker/sleep.py) ---------------------------------------------------
    @property
    def sleep_mode_backend(self):
        if self._sleep_mode_backend is None:
            from vllm.ascend.worker.sleep import StorageSleepBackend

            self._sleep_mode_backend = StorageSleepBackend(
                self.device, ascend_device.current(), current_platform.is_pin_memory_available()
            )
        return self._sleep_mode_backend

    def _require_sleep_mode(self) -> None:
        if not self.model_config.enable_sleep_mode:
            raise RuntimeError(
                "sleep mode is off for this engine: start it with --enable-sleep-mode "
                "(LLM(..., enable_sleep_mode=True)) to use sleep and wake_up"
            )

    def sleep(self, level: int = 1) -> None:
        self._require_sleep_mode()
        backend = self.sleep_mode_backend
        backend.suspend(level, self._collect_sleep_storages())  # a bad level: refused, nothing released
        self._log_sleep(level, backend.report)

    def _collect_sleep_storages(self) -> dict[int, bool]:
        runner = self.model_runner
        models = [("", runner.model)]
        draft = self.get_draft_model()
        if draft is not None:
            models.append(("draft.", draft))
        kv_caches = list(getattr(runner, "kv_caches", []))
        for layer in self.compilation_config.static_forward_context.values():
            cache = getattr(layer, "kv_cache", None)
            if isinstance(cache, torch.Tensor):
                kv_caches.append(cache)
        return self.sleep_mode_backend.collect(
            models, kv_caches, self.model_config.sleep_preserve_parameter_names
        )

    def _log_sleep(self, level: int, report) -> None:
        logger.info(
            "Sleep level %d released %.1f MiB of weights (%.1f MiB copied to host) and %.1f MiB "
            "of KV cache; device memory in use %.1f -> %.1f MiB",
            level,
            report.released["weights"] / 2**20,
            report.copied_to_host / 2**20,
            report.released["kv_cache"] / 2**20,
            report.device_in_use_before / 2**20,
            report.device_in_use_after / 2**20,
        )

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._require_sleep_mode()
        self.sleep_mode_backend.resume(tags)

    def discard(self, tags: tuple[str, ...]) -> None:
        self._require_sleep_mode()
        self._collect_sleep_storages()
        self.sleep_mode_backend.discard(tags)

    def sleep_report(self) -> dict:
        """The last sleep's figures and what is asleep now (collective_rpc("sleep_report"))."""
        backend = self.sleep_mode_backend
        return {**backend.report.as_dict(), "asleep": sorted(backend.asleep_tags())}
