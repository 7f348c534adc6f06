"""The platform's start-up rules: what an engine configuration may not ask of the Ascend
platform, checked in the process that builds the config, before any engine-core or
worker process starts, each refused in one line that names what to change.

``CHECKS`` runs in order after the platform's adjustments (``npu.py``): the basics first
(dtype, the ATB package, the block size), then the runner, the model's features and the
features built on them, the kernels' shape limits, and P/D trust. Each ``check_*`` takes
the engine config and returns or raises; a ``ValueError`` from a room's own validator
becomes the one-line :class:`AscendConfigError`. The limits they read live beside what
they limit: op limits beside their op in ``kernels/``, speculative methods in
``spec_decode/config.py``, MoE strategies in ``moe/``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from vllm.logger import init_logger

from vllm.ascend.errors import AscendConfigError
from vllm.ascend.kernels import kernel_dtypes, npu_kernels
from vllm.ascend.platform.model_features import check_model_features, has_attention_sinks
from vllm.ascend.spec_decode.config import METHODS as SPEC_METHODS

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


def check_dtype(dtype: torch.dtype) -> None:
    """The dtypes the selected kernels take (also upstream's ``check_if_supports_dtype``)."""
    if dtype in kernel_dtypes():
        return
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


def check_model_dtype(vllm_config: VllmConfig) -> None:
    if vllm_config.model_config is not None:
        check_dtype(vllm_config.model_config.dtype)


def check_atb(vllm_config: VllmConfig) -> None:
    """The MLA KV-cache write is an ATB op (``torch_npu._npu_reshape_and_cache``), which
    needs the NNAL package; torch_npu imports without it and fails only at the first ATB
    call (the first MLA step), so it is checked here."""
    model = vllm_config.model_config
    if model is None or not (model.use_mla and npu_kernels()):
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


def check_block_size(vllm_config: VllmConfig) -> None:
    """The NPU kernels' page-attention block sizes (the reference kernels take any)."""
    cache, model = vllm_config.cache_config, vllm_config.model_config
    if cache is None or model is None or not npu_kernels():
        return
    # the kernel modules bind their forms when imported: only where the NPU ones run
    from vllm.ascend.kernels import attention as attention_kernels
    from vllm.ascend.kernels import mla as mla_kernels

    if model.use_mla:
        sizes, op = mla_kernels.NPU_MLA_BLOCK_SIZES, "torch_npu MLA attention"
    else:
        sizes, op = attention_kernels.NPU_BLOCK_SIZES, "torch_npu page attention"
    if cache.block_size not in sizes:
        raise AscendConfigError(
            f"--block-size {cache.block_size} is not supported by the Ascend NPU attention kernels: "
            f"use one of {', '.join(map(str, sorted(sizes)))} ({op}), e.g. --block-size "
            f"{attention_kernels.NPU_DEFAULT_BLOCK_SIZE}"
        )


def v2_unsupported_features(vllm_config: VllmConfig) -> list[str]:
    """What the Ascend runner does not run, in upstream's wording (its own list may name
    the same method: the check drops repeats)."""
    unsupported = []
    spec = vllm_config.speculative_config
    if spec is not None and spec.method not in SPEC_METHODS:
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


def check_runner(vllm_config: VllmConfig) -> None:
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
            + (f" (speculative methods it runs: {', '.join(SPEC_METHODS)})" if methods else "")
        )


def check_features(vllm_config: VllmConfig) -> None:
    if vllm_config.model_config is not None:
        check_model_features(vllm_config)


def check_lora(vllm_config: VllmConfig) -> None:
    """LoRA runs through the torch punica wrapper (lora/punica.py) on dense models. Here,
    before any process starts, rather than as a worker traceback: upstream's LoRA for
    fused MoE layers needs its Triton kernels, and an MLA layer's absorbed ``kv_b_proj``
    bypasses the LoRA layer (measured: tokens differ from transformers + peft)."""
    model = vllm_config.model_config
    if vllm_config.lora_config is None or model is None:
        return
    kinds = [k for k, on in (("MoE", model.is_moe), ("MLA", model.use_mla)) if on]
    if kinds:
        raise AscendConfigError(
            f"LoRA on {' and '.join(kinds)} models is not supported on Ascend yet (dense models "
            "are); drop --enable-lora or serve the adapter merged into the base weights"
        )


def check_sleep_mode(vllm_config: VllmConfig) -> None:
    """Sleep mode here is the worker's own (worker/sleep.py): upstream's allocator-based
    backends and NCCL communicator suspension have no Ascend form."""
    model = vllm_config.model_config
    if model is None or not model.enable_sleep_mode:
        return
    if model.sleep_mode_backend != "cumem":  # upstream's default name: ours takes it
        raise AscendConfigError(
            f"sleep-mode backend {model.sleep_mode_backend!r} is not offered on Ascend: "
            "drop --sleep-mode-backend (the Ascend worker releases weights and KV cache itself)"
        )
    if model.enable_nccl_comm_suspend:
        raise AscendConfigError(
            "communicator suspension during sleep is not offered on Ascend (HCCL buffers stay "
            "allocated): drop --enable-nccl-comm-suspend"
        )


def check_moe(vllm_config: VllmConfig) -> None:
    if vllm_config.model_config is not None:
        from vllm.ascend.moe.step import validate_config

        validate_config(vllm_config)


def check_speculative(vllm_config: VllmConfig) -> None:
    if vllm_config.model_config is not None:
        from vllm.ascend.spec_decode.config import validate_speculative_config

        validate_speculative_config(vllm_config)


def check_npu_partials(pcp: int, dcp: int, head_dim: int) -> None:
    """The NPU cross-rank correction (``npu_attention_update``) takes at most
    NPU_MAX_PARTIALS partial results of a head size in NPU_PARTIAL_HEAD_DIM (its limits,
    beside it in ``kernels/context_parallel.py``). ValueError."""
    from vllm.ascend.kernels.context_parallel import NPU_MAX_PARTIALS, NPU_PARTIAL_HEAD_DIM

    if pcp * dcp > NPU_MAX_PARTIALS:
        raise ValueError(
            f"prefill x decode context parallel size {pcp} x {dcp} = {pcp * dcp} is more than the "
            f"{NPU_MAX_PARTIALS} partial results the NPU attention correction (torch_npu "
            f"npu_attention_update) merges: lower --prefill-context-parallel-size or "
            "--decode-context-parallel-size"
        )
    low, high, multiple = NPU_PARTIAL_HEAD_DIM
    if not low <= head_dim <= high or head_dim % multiple:
        raise ValueError(
            f"context parallelism with the NPU kernels merges attention outputs of head size "
            f"{head_dim} with torch_npu npu_attention_update, which takes {low} to {high} in "
            f"multiples of {multiple}: set PCP and DCP to 1 for this model"
        )


def check_context_parallel(vllm_config: VllmConfig) -> None:
    """Context parallelism (``--prefill-context-parallel-size``, ``--decode-context-parallel-size``,
    ``--cp-kv-cache-interleave-size``): the layout rule (``context_parallel/placement.py``),
    then what the platform has not been built or tested for. ValueError naming what to change."""
    if vllm_config.model_config is None:
        return
    pc = vllm_config.parallel_config
    if pc.prefill_context_parallel_size * pc.decode_context_parallel_size == 1:
        return
    from vllm.ascend.attention.kv_layout import connector_addresses_planes
    from vllm.ascend.context_parallel.placement import context_parallel_layout

    context_parallel_layout(vllm_config).check()
    model = vllm_config.model_config
    if npu_kernels():  # MLA merges decode outputs in the latent space
        head_dim = model.hf_text_config.kv_lora_rank if model.use_mla else model.get_head_size()
        check_npu_partials(pc.prefill_context_parallel_size, pc.decode_context_parallel_size, head_dim)
    if vllm_config.speculative_config is not None:
        raise ValueError(
            "speculative decoding with context parallelism is not supported on Ascend yet: "
            "drop --speculative-config or set PCP and DCP to 1"
        )
    if pc.pipeline_parallel_size > 1:
        raise ValueError(
            "context parallelism with pipeline parallelism is not supported on Ascend: "
            "set --pipeline-parallel-size 1"
        )
    kv = vllm_config.kv_transfer_config
    if kv is not None and not connector_addresses_planes(kv):
        raise ValueError(
            f"context parallelism with the KV connector {kv.kv_connector} is not supported on "
            "Ascend: use AscendP2PConnector, or set PCP and DCP to 1"
        )
    if pc.prefill_context_parallel_size > 1 and pc.enable_expert_parallel and model.is_moe:
        # PCP ranks run different tokens; the Ascend MoE strategies exchange tokens over DP
        # only (measured: the tiny DeepSeek-V3 at PCP=2 with EP decodes differently).
        raise ValueError(
            "expert parallelism with prefill context parallelism is not supported on Ascend "
            "yet: drop --enable-expert-parallel (MoE layers then split experts by tensor "
            "parallelism over the TP x PCP ranks)"
        )
    if model.get_sliding_window() is not None or model.is_hybrid:
        raise ValueError(
            "context parallelism needs a model with full attention only (no sliding window, no hybrid layers)"
        )
    if getattr(model.hf_text_config, "attn_logit_softcapping", None):
        raise ValueError("context parallelism with attention logit soft-capping is not supported yet")
    if has_attention_sinks(model):
        raise ValueError("context parallelism with attention sinks is not supported yet")


def check_npu_attention_shapes(vllm_config: VllmConfig) -> None:
    """The NPU attention kernels' documented head limits (``kernels/attention.py``,
    ``kernels/mla.py``), per rank as the kernels call them (a DCP decode attends with the
    DCP group's query heads), checked once here instead of failing the first step."""
    model, pc = vllm_config.model_config, vllm_config.parallel_config
    if model is None or not npu_kernels() or model.is_attention_free:
        return
    from vllm.ascend.kernels import attention as attention_kernels
    from vllm.ascend.kernels import mla as mla_kernels

    dcp = pc.decode_context_parallel_size
    heads = model.get_num_attention_heads(pc) * dcp
    if model.use_mla:
        hf = model.hf_text_config
        mla_kernels.check_npu_dims(hf.kv_lora_rank, hf.qk_rope_head_dim)
        mla_kernels.npu_padded_heads(heads)
        return
    k = attention_kernels
    kv_heads, head_size = model.get_num_kv_heads(pc), model.get_head_size()
    where = f"{heads} query heads and {kv_heads} KV heads per rank, head size {head_size}"
    op = "the NPU attention kernel (torch_npu npu_fused_infer_attention_score)"
    if heads > k.NPU_MAX_HEADS or head_size > k.NPU_MAX_HEAD_SIZE:
        raise ValueError(
            f"{op} takes at most {k.NPU_MAX_HEADS} query heads and head size {k.NPU_MAX_HEAD_SIZE}; "
            f"this model has {where}: raise --tensor-parallel-size"
            + (" or lower --decode-context-parallel-size" if dcp > 1 else "")
        )
    if head_size % k.NPU_HEAD_SIZE_ALIGN:
        raise ValueError(
            f"{op} needs a head size that is a multiple of {k.NPU_HEAD_SIZE_ALIGN} for "
            f"float16/bfloat16; this model has {where}"
        )
    if heads % kv_heads or heads // kv_heads > k.NPU_MAX_GROUP:
        raise ValueError(
            f"{op} needs the query heads to be a multiple of the KV heads, at most "
            f"{k.NPU_MAX_GROUP} per KV head; this model has {where}"
        )


def check_pd_trust(vllm_config: VllmConfig) -> None:
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


CHECKS: tuple[Callable[[VllmConfig], None], ...] = (
    check_model_dtype,
    check_atb,
    check_block_size,
    check_runner,
    check_features,
    check_lora,
    check_sleep_mode,
    check_moe,
    check_speculative,
    check_context_parallel,
    check_npu_attention_shapes,
    check_pd_trust,
)


def run_checks(vllm_config: VllmConfig) -> None:
    """Every start-up rule, in order; the first refusal stops start-up."""
    for check in CHECKS:
        try:
            check(vllm_config)
        except ValueError as exc:  # a room's validator: one line, not pydantic's report
            raise AscendConfigError(str(exc)) from None
