"""The oracle of the engine tests: Hugging Face transformers' greedy ``generate``."""

from __future__ import annotations

from pathlib import Path

_HF_CACHE: dict = {}


def hf_greedy(model: Path, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
    """Oracle: transformers' greedy generate, one prompt at a time, float32, no EOS stop."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    key = str(model)
    if key not in _HF_CACHE:
        tok = AutoTokenizer.from_pretrained(model)
        # vision-language configs (Qwen2-VL) have no causal-LM class; their image-text one
        # generates from text alone
        vl = getattr(AutoConfig.from_pretrained(model), "vision_config", None) is not None
        auto = AutoModelForImageTextToText if vl else AutoModelForCausalLM
        hf = auto.from_pretrained(model, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        _HF_CACHE[key] = (tok, hf)
    tok, hf = _HF_CACHE[key]
    outs = []
    with torch.no_grad():
        for prompt in prompts:
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
