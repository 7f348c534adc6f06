"""Generate a tiny random-weight model that vLLM and Hugging Face transformers both load.

    python examples/make_tiny_model.py --arch llama --out /tmp/tiny-llama
    python examples/make_tiny_model.py --arch qwen2 --out /tmp/tiny-qwen2
    python examples/make_tiny_model.py --arch deepseek_v3 --out /tmp/tiny-dsv3
    python examples/make_tiny_model.py --arch qwen3_moe --out /tmp/tiny-qwen3-moe
    python examples/make_tiny_model.py --arch qwen2_vl --out /tmp/tiny-qwen2-vl
    python examples/make_tiny_model.py --arch qwen3 --out /tmp/tiny-qwen3
    python examples/make_tiny_model.py --arch mistral --sliding-window 24 --out /tmp/tiny-mistral
    python examples/make_tiny_model.py --arch gemma3 --out /tmp/tiny-gemma3
    python examples/make_tiny_model.py --arch gpt_oss --out /tmp/tiny-gpt-oss

Nothing is downloaded: the weights are random (seeded), saved as safetensors, and the
tokenizer is a byte-level BPE trained here with the `tokenizers` library on a small
built-in text. The default initializer range (0.25, not the usual 0.02) makes greedy
decoding produce varied, context-dependent tokens, so a broken attention or MoE path
cannot hide behind a model that repeats one token.

`deepseek_v3` has MLA attention (kv_lora_rank + qk_rope_head_dim = 320 by default, one
of the latent sizes vLLM's MLA accepts; `--kv-lora-rank 512` gives the 512 + 64 form the
torch_npu MLA kernel takes), MoE layers with grouped sigmoid routing
(`topk_method: noaux_tc`, written into config.json as real V3 checkpoints have it)
and one MTP layer (`num_nextn_predict_layers: 1`) whose weights are stored as layer
`num_hidden_layers`, where vLLM's DeepSeek MTP model reads them; transformers
ignores them. `deepseek_v32` adds DeepSeek sparse attention (a lightning indexer with its
own key cache picks `--index-topk` keys per query) and has such an MTP layer too, its
indexer included. `qwen3_moe` is a Qwen3-MoE: GQA attention with q/k norms and MoE layers
with softmax top-k routing (renormalised, `norm_topk_prob`), the routing of Mixtral and
the Qwen MoE models. `qwen2_vl` is a Qwen2-VL: a Qwen2 decoder with M-RoPE (rotary
positions in temporal/height/width sections, `mrope_section` summing to head_dim / 2) and
a one-block vision tower; on text-only prompts its three position rows are equal, so it
generates like a plain rotary model while running vLLM's M-RoPE path. It also gets the
vision special tokens its config names and an image/video preprocessor config, which
vLLM's start-up needs (it profiles with dummy images) unless `limit_mm_per_prompt` is 0.
`qwen3` is a dense Qwen3 (GQA with q/k norms). `mistral` is a Mistral: GQA whose every
layer attends over a sliding window of `--sliding-window` tokens (default 24: shorter than
the test prompts and several 8- or 16-token blocks long). `gemma3` is a Gemma 3 text model:
sliding-window and full-attention layers alternating (so two KV-cache groups), q/k norms,
GELU-gated MLPs and its own query scaling. `gemma2` is a Gemma 2: the same alternation
without q/k norms, its attention scores soft-capped at `--soft-cap` (default 1.0, where
tanh bends this model's scores: Gemma 2's own 50 would leave a tiny random model's scores
untouched and the cap untested).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

import vllm  # noqa: F401  (first: on hosts without CANN, hides an unusable torch_npu from transformers)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Large language models predict the next token from the tokens before it. Attention lets every position
look at the positions that came earlier. Paged attention stores keys and values in fixed-size blocks.
Prefill processes the prompt; decode produces one token at a time. Mixture of experts routes each token
to a few experts. Speculative decoding drafts tokens and verifies them in one step. Disaggregated
serving runs prefill and decode on different instances and moves the KV cache between them.
Once upon a time there was a small model that learned to count: one two three four five six seven.
Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 and punctuation , . ; : ! ? ( ) [ ] { }
"""
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
# qwen2_vl only (appended after SPECIAL, so the other archs' vocabularies are unchanged)
VL_SPECIAL = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Qwen2-VL's image/video preprocessor; pixel bounds kept small (4..64 merged tokens per
# image) so an engine that profiles with images stays cheap.
VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 56 * 56,
    "max_pixels": 64 * 28 * 28,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def build_tokenizer(vocab_size: int, extra_special: tuple[str, ...] = ()) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL + list(extra_special),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "model_max_length": max_len,
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}, indent=2
        )
    )


def base_config(args, tok: Tokenizer) -> dict:
    return dict(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        max_position_embeddings=args.max_len,
        initializer_range=args.init_range,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("<pad>"),
        torch_dtype="float32",
    )


def make_model(args, tok: Tokenizer):
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        DeepseekV32Config,
        DeepseekV32ForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GlmMoeDsaConfig,
        GlmMoeDsaForCausalLM,
        GptOssConfig,
        GptOssForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        LongcatFlashConfig,
        LongcatFlashForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    cfg = base_config(args, tok)
    if args.arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**cfg, num_key_value_heads=args.kv_heads or args.heads))
    if args.arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**cfg, num_key_value_heads=args.kv_heads or args.heads // 2))
    if args.arch == "qwen3":
        config = Qwen3Config(
            **cfg,
            num_key_value_heads=args.kv_heads or args.heads // 2,
            head_dim=args.hidden_size // args.heads,
        )
        return Qwen3ForCausalLM(config)
    if args.arch == "mistral":
        config = MistralConfig(
            **cfg, num_key_value_heads=args.kv_heads or args.heads // 2, sliding_window=args.sliding_window
        )
        return MistralForCausalLM(config)
    if args.arch in ("gemma2", "gemma3"):  # sliding, full, sliding, ...
        head_dim = args.hidden_size // args.heads
        alternating = dict(
            num_key_value_heads=args.kv_heads or args.heads // 2,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=args.sliding_window,
            layer_types=["full_attention" if i % 2 else "sliding_attention" for i in range(args.layers)],
        )
        if args.arch == "gemma3":
            return Gemma3ForCausalLM(Gemma3TextConfig(**cfg, **alternating))
        # attention logits soft-capped; vLLM's Gemma 2 has no lm_head of its own (tied)
        cfg["tie_word_embeddings"] = True
        return Gemma2ForCausalLM(Gemma2Config(**cfg, **alternating, attn_logit_softcapping=args.soft_cap))
    if args.arch == "gpt_oss":  # sinks, windows on even layers, biased experts with a clamped SwiGLU
        head_dim = args.hidden_size // args.heads
        config = GptOssConfig(
            **cfg,
            num_key_value_heads=args.kv_heads or args.heads // 2,
            head_dim=head_dim,
            num_local_experts=args.experts,
            num_experts_per_tok=2,
            sliding_window=args.sliding_window,
            layer_types=["full_attention" if i % 2 else "sliding_attention" for i in range(args.layers)],
            # YaRN as gpt-oss has it, stretched 4x from a quarter of --max-len
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": args.max_len // 4,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        )
        return GptOssForCausalLM(config)
    if args.arch == "qwen3_moe":  # softmax top-k routing, renormalised; every layer MoE, no shared expert
        config = Qwen3MoeConfig(
            **cfg,
            num_key_value_heads=args.kv_heads or args.heads // 2,
            num_experts=args.experts,
            num_experts_per_tok=2,
            moe_intermediate_size=args.intermediate_size // 2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
        return Qwen3MoeForCausalLM(config)
    if args.arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        # Gated DeltaNet hybrids: linear-attention layers (causal conv, gated delta rule over a
        # recurrent state) with a full-attention layer every fourth, as the real ones
        head_dim = args.hidden_size // args.heads
        linear_dim = args.linear_head_dim or head_dim
        hybrid = dict(
            num_key_value_heads=args.kv_heads or args.heads // 2,
            head_dim=head_dim,
            layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(args.layers)],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=linear_dim,
            linear_value_head_dim=linear_dim,
            linear_conv_kernel_dim=4,
        )
        moe = dict(
            num_experts=args.experts,
            num_experts_per_tok=2,
            moe_intermediate_size=args.intermediate_size // 2,
            shared_expert_intermediate_size=args.intermediate_size // 2,
        )
        if args.arch == "qwen3_next":
            return Qwen3NextForCausalLM(Qwen3NextConfig(**cfg, **hybrid, **moe, decoder_sparse_step=1))
        if args.arch == "qwen3_5_moe":
            cfg.pop("intermediate_size")
            return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**cfg, **hybrid, **moe))
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg, **hybrid))
    if args.arch == "qwen2_vl":
        half = args.hidden_size // args.heads // 2  # rotary pairs per head, split over t/h/w
        h = w = (half - half // 4) // 2  # Qwen2-VL's own split is 16/24/24 of 64
        tie = cfg.pop("tie_word_embeddings")
        text = dict(
            **cfg,
            num_key_value_heads=args.kv_heads or args.heads // 2,
            rope_parameters={"rope_type": "default", "mrope_section": [half - h - w, h, w]},
        )
        vision = dict(
            depth=1,
            embed_dim=32,
            num_heads=2,
            mlp_ratio=2,
            hidden_size=args.hidden_size,  # merger output = the decoder's width
            patch_size=VL_PREPROCESSOR["patch_size"],
            temporal_patch_size=VL_PREPROCESSOR["temporal_patch_size"],
            spatial_merge_size=VL_PREPROCESSOR["merge_size"],
            initializer_range=args.init_range,  # as the decoder's, so image features are not ~0
        )
        ids = {n: tok.token_to_id(t) for n, t in zip(("start", "end", "image", "video"), VL_SPECIAL)}
        config = Qwen2VLConfig(
            text_config=text,
            vision_config=vision,
            vision_start_token_id=ids["start"],
            vision_end_token_id=ids["end"],
            image_token_id=ids["image"],
            video_token_id=ids["video"],
            tie_word_embeddings=tie,
        )
        return Qwen2VLForConditionalGeneration(config)
    if args.arch == "longcat_flash":
        # MLA (its LoRA norms scaled, as LongCat has them) and a MoE whose zero-computation
        # experts pass the token through, weighted: the router scores real and zero experts
        # together (softmax, correction bias, scaled, not renormalised)
        cfg["num_layers"] = cfg.pop("num_hidden_layers")
        config = LongcatFlashConfig(
            **cfg,
            num_key_value_heads=args.heads,
            q_lora_rank=args.q_lora_rank or 32,
            kv_lora_rank=args.kv_lora_rank,
            qk_rope_head_dim=args.qk_rope_head_dim,
            qk_nope_head_dim=32,
            v_head_dim=32,
            head_dim=args.qk_rope_head_dim,
            ffn_hidden_size=args.intermediate_size,
            n_routed_experts=args.experts,
            zero_expert_num=args.zero_experts,
            moe_topk=2,
            expert_ffn_hidden_size=args.intermediate_size // 2,
            routed_scaling_factor=2.0,
        )
        return LongcatFlashForCausalLM(config)
    mla_moe = dict(
        num_key_value_heads=args.heads,
        kv_lora_rank=args.kv_lora_rank,
        qk_rope_head_dim=args.qk_rope_head_dim,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=args.experts,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=args.intermediate_size // 2,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    if args.arch == "deepseek_v32":
        # DeepSeek sparse attention: each query attends to the index_topk keys its lightning
        # indexer (8 heads, its own key cache, NeoX rope on the first rope dims) scores highest
        config = DeepseekV32Config(
            **cfg,
            **mla_moe,
            q_lora_rank=args.q_lora_rank or 32,
            index_topk=args.index_topk,
            index_n_heads=8,
            index_head_dim=args.index_head_dim or args.qk_rope_head_dim + 32,
        )
        return DeepseekV32ForCausalLM(config)
    if args.arch == "glm_moe_dsa":
        # GLM-5: DeepSeek-V3.2's layers, its indexer's rope interleaved (as its MLA rope);
        # every layer computes its own selection (indexer_types all "full")
        config = GlmMoeDsaConfig(
            **cfg,
            **mla_moe,
            q_lora_rank=args.q_lora_rank or 32,
            head_dim=args.qk_rope_head_dim,
            index_topk=args.index_topk,
            index_n_heads=8,
            index_head_dim=args.index_head_dim or args.qk_rope_head_dim + 32,
        )
        return GlmMoeDsaForCausalLM(config)
    config = DeepseekV3Config(**cfg, **mla_moe, q_lora_rank=args.q_lora_rank, num_nextn_predict_layers=1)
    return DeepseekV3ForCausalLM(config)


def randomize_routing_bias(model, generator: torch.Generator) -> None:
    """Non-zero e_score_correction_bias, so routing that ignores it would be caught."""
    for name, buf in list(model.named_buffers()) + list(model.named_parameters()):
        if name.endswith("e_score_correction_bias"):
            with torch.no_grad():
                buf.copy_(torch.randn(buf.shape, generator=generator) * 0.5)


def randomize_gpt_oss_extras(model, generator: torch.Generator) -> None:
    """transformers starts expert biases at zero and sinks near zero; a test with those
    could not tell a missing bias or sink from a present one. (Larger gate/up biases,
    which would reach the SwiGLU's clamp limit often, make bf16 runs near-tie on many
    tokens; the clamp is checked against transformers in tests/unit/kernels.)"""
    for name, param in model.named_parameters():
        std = {"gate_up_proj_bias": 1.0, "down_proj_bias": 0.25, "sinks": 1.0}.get(name.rsplit(".", 1)[-1])
        if std is not None:
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def shrink_tied_embeddings(model, factor: float = 0.03) -> None:
    """Gemma 2 scales its embeddings by sqrt(hidden_size) and ties its output head to them:
    at the layers' init scale every step's logits favour the step's own input token, so
    the tiny model repeats one token. Smaller embeddings let the layers pick the tokens."""
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(factor)


def mtp_layer_weights(
    saved: dict[str, torch.Tensor], config, generator: torch.Generator, init_range: float
) -> dict[str, torch.Tensor]:
    """One MTP module stored as layer ``num_hidden_layers`` (DeepSeek-V3 layout): a decoder
    layer shaped like the last saved MoE layer, plus enorm/hnorm/eh_proj/shared_head."""
    n = config.num_hidden_layers
    template = f"model.layers.{n - 1}."
    out = {}
    for name, tensor in saved.items():
        if not name.startswith(template):
            continue
        new_name = f"model.layers.{n}." + name[len(template) :]
        if name.endswith("norm.weight"):
            out[new_name] = torch.ones_like(tensor)
        else:
            out[new_name] = torch.randn(tensor.shape, generator=generator) * init_range
    h = config.hidden_size
    out[f"model.layers.{n}.enorm.weight"] = torch.ones(h)
    out[f"model.layers.{n}.hnorm.weight"] = torch.ones(h)
    out[f"model.layers.{n}.eh_proj.weight"] = torch.randn(h, 2 * h, generator=generator) * init_range
    out[f"model.layers.{n}.shared_head.norm.weight"] = torch.ones(h)
    out[f"model.layers.{n}.shared_head.head.weight"] = (
        torch.randn(config.vocab_size, h, generator=generator) * init_range
    )
    return out


def qwen_mtp_weights(
    saved: dict[str, torch.Tensor], config, generator: torch.Generator, init_range: float
) -> dict[str, torch.Tensor]:
    """Qwen3.5's MTP module as its checkpoints store it (``mtp.*``): a full-attention
    decoder layer shaped like the last saved one, the two pre-fc norms, ``fc`` over the
    embedding and the hidden state side by side, and a final norm. Its norms scale by
    1 + weight, so zeros are the identity, as transformers starts them."""
    full = max(i for i, kind in enumerate(config.layer_types) if kind == "full_attention")
    template = f"model.layers.{full}."
    out = {}
    for name, tensor in saved.items():
        if not name.startswith(template):
            continue
        new_name = "mtp.layers.0." + name[len(template) :]
        if "norm" in name:
            out[new_name] = tensor.clone()
        else:
            out[new_name] = torch.randn(tensor.shape, generator=generator) * init_range
    h = config.hidden_size
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = torch.zeros(h)
    out["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=generator) * init_range
    return out


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--arch",
        required=True,
        choices=[
            "llama",
            "qwen2",
            "deepseek_v3",
            "deepseek_v32",
            "glm_moe_dsa",
            "qwen3_moe",
            "qwen2_vl",
            "qwen3",
            "mistral",
            "gemma2",
            "gemma3",
            "gpt_oss",
            "longcat_flash",
            "qwen3_next",
            "qwen3_5",
            "qwen3_5_moe",
        ],
    )
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vocab-size",
        type=int,
        default=512,
        help="tokens in the vocabulary (at least 10000 for `vllm bench latency`, which draws ids below 10000)",
    )
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--intermediate-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument(
        "--kv-heads",
        type=int,
        default=0,
        help="default: heads (llama; deepseek_v3: MLA, none), heads/2 (the others)",
    )
    p.add_argument(
        "--sliding-window",
        type=int,
        default=24,
        help="attention window in tokens (mistral, gemma2, gemma3, gpt_oss)",
    )
    p.add_argument(
        "--soft-cap",
        type=float,
        default=1.0,
        help="attention logit soft-cap (gemma2's attn_logit_softcapping)",
    )
    p.add_argument(
        "--experts",
        type=int,
        default=8,
        help="routed experts (deepseek_v3, qwen3_moe, gpt_oss, longcat_flash)",
    )
    p.add_argument(
        "--zero-experts",
        type=int,
        default=4,
        help="zero-computation (identity) experts routed beside the real ones (longcat_flash)",
    )
    p.add_argument(
        "--kv-lora-rank",
        type=int,
        default=256,
        help="MLA latent size (deepseek_v3); with --qk-rope-head-dim it must sum to 320, 512 "
        "or 576 (vLLM's MLA). 512 + rope 64 is the form torch_npu's MLA attention takes",
    )
    p.add_argument(
        "--q-lora-rank",
        type=int,
        default=None,
        help="MLA query compression (deepseek_v3; default none: q_proj instead of q_a_proj/q_b_proj)",
    )
    p.add_argument("--qk-rope-head-dim", type=int, default=64, help="MLA rotary key size (deepseek_v3)")
    p.add_argument(
        "--linear-head-dim",
        type=int,
        default=0,
        help="Gated DeltaNet key and value head size (qwen3_next, qwen3_5, qwen3_5_moe; default: "
        "hidden size / heads; torch_npu's chunked op takes 128)",
    )
    p.add_argument(
        "--index-topk",
        type=int,
        default=16,
        help="keys each query attends to (deepseek_v32's lightning indexer)",
    )
    p.add_argument(
        "--index-head-dim",
        type=int,
        default=0,
        help="the lightning indexer's head size (deepseek_v32; default: rope size + 32; torch_npu's "
        "npu_lightning_indexer takes 128)",
    )
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--init-range", type=float, default=0.25)
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="dtype the weights are stored in (config.json's torch_dtype)",
    )
    args = p.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(args.vocab_size, VL_SPECIAL if args.arch == "qwen2_vl" else ())
    if tok.get_vocab_size() > args.vocab_size:
        p.error(f"tokenizer has {tok.get_vocab_size()} tokens, more than --vocab-size {args.vocab_size}")
    torch.manual_seed(args.seed)
    model = make_model(args, tok).to(DTYPES[args.dtype]).eval()
    generator = torch.Generator().manual_seed(args.seed + 1)
    if args.arch in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "longcat_flash"):
        randomize_routing_bias(model, generator)
    if args.arch == "gemma2":
        shrink_tied_embeddings(model)
    if args.arch == "gpt_oss":
        randomize_gpt_oss_extras(model, generator)
    model.save_pretrained(args.out, safe_serialization=True)
    save_tokenizer(tok, args.out, args.max_len)

    config_path = args.out / "config.json"
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = config["dtype"] = args.dtype
    if args.arch in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
        # transformers scores with sigmoid but does not save these keys; vLLM needs them.
        config.update(topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=1)
        if args.arch == "glm_moe_dsa":  # GLM-5's config.json says so; transformers always does it
            config["indexer_rope_interleave"] = True
        weights_path = args.out / "model.safetensors"
        weights = load_file(weights_path)
        mtp = mtp_layer_weights(weights, model.config, generator, args.init_range)
        weights.update({name: tensor.to(DTYPES[args.dtype]) for name, tensor in mtp.items()})
        save_file(weights, weights_path, metadata={"format": "pt"})
    if args.arch == "qwen3_5":
        config["mtp_num_hidden_layers"] = 1
        weights_path = args.out / "model.safetensors"
        weights = load_file(weights_path)
        mtp = qwen_mtp_weights(weights, model.config, generator, args.init_range)
        weights.update({name: tensor.to(DTYPES[args.dtype]) for name, tensor in mtp.items()})
        save_file(weights, weights_path, metadata={"format": "pt"})
    if args.arch == "longcat_flash":
        # keys LongCat's own config.json carries and transformers' class does not keep; vLLM
        # reads them (transformers applies both scales and identity zero experts always)
        config.update(zero_expert_type="identity", mla_scale_q_lora=True, mla_scale_kv_lora=True)
        # transformers' fused gate/up parameter has rows for the zero experts too; they are
        # never used and LongCat's checkpoints have none
        weights_path = args.out / "model.safetensors"
        weights = load_file(weights_path)
        zero = re.compile(r"\.mlp\.experts\.(\d+)\.")
        kept = {
            name: t
            for name, t in weights.items()
            if not ((m := zero.search(name)) and int(m.group(1)) >= args.experts)
        }
        save_file(kept, weights_path, metadata={"format": "pt"})
    if args.arch == "qwen2_vl":
        config["text_config"]["dtype"] = args.dtype  # the decoder's own copy
        (args.out / "preprocessor_config.json").write_text(json.dumps(VL_PREPROCESSOR, indent=2))
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    print(f"{args.arch}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters -> {args.out}")
    return args.out


if __name__ == "__main__":
    main()
