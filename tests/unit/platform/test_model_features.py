"""Model features the Ascend backends do not implement are refused while upstream's
EngineArgs builds the engine config (the platform's check), in one AscendConfigError that
names each feature, before any engine process exists. The configs are transformers'
config classes with tiny sizes, written as config.json; no weights are needed to build a
config."""

from __future__ import annotations

import multiprocessing

import pytest
from transformers import (
    BertConfig,
    BloomConfig,
    DeepseekV4Config,
    DeepseekV32Config,
    FalconConfig,
    Gemma2Config,
    GlmMoeDsaConfig,
    GptOssConfig,
    LlamaConfig,
    LongcatFlashConfig,
    MambaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3_5TextConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from tests.support.models import engine_config
from vllm.ascend.errors import AscendConfigError

# the sizes every config class below takes by these names
TINY = dict(hidden_size=64, num_hidden_layers=2, vocab_size=256)
HEADS = dict(TINY, num_attention_heads=4)
SMALL = dict(HEADS, intermediate_size=128, num_key_value_heads=2, max_position_embeddings=512)
WINDOW = 64
MLA = dict(
    SMALL,
    kv_lora_rank=512,  # with rope 64: the NPU MLA kernel's sizes
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    q_lora_rank=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)


GDN = dict(
    SMALL,
    head_dim=16,
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)

GDN128 = dict(GDN, linear_key_head_dim=128, linear_value_head_dim=128)


def _longcat(zero_expert_type: str):
    config = LongcatFlashConfig(
        architectures=["LongcatFlashForCausalLM"],
        **{k: v for k, v in MLA.items() if k not in ("num_hidden_layers", "num_experts_per_tok")},
        num_layers=2,
        moe_topk=2,
        zero_expert_num=2,
        expert_ffn_hidden_size=32,
        ffn_hidden_size=128,
    )
    config.zero_expert_type = zero_expert_type
    return config


FEATURES = (
    "sliding-window attention",
    "soft-capping",
    "ALiBi",
    "attention sinks",
    "sparse attention with a lightning indexer",
    "compressed attention",
    "hyper-connections",
    "hash-routed MoE",
    "zero-computation experts",
    "encoder-only",
    "encoder-decoder",
    "state-space",
    "Gated DeltaNet layers of",
    "Gated DeltaNet layers in",
    "prefix caching with Gated DeltaNet layers",
    "draft tokens with Gated DeltaNet layers",
    "expert-parallel load balancing",
    "MoE routing simulation",
    "MoE expert substitution",
)


@pytest.fixture(autouse=True)
def inspect_models_in_this_process(monkeypatch):
    # Upstream inspects each architecture in a fresh Python process (about 25 s here, once
    # per architecture and machine); the same inspection in this process takes a second.
    from vllm.model_executor.models import registry

    monkeypatch.setattr(registry, "_run_in_subprocess", lambda fn: fn())


# (name, config, engine args, the phrases the error names; None: accepted)
CASES = [
    ("llama", lambda: LlamaConfig(architectures=["LlamaForCausalLM"], **SMALL), {}, None),
    (
        "mistral",  # a model-level window: upstream gives it to every layer
        lambda: MistralConfig(architectures=["MistralForCausalLM"], sliding_window=WINDOW, **SMALL),
        {},
        None,
    ),
    (
        "llama-with-window",  # Phi-3 style: a window in a Llama config, again on every layer
        lambda: LlamaConfig(architectures=["LlamaForCausalLM"], sliding_window=WINDOW, **SMALL),
        {},
        None,
    ),
    (
        "qwen2-windowless-layers",  # use_sliding_window, but max_window_layers covers every layer
        lambda: Qwen2Config(
            architectures=["Qwen2ForCausalLM"],
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=2,
            **SMALL,
        ),
        {},
        None,
    ),
    (
        "gemma2",  # soft-capped attention logits, alternating windows
        lambda: Gemma2Config(
            architectures=["Gemma2ForCausalLM"], sliding_window=WINDOW, head_dim=16, **SMALL
        ),
        {},
        ["attention logit soft-capping with the NPU attention kernels (attn_logit_softcapping=50.0"],
    ),
    (
        "gpt-oss",
        lambda: GptOssConfig(
            architectures=["GptOssForCausalLM"],
            sliding_window=WINDOW,
            num_local_experts=4,
            head_dim=16,
            **SMALL,
        ),
        {},
        None,  # sinks, biased experts with the clamped SwiGLU: both kernel sets
    ),
    (
        "gpt-oss-256-wide-heads",  # the fused attention's learnable_sink takes heads up to 128
        lambda: GptOssConfig(
            architectures=["GptOssForCausalLM"],
            sliding_window=WINDOW,
            num_local_experts=4,
            head_dim=256,
            **SMALL,
        ),
        {},
        ["attention sinks with a head size of 256 with the NPU attention kernels"],
    ),
    (
        "bloom",
        lambda: BloomConfig(
            architectures=["BloomForCausalLM"], hidden_size=64, n_layer=2, n_head=4, vocab_size=256
        ),
        {},
        ["ALiBi position biases"],
    ),
    (
        "falcon-alibi",
        lambda: FalconConfig(architectures=["FalconForCausalLM"], alibi=True, **HEADS),
        {},
        ["ALiBi position biases"],
    ),
    (
        "falcon-rotary",
        lambda: FalconConfig(architectures=["FalconForCausalLM"], **HEADS),
        {},
        None,
    ),
    (
        "bert-embeddings",
        lambda: BertConfig(architectures=["BertModel"], intermediate_size=128, **HEADS),
        {"runner": "pooling"},
        ["encoder-only attention"],
    ),
    (
        "deepseek-v3.2",
        lambda: DeepseekV32Config(architectures=["DeepseekV32ForCausalLM"], **MLA, index_topk=16),
        {},
        None,  # V3.2's own sizes: an indexer of 64 heads of 128, within npu_lightning_indexer's
    ),
    (
        "deepseek-v3.2-context-parallel",  # MTP and KV connectors run it; CP does not yet
        lambda: DeepseekV32Config(architectures=["DeepseekV32ForCausalLM"], **MLA, index_topk=16),
        {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
        ["sparse attention with a lightning indexer (index_topk=16) with context parallelism"],
    ),
    (
        "deepseek-v3.2-indexer-outside-the-npu-op",
        lambda: DeepseekV32Config(
            architectures=["DeepseekV32ForCausalLM"],
            **MLA,
            index_topk=2500,
            index_head_dim=96,
            index_n_heads=72,
        ),
        {},
        [
            "sparse attention with a lightning indexer (index_topk=2500) with the NPU kernels and "
            "index_head_dim 96 (npu_lightning_indexer takes 128)",
            "with the NPU kernels and index_n_heads 72 (npu_lightning_indexer takes at most 64)",
            "with the NPU kernels and index_topk 2500 (npu_lightning_indexer keeps 1-2048",
        ],
    ),
    (
        "glm-5-next",  # the indexer and linear-attention layers, both named
        lambda: DeepseekV32Config(architectures=["Glm5NextForCausalLM"], **MLA, index_topk=16),
        {},
        [
            "sparse attention with a lightning indexer (index_topk=16) other than DeepSeek-V3.2's and GLM-5's",
            "state-space or linear-attention layers other than",
        ],
    ),
    (
        "glm-5",  # V3.2's layers under upstream's V3.2 model code
        lambda: GlmMoeDsaConfig(architectures=["GlmMoeDsaForCausalLM"], **MLA, index_topk=16),
        {},
        None,
    ),
    (
        "glm-5-shared-selections",  # layers reusing an earlier layer's top-k: not built yet
        lambda: GlmMoeDsaConfig(
            architectures=["GlmMoeDsaForCausalLM"], **MLA, index_topk=16, indexer_types=["full", "shared"]
        ),
        {},
        ["sparse attention with a lightning indexer (index_topk=16) whose layers 1 reuse an earlier"],
    ),
    (
        "deepseek-v4",  # V4 names its own layers, not V3.2's
        lambda: DeepseekV4Config(
            architectures=["DeepseekV4ForCausalLM"],
            **MLA,
            index_topk=16,
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
            mlp_layer_types=["hash_moe", "moe"],
        ),
        {},
        [
            "sparse attention with a lightning indexer (index_topk=16)",
            "compressed attention (compress ratios 4, 128)",
            "hyper-connections (hc_mult=4)",
            "hash-routed MoE layers (1)",
        ],
    ),
    ("longcat-identity-experts", lambda: _longcat("identity"), {}, None),
    (
        "longcat-other-zero-experts",
        lambda: _longcat("zero"),
        {},
        ["zero-computation experts of type 'zero' (the Ascend MoE runs identity ones)"],
    ),
    (
        "mamba",
        lambda: MambaConfig(architectures=["MambaForCausalLM"], **TINY),
        {},
        ["state-space or linear-attention layers other than Qwen3-Next's and Qwen3.5's Gated DeltaNet"],
    ),
    (
        "qwen3-next",  # prefix caching is on by default; its state copies are Triton kernels
        lambda: Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"], **GDN, num_experts=4),
        {},
        [
            "Gated DeltaNet layers of 2 key and 4 value heads per rank, head sizes 16 and 16, with the NPU kernels",
            "prefix caching with Gated DeltaNet layers",
        ],
    ),
    (
        "qwen3.5-without-prefix-caching",  # the reference kernels serve it
        lambda: Qwen3_5TextConfig(architectures=["Qwen3_5ForCausalLM"], **GDN),
        {"enable_prefix_caching": False},
        [
            "Gated DeltaNet layers of 2 key and 4 value heads per rank, head sizes 16 and 16, with the NPU kernels"
        ],
    ),
    (
        "qwen3.5-in-the-npu-ops-shapes",  # 128-wide heads: torch_npu's chunked op takes them
        lambda: Qwen3_5TextConfig(architectures=["Qwen3_5ForCausalLM"], **GDN128),
        {"enable_prefix_caching": False},
        None,
    ),
    (
        "qwen3.5-float32-state",
        lambda: Qwen3_5TextConfig(architectures=["Qwen3_5ForCausalLM"], **GDN128),
        {"enable_prefix_caching": False, "mamba_ssm_cache_dtype": "float32"},
        ["Gated DeltaNet layers in torch.bfloat16 with a float32 state cache with the NPU kernels"],
    ),
    (
        "qwen3.5-mtp",  # both kernel sets verify drafts through these layers
        lambda: Qwen3_5TextConfig(architectures=["Qwen3_5ForCausalLM"], mtp_num_hidden_layers=1, **GDN128),
        {
            "enable_prefix_caching": False,
            "speculative_config": {"method": "mtp", "num_speculative_tokens": 2},
        },
        None,
    ),
    (
        "qwen3.5-mtp-8-drafts",  # torch_npu's recurrent op takes at most 8 tokens per sequence
        lambda: Qwen3_5TextConfig(architectures=["Qwen3_5ForCausalLM"], mtp_num_hidden_layers=1, **GDN128),
        {
            "enable_prefix_caching": False,
            "speculative_config": {"method": "mtp", "num_speculative_tokens": 8},
        },
        ["8 draft tokens with Gated DeltaNet layers with the NPU kernels"],
    ),
]


# sliding windows are accepted with both kernel sets; soft-capping with the reference kernels only
@pytest.mark.parametrize("kernels", ["npu", "reference"])
@pytest.mark.parametrize("name, make, engine_args, named", CASES, ids=[c[0] for c in CASES])
def test_unsupported_model_features_are_named_when_the_config_is_built(
    tmp_path, monkeypatch, kernels, name, make, engine_args, named
):
    monkeypatch.setenv("VLLM_ASCEND_KERNELS", kernels)
    if kernels == "npu":
        engine_args = {"dtype": "bfloat16", **engine_args}  # the NPU kernels' dtypes
    elif named is not None:
        named = [
            phrase
            for phrase in named
            if "NPU attention kernels" not in phrase and "with the NPU kernels" not in phrase
        ] or None
    if named is None:
        engine_config(tmp_path, make(), **engine_args)
        return
    with pytest.raises(AscendConfigError) as refused:
        engine_config(tmp_path, make(), **engine_args)
    message = str(refused.value)
    assert message.startswith("not supported on Ascend yet: "), message
    for phrase in named:
        assert phrase in message, message
    for feature in FEATURES:  # and nothing else
        assert (feature in message) == any(feature in phrase for phrase in named), (feature, message)


def _qwen3_moe(**extra):
    return Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        **SMALL,
        **extra,
    )


def test_moe_options_that_change_routes_are_refused(tmp_path, monkeypatch):
    engine_config(tmp_path / "plain", _qwen3_moe())  # the model itself runs
    with pytest.raises(AscendConfigError, match=r"yet: MoE expert substitution \(approximate_experts\) \("):
        engine_config(tmp_path / "substituted", _qwen3_moe(approximate_experts={"1": [3]}))
    monkeypatch.setenv("VLLM_MOE_ROUTING_SIMULATION_STRATEGY", "uniform_random")
    with pytest.raises(
        AscendConfigError, match=r"MoE routing simulation \(unset VLLM_MOE_ROUTING_SIMULATION_STRATEGY\)"
    ):
        engine_config(tmp_path / "simulated", _qwen3_moe())


def test_eplb_starts_synchronous_with_its_redundant_experts(tmp_path):
    """--enable-eplb passes the platform's start-up checks; the platform turns upstream's
    asynchronous rearrangement (a CUDA/XPU worker thread) into the synchronous one."""
    from vllm.ascend.platform.model_features import unsupported_features

    built = engine_config(
        tmp_path,
        _qwen3_moe(),
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        enable_eplb=True,
        eplb_config={"num_redundant_experts": 2, "step_interval": 8, "window_size": 4},
        distributed_executor_backend="mp",
    )
    assert unsupported_features(built) == []
    eplb = built.parallel_config.eplb_config
    assert built.parallel_config.enable_eplb and not eplb.use_async
    assert eplb.num_redundant_experts == 2


def test_the_python_api_raises_before_any_process_starts(tmp_path, monkeypatch):
    from vllm import LLM

    monkeypatch.setenv("VLLM_ASCEND_KERNELS", "npu")
    Gemma2Config(architectures=["Gemma2ForCausalLM"], head_dim=16, **SMALL).save_pretrained(tmp_path)
    with pytest.raises(AscendConfigError, match="attention logit soft-capping"):
        LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16")
    assert multiprocessing.active_children() == []
