"""Model Runner V2 (opt-in) against the V1 runner, the same model and prompts in one
runner process: the sampling options whose V2 kernels run as the Ascend torch forms
(penalties, logit bias, allowed tokens, min tokens with stop ids, bad words, min-p,
logprobs and prompt logprobs, the thinking-token budget) give the same greedy tokens and
logprobs as V1's torch sampler, an implementation that shares no code with them."""

from __future__ import annotations

import math

import pytest

from tests.support.engines import IN_PROCESS, clean_shutdown, run_spec
from tests.support.prompts import PROMPTS

# Reasoning markers for the thinking budget: pieces of the tiny Llama's vocabulary that some
# prompts contain (its vocabulary is random byte pairs; no model here reasons).
REASONING = {"reasoning_start_str": " and", "reasoning_end_str": " done"}
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "seed": 0,
    "enable_prefix_caching": False,
    "reasoning_config": REASONING,
}
BATCHES = {  # name -> the sampling options of one batch (greedy, 16 tokens)
    "plain": {},
    "penalties": {"repetition_penalty": 1.4, "frequency_penalty": 0.6, "presence_penalty": 0.4},
    "logit_bias": {"logit_bias": {5: 8.0, 17: -3.0, 40: 2.5}},
    "allowed": {"allowed_token_ids": list(range(3, 60))},
    "min_tokens": {"min_tokens": 10, "stop_token_ids": [7, 11, 23], "ignore_eos": False},
    # pieces of the tiny Llama's own greedy output (its vocabulary is random byte pairs)
    "bad_words": {"bad_words": ["pon", "pro", "mil", "arned", "of"]},
    "min_p": {"min_p": 0.2},
    "logprobs": {"logprobs": 3, "prompt_logprobs": 2},
    # a prompt ending its reasoning marker's span beyond the budget gets the end forced
    "thinking_budget": {"thinking_token_budget": 2},
}


@pytest.fixture(scope="module")
def outputs(tiny_models):
    runs = [
        {
            "model": str(tiny_models["llama"]),
            "engine": ENGINE,
            "batches": [PROMPTS] * len(BATCHES),
            "batch_sampling": list(BATCHES.values()),
            "max_tokens": 16,
            "env": {**IN_PROCESS, "VLLM_USE_V2_MODEL_RUNNER": v2},
            "report_runner": True,
        }
        for v2 in ("0", "1")
    ]
    result, output = run_spec({"runs": runs}, timeout=900)
    clean_shutdown(output)
    v1, v2 = result["runs"]
    assert (v1["runner"], v2["runner"]) == ("NPUModelRunner", "NPUModelRunnerV2")
    return {name: (a, b) for name, a, b in zip(BATCHES, v1["batches"], v2["batches"])}


def _close(a, b, what):
    """Logprob lists of one position: the same token ids, values within 1e-4."""
    if a is None or b is None:
        assert a is b, what
        return
    assert [t for t, _ in a] == [t for t, _ in b], what
    for (_, x), (_, y) in zip(a, b):
        assert (math.isinf(x) and x == y) or abs(x - y) < 1e-4, (what, x, y)


@pytest.mark.parametrize("name", list(BATCHES))
def test_v2_samples_as_v1(outputs, name, tiny_models):
    v1, v2 = outputs[name]
    assert [r["token_ids"] for r in v2] == [r["token_ids"] for r in v1]
    if name == "plain":
        return
    # the option changed what was generated (else this case tests nothing)
    plain = [r["token_ids"] for r in outputs["plain"][0]]
    if name not in ("logprobs", "min_p"):  # these do not change greedy tokens
        assert [r["token_ids"] for r in v1] != plain, name
    if name == "thinking_budget":  # the end marker was forced, right away, for some prompts
        from transformers import AutoTokenizer

        end = AutoTokenizer.from_pretrained(tiny_models["llama"]).encode(
            REASONING["reasoning_end_str"], add_special_tokens=False
        )
        assert any(r["token_ids"][: len(end)] == end for r in v2), (end, [r["token_ids"] for r in v2])
    if name == "logprobs":
        for i, (a, b) in enumerate(zip(v1, v2)):
            for step, (x, y) in enumerate(zip(a["logprobs"], b["logprobs"])):
                _close(x, y, (i, step))
            for step, (x, y) in enumerate(zip(a["prompt_logprobs"], b["prompt_logprobs"])):
                _close(x, y, (i, "prompt", step))
