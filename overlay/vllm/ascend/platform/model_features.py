"""Model features the Ascend attention and MoE backends do not implement yet, read from
the model's config when the platform checks the engine config: in the process that builds
it, before any engine-core or worker process is spawned. One error names every such
feature of the model and what the user can do.

The backends refuse the same features again when a layer is built (the layer is the
authority: a model may apply a feature its config does not announce in a form read here),
so a model missed here still stops, as a worker error."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.ascend.errors import AscendConfigError
from vllm.ascend.kernels import npu_kernels

if TYPE_CHECKING:  # upstream's types, for the annotations only
    from vllm.config import ModelConfig, VllmConfig

# Architectures whose upstream implementation gives every attention layer ALiBi slopes,
# and those that do when their config says so.
ALIBI_ARCHITECTURES = {"BloomForCausalLM", "Step1ForCausalLM"}
ALIBI_WHEN_CONFIGURED = {"FalconForCausalLM": "alibi", "RWForCausalLM": "alibi"}
# Attention with one learned sink logit per head.
SINK_MODEL_TYPES = {"gpt_oss"}
# Hybrids whose linear-attention layers are upstream's QwenGatedDeltaNetAttention, which
# ops/gdn.py replaces (reference kernels); other state-space and linear layers stay refused.
GATED_DELTANET_ARCHITECTURES = {"Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"}
# DeepSeek sparse attention whose indexer and sparse MLA the platform runs (GLM-5: V3.2's
# layers, its indexer's rope interleaved; upstream serves it with V3.2's model code)
SPARSE_INDEXER_ARCHITECTURES = {"DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"}


def has_attention_sinks(model_config: ModelConfig) -> bool:
    model_type = getattr(getattr(model_config, "hf_config", None), "model_type", None)
    hf_text = getattr(model_config, "hf_text_config", None)
    return model_type in SINK_MODEL_TYPES or bool(getattr(hf_text, "attention_sinks", False))


def unsupported_features(vllm_config: VllmConfig) -> list[str]:
    """Each unsupported feature of this model and configuration, as a phrase that says
    what to do where something can be done."""
    model = vllm_config.model_config
    hf = model.hf_text_config
    found = []
    soft_cap = getattr(hf, "attn_logit_softcapping", None)
    if soft_cap and npu_kernels():  # the reference kernels cap; torch_npu's fused attention cannot
        found.append(
            f"attention logit soft-capping with the NPU attention kernels (attn_logit_softcapping={soft_cap}; "
            "torch_npu's fused attention applies no cap)"
        )
    architectures = set(model.architectures or ())
    if architectures & ALIBI_ARCHITECTURES or any(
        getattr(model.hf_config, key, False)
        for arch, key in ALIBI_WHEN_CONFIGURED.items()
        if arch in architectures
    ):
        found.append("ALiBi position biases")
    if has_attention_sinks(model) and npu_kernels():
        from vllm.ascend.kernels.attention import NPU_SINK_MAX_HEAD_SIZE

        head_size = model.get_head_size()
        if head_size > NPU_SINK_MAX_HEAD_SIZE:
            found.append(
                f"attention sinks with a head size of {head_size} with the NPU attention kernels "
                f"(npu_fused_infer_attention_score_v2's learnable_sink takes at most {NPU_SINK_MAX_HEAD_SIZE})"
            )
    found += _deepseek_sparse_features(vllm_config)
    kind = model.attn_type
    if kind in ("encoder_only", "encoder_decoder"):
        found.append(f"{kind.replace('_', '-')} attention (the Ascend backends run decoder self-attention)")
    elif kind in ("hybrid", "attention_free"):
        if architectures & GATED_DELTANET_ARCHITECTURES:
            found += _gated_deltanet_limits(vllm_config)
        else:
            found.append(
                "state-space or linear-attention layers other than Qwen3-Next's and Qwen3.5's Gated "
                "DeltaNet (upstream's kernels for them need Triton)"
            )
    if model.is_moe:
        found += _moe_route_changes(model)
    zero_kind = getattr(hf, "zero_expert_type", None)
    if getattr(hf, "zero_expert_num", 0) and zero_kind != "identity":
        found.append(f"zero-computation experts of type {zero_kind!r} (the Ascend MoE runs identity ones)")
    return found


def _gated_deltanet_limits(vllm_config: VllmConfig) -> list[str]:
    """What the Gated DeltaNet layers' reference form (ops/gdn.py) does not run yet."""
    found = []
    if npu_kernels():
        found += _gated_deltanet_npu_limits(vllm_config)
    if vllm_config.cache_config.enable_prefix_caching:
        found.append(
            "prefix caching with Gated DeltaNet layers (upstream's state copies at block "
            "boundaries are Triton kernels; pass --no-enable-prefix-caching)"
        )
    if vllm_config.kv_transfer_config is not None:
        found.append("a KV connector with Gated DeltaNet layers (their states are not transferred)")
    parallel = vllm_config.parallel_config
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        found.append("context parallelism with Gated DeltaNet layers")
    return found


def _gated_deltanet_npu_limits(vllm_config: VllmConfig) -> list[str]:
    """The model's linear-attention shapes against torch_npu's Gated DeltaNet ops' limits."""
    import torch

    from vllm.ascend.kernels import gdn

    model = vllm_config.model_config
    hf = model.hf_text_config
    tp = vllm_config.parallel_config.tensor_parallel_size
    heads_k = getattr(hf, "linear_num_key_heads", 0) // tp
    heads_v = getattr(hf, "linear_num_value_heads", 0) // tp
    dk, dv = getattr(hf, "linear_key_head_dim", 0), getattr(hf, "linear_value_head_dim", 0)
    found = []
    fits = (
        0 < heads_k <= gdn.NPU_CHUNK_MAX_HEADS
        and 0 < heads_v <= gdn.NPU_CHUNK_MAX_HEADS
        and heads_v % heads_k == 0
        and dk == dv == gdn.NPU_CHUNK_HEAD_DIM
    )
    if not fits:
        found.append(
            f"Gated DeltaNet layers of {heads_k} key and {heads_v} value heads per rank, head sizes "
            f"{dk} and {dv}, with the NPU kernels (npu_chunk_gated_delta_rule takes at most "
            f"{gdn.NPU_CHUNK_MAX_HEADS} heads of each, value heads a multiple of key heads, head size "
            f"{gdn.NPU_CHUNK_HEAD_DIM}; the reference kernels run them: VLLM_ASCEND_KERNELS=reference)"
        )
    state_dtype = vllm_config.cache_config.mamba_ssm_cache_dtype
    if model.dtype != torch.bfloat16 or state_dtype not in ("auto", "bfloat16"):
        found.append(
            f"Gated DeltaNet layers in {model.dtype} with a {state_dtype} state cache with the NPU kernels "
            "(torch_npu's Gated DeltaNet ops take bfloat16 inputs and states: --dtype bfloat16 "
            "--mamba-ssm-cache-dtype auto)"
        )
    spec = vllm_config.speculative_config
    if spec is not None and (spec.num_speculative_tokens or 0) + 1 > gdn.NPU_RECURRENT_MAX_TOKENS:
        found.append(
            f"{spec.num_speculative_tokens} draft tokens with Gated DeltaNet layers with the NPU kernels "
            f"(npu_recurrent_gated_delta_rule verifies at most {gdn.NPU_RECURRENT_MAX_TOKENS} tokens per "
            f"sequence: at most {gdn.NPU_RECURRENT_MAX_TOKENS - 1} draft tokens)"
        )
    return found


def _deepseek_sparse_features(vllm_config: VllmConfig) -> list[str]:
    """DeepSeek V3.2's and V4's layers the Ascend backends lack, each named as the config
    announces it. V3.2's and GLM-5's (the same layers) indexer and sparse MLA run with
    both kernel sets (attention/sparse_mla.py; the NPU ops' limits checked here), with
    drafts and KV connectors, without context parallelism."""
    from vllm.model_executor.models.utils import compute_skip_topk_layers
    from vllm.transformers_utils.deepseek_v4_utils import get_compress_ratios

    model = vllm_config.model_config
    hf = model.hf_text_config
    found = []
    if hasattr(hf, "index_topk"):
        served = set(model.architectures or ()) <= SPARSE_INDEXER_ARCHITECTURES
        parallel = vllm_config.parallel_config
        shared = sorted(compute_skip_topk_layers(hf))
        limits = [
            (not served, "other than DeepSeek-V3.2's and GLM-5's"),
            (
                bool(shared),
                f"whose layers {', '.join(map(str, shared[:4]))}{' ...' if len(shared) > 4 else ''} reuse "
                "an earlier layer's selection (index_topk_freq, index_topk_pattern or indexer_types "
                "'shared')",
            ),
            *(_npu_indexer_limits(hf, parallel) if npu_kernels() else []),
            (
                parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1,
                "with context parallelism",
            ),
        ]
        found += [
            f"sparse attention with a lightning indexer (index_topk={hf.index_topk}) {what}"
            for refused, what in limits
            if refused
        ]
    ratios = sorted({r for r in get_compress_ratios(hf) if r > 1})  # 0: a sliding-window layer
    if ratios:
        found.append(f"compressed attention (compress ratios {', '.join(map(str, ratios))})")
    if getattr(hf, "hc_mult", 1) > 1:
        found.append(f"hyper-connections (hc_mult={hf.hc_mult})")
    hash_layers = getattr(hf, "num_hash_layers", None)
    if hash_layers is None:
        hash_layers = list(getattr(hf, "mlp_layer_types", None) or ()).count("hash_moe")
    if hash_layers:
        found.append(f"hash-routed MoE layers ({hash_layers})")
    return found


def _npu_indexer_limits(hf, parallel) -> list[tuple[bool, str]]:
    """npu_lightning_indexer's and npu_sparse_flash_attention's documented limits (A2/A3)
    the model must meet with the NPU kernels: (refused, what) pairs."""
    from vllm.ascend.kernels import dsa

    heads = hf.num_attention_heads // parallel.tensor_parallel_size
    return [
        (
            hf.index_head_dim != dsa.NPU_INDEXER_HEAD_DIM,
            f"with the NPU kernels and index_head_dim {hf.index_head_dim} (npu_lightning_indexer takes "
            f"{dsa.NPU_INDEXER_HEAD_DIM})",
        ),
        (
            hf.index_n_heads > dsa.NPU_INDEXER_MAX_HEADS,
            f"with the NPU kernels and index_n_heads {hf.index_n_heads} (npu_lightning_indexer takes at "
            f"most {dsa.NPU_INDEXER_MAX_HEADS})",
        ),
        (
            hf.index_topk not in dsa.NPU_INDEXER_TOPK,
            f"with the NPU kernels and index_topk {hf.index_topk} (npu_lightning_indexer keeps 1-2048, "
            "3072, 4096, 5120, 6144, 7168 or 8192)",
        ),
        (
            heads > dsa.NPU_SPARSE_MAX_HEADS,
            f"with the NPU kernels and {heads} attention heads per rank (npu_sparse_flash_attention takes "
            f"at most {dsa.NPU_SPARSE_MAX_HEADS}: raise --tensor-parallel-size)",
        ),
    ]


def _moe_route_changes(model) -> list[str]:
    """Upstream options that change an MoE layer's routes between routing and experts (the
    Ascend MoE routes and runs the experts in one method)."""
    import vllm.envs as vllm_envs

    found = []
    if vllm_envs.VLLM_MOE_ROUTING_SIMULATION_STRATEGY:
        found.append("MoE routing simulation (unset VLLM_MOE_ROUTING_SIMULATION_STRATEGY)")
    if _mentions_expert_substitution(model):
        # upstream's parser decides (an empty declaration substitutes nothing); importing it
        # loads the fused-MoE package, ~2.5 s in the API server, so only when declared
        from vllm.model_executor.layers.fused_moe.expert_substitution import get_expert_substitution_spec

        if get_expert_substitution_spec(model) is not None:
            found.append("MoE expert substitution (approximate_experts)")
    return found


def _mentions_expert_substitution(model) -> bool:
    """The config keys upstream's expert substitution reads."""
    if any(
        getattr(c, "approximate_experts", None) is not None for c in (model.hf_text_config, model.hf_config)
    ):
        return True
    compression = getattr(model.hf_config, "compression_config", None)
    transform = compression.get("transform_config") if isinstance(compression, dict) else None
    return isinstance(transform, dict) and "expert_substitution" in transform


def check_model_features(vllm_config: VllmConfig) -> None:
    found = unsupported_features(vllm_config)
    if found:
        raise AscendConfigError(
            f"not supported on Ascend yet: {'; '.join(found)} (docs/models.md, 'Supported models')"
        )
