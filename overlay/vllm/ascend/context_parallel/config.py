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


def validate_context_parallel(vllm_config) -> None:
    """Raise ValueError naming what to change, or return."""
    pc = vllm_config.parallel_config
    if pc.prefill_context_parallel_size * pc.decode_context_parallel_size == 1:
        return
    context_parallel_layout(vllm_config).check()
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
    model = vllm_config.model_config
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
