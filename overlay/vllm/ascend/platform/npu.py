"""The Ascend NPU platform.

One class for both modes: on an NPU it drives torch_npu/HCCL; ``host.py`` subclasses
it for host emulation, changing only the device identity and communication backend.
Worker, model runner, attention backends, MoE method and communicator are the same
classes in both modes; only ``vllm.ascend.device`` and ``vllm.ascend.kernels`` differ.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import torch

from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

from vllm.ascend import device as ascend_device
from vllm.ascend.errors import AscendConfigError, AscendStartupError
from vllm.ascend.platform.model_features import check_model_features

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = init_logger(__name__)

ATTENTION_BACKEND = "ASCEND_ATTN"
MLA_BACKEND = "ASCEND_MLA"
_BACKEND_PATHS = {
    ATTENTION_BACKEND: "vllm.ascend.attention.backend.AscendAttentionBackend",
    MLA_BACKEND: "vllm.ascend.attention.mla.AscendMLABackend",
}
WORKER_CLS = "vllm.ascend.worker.worker.NPUWorker"
NPU_BLOCK_SIZE = 128  # the block size the NPU paged-attention kernels are built for


def register_attention_backends() -> None:
    """Make our backend names members of vLLM's backend enum (per process, idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name, path in _BACKEND_PATHS.items():
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, path)


def _check_block_size(block_size: int, use_mla: bool) -> None:
    """The NPU kernels' page-attention block sizes (the reference kernels take any)."""
    from vllm.ascend.kernels import npu_kernels

    if not npu_kernels():
        return
    if use_mla:
        ok, rule = block_size in (16, 128), "16 or 128 (torch_npu MLA attention)"
    else:
        ok = block_size % 128 == 0 and 128 <= block_size <= 512
        rule = "a multiple of 128 from 128 to 512 (torch_npu page attention)"
    if not ok:
        raise AscendConfigError(
            f"--block-size {block_size} is not supported by the Ascend NPU attention "
            f"kernels: use {rule}, e.g. --block-size {NPU_BLOCK_SIZE}"
        )


def _check_atb(use_mla: bool) -> None:
    """The MLA KV-cache write is an ATB op (``torch_npu._npu_reshape_and_cache``), which
    needs the NNAL package; torch_npu imports without it and fails only at the first ATB
    call (the first MLA step), so it is checked here."""
    from vllm.ascend.kernels import npu_kernels

    if not (use_mla and npu_kernels()):
        return
    from vllm.ascend.device.npu_runtime import NNAL_SET_ENV, atb_failure

    reason = atb_failure()
    if reason is not None:
        raise AscendConfigError(
            "MLA models need torch_npu's ATB ops (the KV-cache write _npu_reshape_and_cache), "
            f"which cannot load: {reason}; install the Ascend NNAL package that matches CANN "
            f"and run 'source {NNAL_SET_ENV}' (set_env.sh under your NNAL install path) "
            "before starting vLLM"
        )


# npu_fused_infer_attention_score limits that depend only on the model and the parallel
# layout (torch_npu 2.14.0 _op_plugin_docs.py): "支持N轴小于等于256, 支持D轴小于等于512";
# "输入类型全为float16、bfloat16时, D轴需16对齐."; "需要满足num_heads整除num_key_value_heads,
# num_heads与num_key_value_heads的比值不能大于64."
NPU_ATTENTION_MAX_HEADS = 256
NPU_ATTENTION_MAX_HEAD_SIZE = 512
NPU_ATTENTION_HEAD_SIZE_ALIGN = 16
NPU_ATTENTION_MAX_GROUP = 64


def _check_npu_attention_shapes(vllm_config) -> None:
    """The NPU attention kernels' documented head limits, per rank as the kernels call
    them (a DCP decode attends with the DCP group's query heads), checked once here
    instead of failing the first step. ValueError naming what to change."""
    from vllm.ascend.kernels import npu_kernels

    model, pc = vllm_config.model_config, vllm_config.parallel_config
    if not npu_kernels() or model.is_attention_free:
        return
    dcp = pc.decode_context_parallel_size
    heads = model.get_num_attention_heads(pc) * dcp
    if model.use_mla:
        from vllm.ascend.kernels import mla

        hf = model.hf_text_config
        mla.check_npu_dims(hf.kv_lora_rank, hf.qk_rope_head_dim)
        mla.npu_padded_heads(heads)
        return
    kv_heads, head_size = model.get_num_kv_heads(pc), model.get_head_size()
    where = f"{heads} query heads and {kv_heads} KV heads per rank, head size {head_size}"
    if heads > NPU_ATTENTION_MAX_HEADS or head_size > NPU_ATTENTION_MAX_HEAD_SIZE:
        raise ValueError(
            f"the NPU attention kernel (torch_npu npu_fused_infer_attention_score) takes at most "
            f"{NPU_ATTENTION_MAX_HEADS} query heads and head size {NPU_ATTENTION_MAX_HEAD_SIZE}; "
            f"this model has {where}: raise --tensor-parallel-size"
            + (" or lower --decode-context-parallel-size" if dcp > 1 else "")
        )
    if head_size % NPU_ATTENTION_HEAD_SIZE_ALIGN:
        raise ValueError(
            f"the NPU attention kernel (torch_npu npu_fused_infer_attention_score) needs a head size "
            f"that is a multiple of {NPU_ATTENTION_HEAD_SIZE_ALIGN} for float16/bfloat16; this model has {where}"
        )
    if heads % kv_heads or heads // kv_heads > NPU_ATTENTION_MAX_GROUP:
        raise ValueError(
            f"the NPU attention kernel (torch_npu npu_fused_infer_attention_score) needs the query "
            f"heads to be a multiple of the KV heads, at most {NPU_ATTENTION_MAX_GROUP} per KV head; "
            f"this model has {where}"
        )


@functools.cache
def _register_kernel_overrides() -> None:
    """Upstream's Triton kernels that have no torch fallback, replaced by the kernels
    facade. Once per process: registering again would wrap the wrappers."""
    from vllm.ascend.kernels.v2_runner import register_v2_runner_overrides
    from vllm.ascend.kernels.v2_sampling import register_v2_sampling_overrides
    from vllm.ascend.kernels.v2_spec_decode import register_v2_spec_decode_overrides

    register_v2_runner_overrides()
    register_v2_sampling_overrides()
    register_v2_spec_decode_overrides()


def _adjust(what: str, reason: str) -> None:
    logger.info_once("Ascend platform: %s (%s)", what, reason)


def _check_runner(vllm_config: VllmConfig) -> None:
    """What the Ascend model runner (upstream's Model Runner V2, the only runner since 0.34)
    does not run, refused here in one line that names why (upstream refuses what its own
    runner lacks itself, after this check)."""
    if vllm_config.watermark_config is not None or vllm_config.attention_config.hisparse_config is not None:
        raise AscendConfigError("watermarking and HiSparse are not supported on Ascend yet")
    unsupported = v2_unsupported_features(vllm_config)
    if unsupported:
        methods = any(u.startswith("speculative method") for u in unsupported)
        raise AscendConfigError(
            f"the Ascend model runner does not run {'; '.join(unsupported)}"
            + (f" (speculative methods it runs: {', '.join(V2_SPEC_METHODS)})" if methods else "")
        )


def _check_lora(model_config) -> None:
    """LoRA runs through the torch punica wrapper (lora/punica.py) on dense models. Here,
    before any process starts, rather than as a worker traceback: upstream's LoRA for
    fused MoE layers needs its Triton kernels, and an MLA layer's absorbed ``kv_b_proj``
    bypasses the LoRA layer (measured: tokens differ from transformers + peft)."""
    kinds = [k for k, on in (("MoE", model_config.is_moe), ("MLA", model_config.use_mla)) if on]
    if kinds:
        raise AscendConfigError(
            f"LoRA on {' and '.join(kinds)} models is not supported on Ascend yet (dense models "
            "are); drop --enable-lora or serve the adapter merged into the base weights"
        )


def _check_sleep_mode(model_config) -> None:
    """Sleep mode here is the worker's own (worker/sleep.py): upstream's allocator-based
    backends and NCCL communicator suspension have no Ascend form."""
    if model_config.sleep_mode_backend != "cumem":  # upstream's default name: ours takes it
        raise AscendConfigError(
            f"sleep-mode backend {model_config.sleep_mode_backend!r} is not offered on Ascend: "
            "drop --sleep-mode-backend (the Ascend worker releases weights and KV cache itself)"
        )
    if model_config.enable_nccl_comm_suspend:
        raise AscendConfigError(
            "communicator suspension during sleep is not offered on Ascend (HCCL buffers stay "
            "allocated): drop --enable-nccl-comm-suspend"
        )


V2_SPEC_METHODS = ("mtp", "ngram", "ngram_gpu", "draft_model", "eagle")
# speculative methods whose drafters run in decode graphs (the MTP/EAGLE speculator's own
# graph managers); the others keep the whole step eager
GRAPH_SPEC_METHODS = ("mtp", "eagle")


def graph_refusal(vllm_config: VllmConfig) -> str | None:
    """Why decode graphs stay off for this configuration (None: they may run)."""
    pc, spec = vllm_config.parallel_config, vllm_config.speculative_config
    model = vllm_config.model_config
    if pc.prefill_context_parallel_size > 1 or pc.decode_context_parallel_size > 1:
        return "context parallelism is not captured in graphs yet"
    if pc.pipeline_parallel_size > 1:
        return "pipeline parallelism is not captured in graphs yet"
    if vllm_config.lora_config is not None:
        return "LoRA adapters are not captured in graphs yet"
    if model is not None and model.enable_sleep_mode:
        return "sleep mode releases and re-creates the tensors a captured graph points at"
    from vllm.platforms import current_platform

    if current_platform.opaque_attention_op():
        # torch_npu's capture only sees ops dispatched outside a Python custom op: the fused
        # attention inside one would keep its capture-time lengths at every replay
        return "attention runs inside one opaque custom op, where the graph update cannot reach it"
    from vllm.ascend.moe.selector import MoEComm
    from vllm.ascend.moe.step import forced

    if forced(vllm_config) is MoEComm.ALLTOALL:
        return "a forced AllToAll takes its split sizes from the device counts on the host (use mc2 or allgather)"
    if spec is not None and spec.method not in GRAPH_SPEC_METHODS:
        only = ", ".join(GRAPH_SPEC_METHODS)
        return f"the speculative method '{spec.method}' is not captured in graphs (only {only})"
    return None


def _default_multiproc_method() -> None:
    """Workers start with ``spawn`` unless the caller chose otherwise: a forked worker
    inherits the parent's device runtime half-initialised on an NPU. A caller's choice is
    kept (upstream's XPU platform does the same) and said, since ``fork`` is safe only
    while the parent has not opened the device (always so in host emulation)."""
    chosen = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    if chosen is None:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    elif chosen != "spawn":
        logger.warning(
            "VLLM_WORKER_MULTIPROC_METHOD=%s is kept as set; on an NPU, workers forked after "
            "this process opened the device cannot use it: unset it (the platform's default "
            "is spawn) if workers fail to start",
            chosen,
        )


def _check_pd_trust(vllm_config: VllmConfig) -> None:
    """P/D with the Ascend connector needs the deployment's secret (kv_transfer/trust.py), or
    ``insecure`` said on purpose; refused at start-up with what to set."""
    kv = vllm_config.kv_transfer_config
    if kv is None or kv.kv_connector != "AscendP2PConnector":
        return
    from vllm.ascend.kv_transfer.trust import SecretMissing, load_secret

    extra = kv.kv_connector_extra_config or {}
    try:
        secret = load_secret(extra.get("secret_file"), extra.get("insecure") is True)
    except SecretMissing as exc:
        raise AscendConfigError(str(exc)) from None
    if secret is None:
        logger.warning(
            "P/D without a shared secret (kv_connector_extra_config.insecure): kv_transfer_params are "
            "not signed and control messages not authenticated; any host that reaches the control "
            "and transport ports can read and free this instance's KV (docs/pd_disaggregation.md, Security)"
        )


def _choose_graph_mode(vllm_config: VllmConfig) -> None:
    """Decode graphs (FULL_DECODE_ONLY) where the NPU kernels run, as upstream resolved the
    mode (``--enforce-eager`` gives NONE); steps with a prefill run eagerly, and without
    torch.compile there are no piecewise graphs. Refused combinations run eagerly, logged
    with the reason."""
    from vllm.config.compilation import CUDAGraphMode

    compilation_config = vllm_config.compilation_config
    if compilation_config.cudagraph_mode == CUDAGraphMode.NONE:
        _no_graph_sizes(compilation_config)
        return
    reason = graph_refusal(vllm_config)
    if reason is not None:
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        _no_graph_sizes(compilation_config)
        _adjust("decode graphs off", reason)
        return
    if compilation_config.cudagraph_mode != CUDAGraphMode.FULL_DECODE_ONLY:
        compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    # upstream sized decode graphs by request count (n requests x 1 + k tokens each)
    sizes = compilation_config.decode_cudagraph_capture_request_sizes or []
    _adjust(
        f"decode graphs (FULL_DECODE_ONLY) for {len(sizes)} batch sizes up to "
        f"{compilation_config.max_decode_cudagraph_capture_requests} requests",
        "ACL graphs through torch_npu; steps with a prefill run eagerly; --enforce-eager turns them off",
    )


def _no_graph_sizes(compilation_config) -> None:
    """No graphs: none to size (the sizes upstream resolved say what would be captured)."""
    compilation_config.cudagraph_capture_sizes = []
    compilation_config.max_cudagraph_capture_size = 0
    compilation_config.prefill_cudagraph_capture_token_sizes = []
    compilation_config.max_prefill_cudagraph_capture_tokens = 0
    compilation_config.decode_cudagraph_capture_request_sizes = []
    compilation_config.max_decode_cudagraph_capture_requests = 0


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


def v2_unsupported_features(vllm_config: VllmConfig) -> list[str]:
    """What the Ascend runner does not run, in upstream's wording (its own list may name
    the same method: the check drops repeats)."""
    unsupported = []
    spec = vllm_config.speculative_config
    if spec is not None and spec.method not in V2_SPEC_METHODS:
        # the torch forms (kernels/v2_spec_decode.py) cover these drafters' kernels only
        unsupported.append(f"speculative method '{spec.method}'")
    # opt-in paths whose Triton kernels have no torch form here (they would be launched)
    if spec is not None and getattr(spec, "enable_adaptive_verification", False):
        unsupported.append("adaptive verification")
    if getattr(vllm_config.parallel_config, "enable_batch_sharded_sampling", False):
        unsupported.append("batch-sharded sampling")
    model = vllm_config.model_config
    if model is not None and getattr(model, "enable_trace_replay", False):
        unsupported.append("trace replay")
    return unsupported


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
    def pre_register_and_update(cls, parser=None) -> None:
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
    def new_stream(cls, device=None):
        return ascend_device.current().stream()

    @classmethod
    def new_event(cls, blocking: bool = False, enable_timing: bool = False):
        return ascend_device.current().event(blocking=blocking, enable_timing=enable_timing)

    @classmethod
    def current_device_stream(cls, device=None):
        return ascend_device.current().current_stream()

    @classmethod
    def stream_context(cls, stream):
        return ascend_device.current().stream_context(stream)

    @classmethod
    def set_current_stream(cls, stream) -> None:
        ascend_device.current().set_stream(stream)

    @classmethod
    def record_tensor_stream(cls, tensor, stream) -> None:
        ascend_device.current().record_stream(tensor, stream)

    @classmethod
    def runs_model_runner_v2_without_triton(cls) -> bool:
        # the V2 kernels on the paths the platform allows have torch forms
        # (vllm.ascend.kernels.v2_runner, worker/block_tables.py)
        return True

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        from vllm.ascend.kernels import kernel_dtypes, npu_kernels

        if dtype not in kernel_dtypes():
            names = ", ".join(str(d).removeprefix("torch.") for d in kernel_dtypes())
            kernels = (
                "the Ascend NPU kernels (torch_npu attention takes float16/bfloat16)"
                if npu_kernels()
                else "the Ascend reference kernels"
            )
            raise AscendConfigError(
                f"dtype {str(dtype).removeprefix('torch.')} is not supported by {kernels}; "
                f"use --dtype with one of: {names}"
            )

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
    def new_graph(cls):
        from vllm.ascend.graph.capture import AscendGraph

        return AscendGraph()

    @classmethod
    def graph_capture_context(cls, device, stream=None):
        from vllm.ascend.graph.capture import capture_context

        return capture_context(stream)

    @classmethod
    def capture_graph(cls, graph, pool, stream):
        from vllm.ascend.graph.capture import capture

        return capture(graph, pool, stream)

    @classmethod
    def profiles_graph_memory(cls) -> bool:
        return True  # the torch.accelerator memory figures torch_npu answers (the device layer in emulation)

    @classmethod
    def graph_pool_handle(cls):
        return ascend_device.current().graph_pool_handle()

    @classmethod
    def current_stream(cls):
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
    def device_group_options(cls, group_name: str, backend) -> object | None:
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
        if attn_selector_config.use_sparse:
            raise NotImplementedError("sparse attention is not supported on Ascend yet")
        name = MLA_BACKEND if attn_selector_config.use_mla else ATTENTION_BACKEND
        if selected_backend is not None and getattr(selected_backend, "name", None) != name:
            logger.info_once(
                "Ascend platform: ignoring attention backend %s, using %s", selected_backend, name
            )
        return _BACKEND_PATHS[name]

    @classmethod
    def get_mla_prefill_backend_cls(cls, mla_selector_config):
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
        from vllm.config import CompilationMode

        _check_not_bootstrapping()
        register_attention_backends()
        cache_config = vllm_config.cache_config
        parallel_config = vllm_config.parallel_config
        compilation_config = vllm_config.compilation_config
        scheduler_config = vllm_config.scheduler_config

        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = WORKER_CLS
            _adjust(f"worker {WORKER_CLS}", "the Ascend worker and model runner, in both modes")

        model_config = vllm_config.model_config
        if model_config is not None:
            cls.check_if_supports_dtype(model_config.dtype)
            _check_atb(model_config.use_mla)
        if cache_config is not None and not cache_config.user_specified_block_size:
            cache_config.block_size = cls.default_block_size()
            _adjust(f"KV cache block size {cache_config.block_size}", cls.block_size_reason())
        elif cache_config is not None and model_config is not None:
            _check_block_size(cache_config.block_size, model_config.use_mla)

        if compilation_config.mode != CompilationMode.NONE:
            compilation_config.mode = CompilationMode.NONE
            _adjust(
                "torch.compile off",
                "no torch.compile backend for Ascend in this distribution (decode steps may run as ACL graphs)",
            )
        _choose_graph_mode(vllm_config)

        if scheduler_config.async_scheduling and vllm_config.speculative_config is not None:
            scheduler_config.async_scheduling = False
            _adjust(
                "async scheduling off with speculative decoding",
                "the Ascend attention kernels take each request's exact sequence length from the "
                "host, and with drafts in flight the host knows only an upper bound",
            )
        if parallel_config.enable_dbo:
            parallel_config.enable_dbo = False
            _adjust("dual-batch overlap off", "not supported on Ascend")
        _check_runner(vllm_config)
        if model_config is not None:
            check_model_features(vllm_config)
        if vllm_config.lora_config is not None and model_config is not None:
            _check_lora(model_config)
        if model_config is not None and model_config.enable_sleep_mode:
            _check_sleep_mode(model_config)

        if parallel_config.use_sequence_parallel_moe:
            # Upstream splits the tokens of DP x TP + EP MoE layers over TP ("sequence
            # parallel"); on this platform that path decodes differently from transformers
            # (measured with the tiny DeepSeek-V3 at DP 2 x TP 2, every strategy), so the
            # Ascend strategies split over TP themselves instead.
            parallel_config.all2all_backend = "naive"
            _adjust("sequence-parallel MoE off", "its DP x TP + EP decode is not yet correct on Ascend")
        if model_config is not None:
            from vllm.ascend.context_parallel.config import validate_context_parallel
            from vllm.ascend.moe.step import validate_config
            from vllm.ascend.spec_decode.config import validate_speculative_config

            try:
                validate_config(vllm_config)
                validate_speculative_config(vllm_config)
                validate_context_parallel(vllm_config)
                _check_npu_attention_shapes(vllm_config)
            except ValueError as exc:
                raise AscendConfigError(str(exc)) from None

        _check_pd_trust(vllm_config)
        _default_multiproc_method()
        # No side streams for shared experts on this platform.
        os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] = "1"

    @classmethod
    def set_additional_forward_context(cls, *args, **kwargs) -> dict:
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
        return NPU_BLOCK_SIZE

    @classmethod
    def block_size_reason(cls) -> str:
        return "the block size the torch_npu attention kernels are built for"
