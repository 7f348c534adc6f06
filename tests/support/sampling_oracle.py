"""An independent oracle for vLLM's sampling options under greedy decoding: transformers'
float32 logits, the option applied in plain torch, argmax, one token at a time (the
whole sequence recomputed each step: slow and obvious).

The options and their order follow vLLM's documented semantics: the allowed-token mask,
bad words (a word's last token is banned when the output ends with the rest of it;
single-token words always), min tokens (stop tokens banned until that many were
generated), logit bias, then the penalties (repetition over prompt and output tokens:
positive logits divided, others multiplied; frequency and presence over output tokens
only). Generation ends at ``max_tokens`` or at a stop token (kept in the output, as
vLLM returns it). Logprobs are the model's raw ones (vLLM's default logprobs mode)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.oracle import hf_model


def bad_word_sequences(model: Path, words: list[str]) -> list[list[int]]:
    """The token sequences vLLM bans for ``words``: each word as tokenized alone, and with
    a leading space when that gives other tokens of the same count (the word in the
    middle of a text)."""
    tok, _ = hf_model(model)
    out = []
    for word in words:
        alone = tok.encode(word.lstrip(), add_special_tokens=False)
        out.append(alone)
        spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return out


def _apply(
    logits: torch.Tensor, options: dict, prompt: list[int], out: list[int], extra: dict
) -> torch.Tensor:
    logits = logits.clone()
    if "allowed_token_ids" in options:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[options["allowed_token_ids"]] = True
        logits[~keep] = -torch.inf
    for seq in extra.get("bad_words", []):
        prefix = seq[:-1]
        if not prefix or (len(prefix) <= len(out) and out[len(out) - len(prefix) :] == prefix):
            logits[seq[-1]] = -torch.inf
    if len(out) < options.get("min_tokens", 0):
        logits[extra["stop_ids"]] = -torch.inf
    for token, bias in options.get("logit_bias", {}).items():
        logits[int(token)] += bias
    rep = options.get("repetition_penalty", 1.0)
    if rep != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(out)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / rep, vals * rep)
    if out:
        counts = torch.bincount(torch.tensor(out), minlength=logits.numel()).to(logits.dtype)
        logits -= options.get("frequency_penalty", 0.0) * counts
        logits -= options.get("presence_penalty", 0.0) * (counts > 0).to(logits.dtype)
    return logits


def greedy(model: Path, prompts: list[str], max_tokens: int, options: dict) -> list[dict]:
    """Per prompt: the greedy "token_ids", the "prompt_ids", and the raw log-softmax rows
    of every generated position ("rows") and of every prompt position after the first
    ("prompt_rows")."""
    tok, hf = hf_model(model)
    extra = {}
    if options.get("bad_words"):
        extra["bad_words"] = bad_word_sequences(model, options["bad_words"])
    stop_ids = list(options.get("stop_token_ids", []))
    if not options.get("ignore_eos", True) and tok.eos_token_id is not None:
        stop_ids.append(tok.eos_token_id)
    extra["stop_ids"] = stop_ids
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tok(prompt).input_ids
            out: list[int] = []
            rows = []
            prompt_rows = None
            for _ in range(max_tokens):
                full = torch.tensor([ids + out])
                logits = hf(full, attention_mask=torch.ones_like(full)).logits[0].float()
                if prompt_rows is None:
                    prompt_rows = torch.log_softmax(logits[: len(ids) - 1], dim=-1)
                last = logits[-1]
                rows.append(torch.log_softmax(last, dim=-1))
                token = int(_apply(last, options, ids, out, extra).argmax())
                out.append(token)
                if token in stop_ids and len(out) >= options.get("min_tokens", 0):
                    break
            result = {"token_ids": out, "prompt_ids": ids, "rows": rows, "prompt_rows": prompt_rows}
            results.append(result)
    return results
