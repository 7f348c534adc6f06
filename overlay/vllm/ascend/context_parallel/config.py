"""Start-up checks for context parallelism on the Ascend platform.

Options (upstream's flags): ``--prefill-context-parallel-size`` (PCP: more ranks, each
runs part of every prefill), ``--decode-context-parallel-size`` (DCP: TP ranks that
split a sequence's KV instead of replicating it) and ``--cp-kv-cache-interleave-size``
(tokens stored on one rank before the next; divides the block size). The layout rule is
``placement.py``; what the platform has not been built or tested for is refused here.
"""

from __future__ import annotations

from vllm.ascend.attention.kv_layout import connector_addresses_planes
from vllm.ascend.context_parallel.placement import CPLayout


def context_parallel_layout(vllm_config) -> CPLayout:
    pc, model = vllm_config.parallel_config, vllm_config.model_config
    return CPLayout(
        tp=pc.tensor_parallel_size,
        pcp=pc.prefill_context_parallel_size,
        dcp=pc.decode_context_parallel_size,
        dp=pc.data_parallel_size,
        interleave=pc.cp_kv_cache_interleave_size,
        block_size=vllm_config.cache_config.block_size,
        kv_heads=None if model.use_mla else model.get_total_num_kv_heads(),
    )


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


def validate_context_parallel(vllm_config) -> None:
    """Raise ValueError naming what to change, or return."""
    pc = vllm_config.parallel_config
    if pc.prefill_context_parallel_size * pc.decode_context_parallel_size == 1:
        return
    context_parallel_layout(vllm_config).check()
    from vllm.ascend.kernels import npu_kernels

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
    from vllm.ascend.platform.model_features import has_attention_sinks

    if has_attention_sinks(model):
        raise ValueError("context parallelism with attention sinks is not supported yet")
