"""The Ascend NPU platform.

One class for both modes: on an NPU it drives torch_npu/HCCL; ``host.py`` subclasses
it for host emulation, changing only the device identity and communication backend.
Worker, model runner, attention backends, MoE method and communicator are the same
classes in both modes; only ``vllm.ascend.device`` and ``vllm.ascend.kernels`` differ.
"""

from __future__ import annotations

import functools
import os
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

from vllm.ascend import device as ascend_device
from vllm.ascend.attention.registry import (
    ATTENTION_BACKEND,
    BACKEND_PATHS,
    MLA_BACKEND,
    SPARSE_MLA_BACKEND,
    register_attention_backends,
)
from vllm.ascend.errors import AscendConfigError, AscendStartupError
from vllm.ascend.platform.checks import check_dtype, run_checks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = init_logger(__name__)

WORKER_CLS = "vllm.ascend.worker.worker.NPUWorker"


@functools.cache
def _register_kernel_overrides() -> None:
    """Upstream's Triton kernels that have no torch fallback, replaced by the torch
    forms of ``vllm.ascend.worker.v2``. Once per process: registering again would wrap the wrappers."""
    from vllm.ascend.worker.v2.kernel_table import register_kernel_forms

    register_kernel_forms()


def _adjust(what: str, reason: str) -> None:
    logger.info_once("Ascend platform: %s (%s)", what, reason)


def _default_multiproc_method() -> None:
    """Workers start with ``spawn`` unless the caller chose otherwise: a forked worker
    inherits the parent's device runtime half-initialised on an NPU. A caller's choice is
    kept (upstream's XPU platform does the same) and said, since ``fork`` is safe only
    while the parent has not opened the device (always so in host emulation)."""
    chosen = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    if chosen is None:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    elif chosen != "spawn":
        logger.warning_once(  # once: every engine config of the process passes here
            "VLLM_WORKER_MULTIPROC_METHOD=%s is kept as set; on an NPU, workers forked after "
            "this process opened the device cannot use it: unset it (the platform's default "
            "is spawn) if workers fail to start",
            chosen,
        )


def _no_shared_experts_stream() -> None:
    """Upstream overlaps an MoE layer's shared experts on a side stream synchronised by
    ``torch.cuda.Event``s, which this platform does not have (the Ascend MoE runs them in
    its own step): the side stream stays off, and a caller's request for it is answered."""
    chosen = os.environ.get("VLLM_DISABLE_SHARED_EXPERTS_STREAM")
    if chosen is not None and chosen.strip() not in ("", "1"):
        logger.warning_once(
            "VLLM_DISABLE_SHARED_EXPERTS_STREAM=%s is overridden with 1: the shared experts' side "
            "stream synchronises with CUDA events, which the Ascend platform does not provide",
            chosen,
        )
    os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] = "1"


def _check_not_bootstrapping() -> None:
    """A script that builds an engine at import time, re-imported by a spawned child:
    say why, before Python's own bootstrapping error (which names neither vLLM nor the fix)."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise AscendStartupError(
            "this script creates a vLLM engine when it is imported: the Ascend platform starts "
            "the engine and its workers with multiprocessing's 'spawn' method (a forked process "
            "would inherit a half-initialised NPU runtime), which imports the script again in "
            "each new process; put the code that creates the LLM under "
            '`if __name__ == "__main__":`'
        )


class NPUPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "npu"
    device_type: str = "npu"
    dispatch_key: str = "PrivateUse1"
    ray_device_key: str = "NPU"
    device_control_env_var: str = "ASCEND_RT_VISIBLE_DEVICES"
    # Ray's NPU accelerator would narrow ASCEND_RT_VISIBLE_DEVICES per actor; upstream's
    # Ray executor maps local ranks to the devices Ray assigned itself, so keep them all
    ray_noset_device_env_vars: list[str] = ["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"]
    dist_backend: str = "hccl"
    simple_compile_backend: str = "eager"  # no inductor lowering for NPU here
    supported_quantization: list[str] = []

    emulated: bool = False
    # Context parallelism shards a sequence's KV over PCP x DCP ranks
    # (vllm/ascend/context_parallel/placement.py; the hook is this distribution's patch).
    kv_cache_sharded_over_pcp: bool = True
    # The MoE experts (kernels/moe.py) allocate their own scratch: upstream's modular kernel
    # then allocates their output directly, not in the shared workspace, which stays locked
    # after graph capture (patch fused-moe-let-a-platform-s-experts-keep-their-own-scratch).
    # AllToAll's data-dependent rows no longer grow a buffer every graph keeps a copy of.
    moe_experts_own_scratch: bool = True

    @classmethod
    def draft_decode_host_seq_lens(
        cls, seq_lens_cpu_upper_bound: torch.Tensor, num_rejected: torch.Tensor, num_reqs: int
    ) -> torch.Tensor:
        """A drafter's decode steps: the Ascend attention takes host lengths, so the
        rejected drafts come off them on the host too (patch
        ``speculators-let-the-platform-take-rejected-drafts-off-host``)."""
        from vllm.ascend.worker.v2.seq_lens import draft_decode_host_seq_lens

        return draft_decode_host_seq_lens(
            seq_lens_cpu_upper_bound, num_rejected, num_reqs, ascend_device.current()
        )

    @classmethod
    def pre_register_and_update(cls, parser: Any = None) -> None:
        # before any ModelConfig checks the method name: ``--quantization ascend``
        import vllm.ascend.quantization.config  # noqa: F401  (registers through its decorator)

    @classmethod
    def detect_quantization(cls, model: str, revision: str | None) -> str | None:
        """``ascend`` for an msModelSlim checkpoint (upstream's model config asks when no
        method is named: patch ``model-config-let-the-platform-recognise-a-quantized-checkpoint``)."""
        from vllm.transformers_utils.repo_utils import file_or_path_exists

        from vllm.ascend.quantization.description import FILENAME

        try:
            found = file_or_path_exists(model, FILENAME, revision)
        except Exception:  # a hub lookup that cannot be made: no format of ours to recognise
            return None
        if not found:
            return None
        import vllm.ascend.quantization.config  # noqa: F401  (registers the name)

        return "ascend"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        from vllm.ascend.kernels import kernel_dtypes

        return kernel_dtypes()

    # -- device queries: all through the device layer -------------------------
    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return ascend_device.current().device_name(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        # Only where this process already owns a device (a worker): asking anywhere
        # else would initialise the NPU runtime there (the API server must not).
        total = ascend_device.current().total_memory(device_id)
        if total is None:
            raise RuntimeError("the NPU runtime is not initialised in this process")
        return total

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        return float(ascend_device.current().memory_allocated())

    @classmethod
    def set_device(cls, device: torch.device | int) -> None:
        # Upstream callers pass either (KV connectors pass the bare index).
        index = device if isinstance(device, int) else device.index
        ascend_device.current().set_device(index or 0)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)

    def is_sleep_mode_available(self) -> bool:
        return True  # the worker's storage-level sleep mode (worker/sleep.py)

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return not cls.emulated

    @classmethod
    def is_uva_available(cls) -> bool:
        # torch_npu has no device view of a pinned host tensor: Model Runner V2 copies
        # its host buffers explicitly (hook patch platform-utils-let-the-platform-say-whether-uva-is-available)
        return False

    # -- Model Runner V2's streams and events (hook patch on the V2 runner) -------------
    @classmethod
    def new_stream(cls, device: Any = None) -> Any:
        return ascend_device.current().stream()

    @classmethod
    def new_event(cls, blocking: bool = False, enable_timing: bool = False) -> Any:
        return ascend_device.current().event(blocking=blocking, enable_timing=enable_timing)

    @classmethod
    def current_device_stream(cls, device: Any = None) -> Any:
        return ascend_device.current().current_stream()

    @classmethod
    def stream_context(cls, stream: Any) -> AbstractContextManager:
        return ascend_device.current().stream_context(stream)

    @classmethod
    def set_current_stream(cls, stream: Any) -> None:
        ascend_device.current().set_stream(stream)

    @classmethod
    def record_tensor_stream(cls, tensor: torch.Tensor, stream: Any) -> None:
        ascend_device.current().record_stream(tensor, stream)

    def supports_eplb(self) -> bool:
        # The Ascend MoE methods map routes to physical experts and record the load
        # themselves (moe/eplb.py) (hook patch parallel-config-let-the-platform-say-whether-it-runs-eplb)
        return True

    @classmethod
    def runs_model_runner_v2_without_triton(cls) -> bool:
        # the V2 kernels on the paths the platform allows have torch forms
        # (vllm.ascend.worker.v2, worker/block_tables.py)
        return True

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        check_dtype(dtype)

    @classmethod
    def import_kernels(cls) -> None:
        # There is no vllm._C in this wheel: kernels come from vllm.ascend.kernels.
        pass

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        _register_kernel_overrides()

    # -- decode graphs: ACL graphs (vllm/ascend/graph; hook patch on V2's graph manager) --
    @classmethod
    def support_static_graph_mode(cls) -> bool:
        # ACL graphs hold the NPU kernels; the reference kernels read host values (host emulation)
        from vllm.ascend.kernels import npu_kernels

        return npu_kernels()

    @classmethod
    def new_graph(cls) -> Any:
        from vllm.ascend.graph.capture import AscendGraph

        return AscendGraph()

    @classmethod
    def graph_capture_context(cls, device: Any, stream: Any = None) -> AbstractContextManager:
        from vllm.ascend.graph.capture import capture_context

        return capture_context(stream)

    @classmethod
    def capture_graph(cls, graph: Any, pool: Any, stream: Any) -> AbstractContextManager:
        from vllm.ascend.graph.capture import capture

        return capture(graph, pool, stream)

    @classmethod
    def profiles_graph_memory(cls) -> bool:
        return True  # the torch.accelerator memory figures torch_npu answers (the device layer in emulation)

    @classmethod
    def graph_pool_handle(cls) -> Any:
        return ascend_device.current().graph_pool_handle()

    @classmethod
    def current_stream(cls) -> Any:
        return ascend_device.current().current_stream()

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        # vLLM's hybrid KV-cache manager overlays the groups of a model with mixed
        # attention (e.g. full + sliding window) on the same per-layer regions. Every
        # group reads its region as planes in the same proportion (K|V halves, equal
        # page sizes), so a block's bytes mean the same in every group's view
        # (attention/kv_layout.py). Served here: Gemma 3 and gpt-oss (windowed and full
        # layers) equal transformers (tests/engine/test_model_families.py).
        return True

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        # Layers sharing a layer index (cross + self attention, draft layers) are fine:
        # the attention backends take each layer's cache from the layer itself, never
        # from the runner's per-index list.
        pass

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.ascend.distributed.communicator.NPUCommunicator"

    @classmethod
    def device_group_options(cls, group_name: str, backend: Any) -> object | None:
        # Each HCCL group's own buffer size (the hook patch on parallel_state.py); MC2's
        # group keeps HCCL_BUFFSIZE. vllm/ascend/distributed/groups.py explains.
        from vllm.ascend.distributed.groups import device_group_options

        return device_group_options(group_name, backend)

    @classmethod
    def get_punica_wrapper(cls) -> str:
        return "vllm.ascend.lora.punica.PunicaWrapperNPU"

    # -- attention ------------------------------------------------------------
    @classmethod
    def get_attn_backend_cls(
        cls,
        selected_backend: AttentionBackendEnum,
        attn_selector_config: AttentionSelectorConfig,
        num_heads: int | None = None,
    ) -> str:
        if attn_selector_config.use_sparse and not attn_selector_config.use_mla:
            raise NotImplementedError(
                "sparse attention other than DeepSeek's sparse MLA is not supported on Ascend"
            )
        if attn_selector_config.use_sparse:
            name = SPARSE_MLA_BACKEND
        else:
            name = MLA_BACKEND if attn_selector_config.use_mla else ATTENTION_BACKEND
        if selected_backend is not None and getattr(selected_backend, "name", None) != name:
            logger.info_once(
                "Ascend platform: ignoring attention backend %s, using %s", selected_backend, name
            )
        return BACKEND_PATHS[name]

    @classmethod
    def sparse_indexer_cls(cls, default: type) -> type:
        # DeepSeek V3.2's indexer with an unquantized key cache (the hook patch on deepseek_v2.py)
        from vllm.ascend.ops.dsa_indexer import AscendIndexer

        return AscendIndexer

    @classmethod
    def get_mla_prefill_backend_cls(cls, mla_selector_config: Any) -> type:
        # The Ascend MLA impl runs prefill itself (vllm.ascend.attention.mla); the shared
        # MLA metadata builder still wants a prefill backend object to clone.
        from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

        return CPUSDPAMLAPrefillBackend

    # -- configuration ----------------------------------------------------------
    @classmethod
    def check_context_parallel_sizes(cls, tp: int, pcp: int, dcp: int) -> None:
        # The model-dependent rules (KV heads, interleave) are checked with the model in
        # check_and_update_config.
        from vllm.ascend.context_parallel.placement import CPLayout, LayoutError

        try:
            CPLayout(tp=tp, pcp=pcp, dcp=dcp).check()
        except LayoutError as exc:  # not a ValueError here: pydantic would report it on many lines
            raise AscendConfigError(str(exc)) from None

    @classmethod
    def validate_environ(cls, hard_fail: bool) -> None:
        # upstream's check, knowing the distribution's own variables as well
        from vllm import envs

        from vllm.ascend.envs import unknown_variables

        runner = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        if runner not in (None, "1"):  # as upstream says it (its V1 runner is gone), in one line
            raise AscendConfigError(
                f"VLLM_USE_V2_MODEL_RUNNER={runner} is no longer supported: Model Runner V1 has been "
                "removed. Unset this variable."
            )
        for name in os.environ:
            if hint := envs.removed_environment_variables.get(name):
                raise AscendConfigError(f"{name} has been removed. {hint}")
        known = [*envs.environment_variables, "VLLM_USE_V2_MODEL_RUNNER"]
        for name, likely in unknown_variables(os.environ, known).items():
            hint = f" (did you mean {likely}?)" if likely else ""
            if hard_fail:
                raise ValueError(f"Unknown vLLM environment variable detected: {name}{hint}")
            logger.warning("Unknown vLLM environment variable detected: %s%s", name, hint)

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        """What the platform adjusts in the engine config (each logged with its reason),
        then its start-up rules (``checks.py``), then the environment its workers need."""
        from vllm.config import CompilationMode

        from vllm.ascend.graph.policy import choose_graph_mode

        _check_not_bootstrapping()
        register_attention_backends()
        cache_config = vllm_config.cache_config
        parallel_config = vllm_config.parallel_config
        compilation_config = vllm_config.compilation_config

        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = WORKER_CLS
            _adjust(f"worker {WORKER_CLS}", "the Ascend worker and model runner, in both modes")
        if cache_config is not None and not cache_config.user_specified_block_size:
            cache_config.block_size = cls.default_block_size()
            _adjust(f"KV cache block size {cache_config.block_size}", cls.block_size_reason())
        if compilation_config.mode != CompilationMode.NONE:
            compilation_config.mode = CompilationMode.NONE
            _adjust(
                "torch.compile off",
                "no torch.compile backend for Ascend in this distribution (decode steps may run as ACL graphs)",
            )
        choose_graph_mode(vllm_config)
        if parallel_config.enable_eplb and parallel_config.eplb_config.use_async:
            parallel_config.eplb_config.use_async = False
            _adjust(
                "EPLB rearranges synchronously",
                "upstream's asynchronous EPLB worker thread runs on CUDA and XPU streams only",
            )
        if parallel_config.enable_dbo:
            parallel_config.enable_dbo = False
            _adjust("dual-batch overlap off", "not supported on Ascend")
        if parallel_config.use_sequence_parallel_moe:
            # Upstream splits the tokens of DP x TP + EP MoE layers over TP ("sequence
            # parallel"); on this platform that path decodes differently from transformers
            # (measured with the tiny DeepSeek-V3 at DP 2 x TP 2, every strategy), so the
            # Ascend strategies split over TP themselves instead.
            parallel_config.all2all_backend = "naive"
            _adjust("sequence-parallel MoE off", "its DP x TP + EP decode is not yet correct on Ascend")

        run_checks(vllm_config)

        _default_multiproc_method()
        _no_shared_experts_stream()

    @classmethod
    def set_additional_forward_context(cls, *args: Any, **kwargs: Any) -> dict:
        # The MoE strategy of this forward, from values every DP/EP rank shares.
        from vllm.ascend.moe.step import installed_plan

        plan = installed_plan()  # None: not a worker of an MoE model
        step = (
            None
            if plan is None
            else plan.step_for_forward(
                kwargs.get("num_tokens"),
                kwargs.get("num_tokens_across_dp"),
                in_graph=ascend_device.current().is_capturing(),
            )
        )
        return {} if step is None else {"ascend_moe": step}

    @classmethod
    def default_block_size(cls) -> int:
        from vllm.ascend.kernels.attention import NPU_DEFAULT_BLOCK_SIZE

        return NPU_DEFAULT_BLOCK_SIZE

    @classmethod
    def block_size_reason(cls) -> str:
        return "the block size the torch_npu attention kernels are built for"
