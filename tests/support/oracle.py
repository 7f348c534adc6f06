"""The oracle of the engine tests: Hugging Face transformers' greedy ``generate`` (with
peft for LoRA adapters)."""

from __future__ import annotations

from pathlib import Path

_HF_CACHE: dict = {}


def _attention(config) -> dict:
    """transformers' SDPA attention drops Gemma 2's logit soft-cap and gpt-oss's sinks; its
    eager attention applies both."""
    needs_eager = getattr(config, "attn_logit_softcapping", None) or config.model_type == "gpt_oss"
    return {"attn_implementation": "eager"} if needs_eager else {}


def transformers_classes(model: Path, vision_language: bool | None = None) -> tuple:
    """transformers' own config and model class for ``model``'s ``model_type``, from its
    static name tables. Not its Auto classes: any process that builds a vLLM config
    registers vLLM's config classes with ``AutoConfig`` (``deepseek_v32`` as a DeepSeek-V3
    config), after which ``AutoModelForCausalLM`` builds a DeepSeek-V3 without the indexer,
    so the oracle would depend on which test ran first in the process (seen in CI)."""
    import json

    import transformers
    from transformers.models.auto import configuration_auto, modeling_auto

    model_type = json.loads((Path(model) / "config.json").read_text())["model_type"]
    config = getattr(transformers, configuration_auto.CONFIG_MAPPING_NAMES[model_type]).from_pretrained(model)
    if vision_language is None:
        vision_language = getattr(config, "vision_config", None) is not None
    # vision-language configs (Qwen2-VL) have no causal-LM class; their image-text one
    # generates from text alone
    names = (
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        if vision_language
        else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
    return config, getattr(transformers, names[model_type])


def hf_greedy(model: Path, prompts: list, max_tokens: int = 16) -> list[list[int]]:
    """Oracle: transformers' greedy generate, one prompt at a time, float32, no EOS stop.
    A prompt is text, or token ids as vLLM takes them (``{"prompt_token_ids": [...]}``)."""
    tok, hf = hf_model(model)
    return _generate(tok, hf, prompts, max_tokens)


def hf_teacher_forced_logprobs(model: Path, prompt: str, generated: list[int]):
    """Oracle: transformers' next-token log-probabilities after each prefix
    ``prompt + generated[:j]``, one forward pass (float32): a tensor [len(generated), vocab]."""
    import torch

    tok, hf = hf_model(model)
    ids = tok(prompt, return_tensors="pt").input_ids
    full = torch.cat([ids, torch.tensor([generated])], dim=1)
    with torch.no_grad():
        logits = hf(full, attention_mask=torch.ones_like(full)).logits[0]
    return torch.log_softmax(logits[ids.shape[1] - 1 : full.shape[1] - 1].float(), dim=-1)


def hf_model(model: Path) -> tuple:
    """The tokenizer and the float32 transformers model of ``model`` (no EOS stop), loaded
    once per test process."""
    import torch
    from transformers import AutoTokenizer

    key = str(model)
    if key not in _HF_CACHE:
        tok = AutoTokenizer.from_pretrained(model)
        config, model_class = transformers_classes(model)
        if config.model_type == "longcat_flash":
            hf = _longcat(model)
        else:
            hf = model_class.from_pretrained(
                model, config=config, dtype=torch.float32, **_attention(config)
            ).eval()
        hf.generation_config.eos_token_id = None
        _HF_CACHE[key] = (tok, hf)
    return _HF_CACHE[key]


def _longcat(model: Path):
    """LongCat checkpoints (the tiny one as the real ones) hold no weights for the
    zero-computation experts, but transformers' class gives them gate/up rows, never used
    (they are identities), so it refuses the checkpoint's smaller stack: load with that
    stack left out, then put the real experts' gate and up projections in its first rows."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, ignore_mismatched_sizes=True)
    weights = load_file(Path(model) / "model.safetensors")
    real = hf.config.n_routed_experts
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            name = f"model.layers.{i}.mlp.experts.{{}}.{{}}_proj.weight"
            rows = [
                torch.cat([weights[name.format(e, "gate")], weights[name.format(e, "up")]])
                for e in range(real)
            ]
            layer.mlp.experts.gate_up_proj[:real] = torch.stack(rows)
    return hf.eval()


def _generate(tok, hf, prompts: list[str], max_tokens: int) -> list[list[int]]:
    import torch

    outs = []
    with torch.no_grad():
        for prompt in prompts:
            if isinstance(prompt, dict):
                ids = torch.tensor([prompt["prompt_token_ids"]])
            else:
                ids = tok(prompt, return_tensors="pt").input_ids
            gen = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
            outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


def hf_lora_greedy(
    model: Path, adapter: Path | None, prompts: list[str], max_tokens: int = 16
) -> list[list[int]]:
    """Oracle for LoRA: transformers' greedy generate of the base model with the adapter
    loaded by peft (``None``: the base model alone), float32, no EOS stop."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if adapter is None:
        return hf_greedy(model, prompts, max_tokens)
    tok = AutoTokenizer.from_pretrained(model)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    base.generation_config.eos_token_id = None
    hf = PeftModel.from_pretrained(base, adapter).eval()
    return _generate(tok, hf, prompts, max_tokens)


def make_lora_adapter(model: Path, out: Path, rank: int, seed: int, targets: list[str]) -> Path:
    """A LoRA adapter for ``model`` made by peft with random (non-zero) weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(out)
    return out


def router_margins(model: Path, prompt: str, continuation: list[int]) -> tuple[int, list[list[float]]]:
    """How close the MoE router came to another expert choice, by transformers: for each
    position whose logits pick a generated token (the prompt's last one, then each of
    ``continuation``) and each layer, the float32 gap between the k-th and (k+1)-th router
    logit (k = experts per token) in units of that layer's bf16 rounding noise. The noise
    is measured on the same sequence: the 90th percentile, over its tokens, of how far a
    bf16 forward moves that gap from the float32 one. Below 1, another correct bf16 kernel
    order can plausibly route the token to other experts. Returns the prompt's token count
    (to check against the engine's) and the gaps, ``[step][layer]``. For models whose
    transformers class reports its router logits (Qwen-MoE, Mixtral)."""
    import torch
    from transformers import AutoTokenizer

    key = ("router", str(model))
    if key not in _HF_CACHE:
        config, model_class = transformers_classes(model, vision_language=False)
        k = config.num_experts_per_tok
        forwards = [
            model_class.from_pretrained(model, config=config, dtype=t, **_attention(config)).eval()
            for t in (torch.float32, torch.bfloat16)
        ]
        _HF_CACHE[key] = (AutoTokenizer.from_pretrained(model), forwards, k)
    tok, (hf32, hf16), k = _HF_CACHE[key]
    prompt_ids = tok(prompt).input_ids
    ids = torch.tensor([prompt_ids + list(continuation)])
    with torch.no_grad():
        exact, rounded = (hf(ids, output_router_logits=True).router_logits for hf in (hf32, hf16))
    assert exact, f"{model}: transformers reports no router logits"
    gaps = []
    for logits32, logits16 in zip(exact, rounded):  # [tokens, experts] per layer
        logits32 = logits32.reshape(ids.shape[1], -1)
        top, experts = logits32.topk(k + 1, dim=-1)
        pair16 = logits16.reshape(ids.shape[1], -1).float().gather(1, experts[:, k - 1 :])
        gap32 = top[:, k - 1] - top[:, k]
        noise = torch.quantile((gap32 - (pair16[:, 0] - pair16[:, 1])).abs(), 0.9)
        noise = noise.clamp_min(
            torch.finfo(torch.float32).tiny
        )  # bf16 equal to float32: only exact ties are near
        gaps.append(gap32[len(prompt_ids) - 1 :] / noise)
    return len(prompt_ids), torch.stack(gaps, dim=1).tolist()
