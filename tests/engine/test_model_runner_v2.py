"""Model Runner V2 (the default) against the V1 runner, the same model and prompts in one
runner process: the sampling options whose V2 kernels run as the Ascend torch forms
(penalties, logit bias, allowed tokens, min tokens with stop ids, bad words, min-p,
logprobs and prompt logprobs, the thinking-token budget) give the same greedy tokens and
logprobs as V1's torch sampler, an implementation that shares no code with them.

A third engine runs on V2 what V1 served alone before: n-gram speculative decoding
(greedy tokens equal to plain decoding, drafts accepted where the output repeats) and
prompt embeddings (equal to the text prompts they embed, and to transformers), both
under chunked prefill, so embeddings and drafts cross chunk boundaries. A fourth serves a
Qwen2-VL on V2 (M-RoPE positions, text prompts, chunked prefill) against transformers. Two
more draft with a separate draft model: the target itself (every draft must be accepted)
and a smaller Llama with other weights (drafts rejected; the tokens must not change). The
last drafts with an EAGLE head made here (random weights: the tokens must not change, and
the head the drafter holds is the checkpoint's)."""

from __future__ import annotations

import math

import pytest

from tests.support.engines import IN_PROCESS, clean_shutdown, run_spec
from tests.support.models import LLAMA_DRAFT, LLAMA_EAGLE, QWEN2_VL
from tests.support.oracle import hf_greedy
from tests.support.prompts import PROMPTS

# Reasoning markers for the thinking budget: pieces of the tiny Llama's vocabulary that some
# prompts contain (its vocabulary is random byte pairs; no model here reasons).
REASONING = {"reasoning_start_str": " and", "reasoning_end_str": " done"}
BASE = {"dtype": "float32", "max_model_len": 512, "seed": 0}
ENGINE = {
    **BASE,
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
    # three allowed tokens: the greedy output falls into a cycle, which n-gram drafts hit
    "cycle": {"allowed_token_ids": [5, 17, 40]},
}
# the engines on V2 besides the sampling pair run chunked prefill: prompts, embeddings and
# drafts cross chunk boundaries
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 16, "max_num_seqs": 4}
EAGLE = {"method": "eagle", "num_speculative_tokens": 3}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# the third engine's batches: text, the cycling batch, then the prompts as embeddings
# (every other one; the rest stay text in the same batch)
EMBEDDED = [{"embeds_of": p} if i % 2 == 0 else p for i, p in enumerate(PROMPTS)]


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

    def on_v2(model, engine, batches, **more):
        engine = {**CHUNKED, **engine}
        return {
            "model": str(model),
            "engine": engine,
            "batches": batches,
            "max_tokens": 16,
            **more,
            "env": IN_PROCESS,
            "report_runner": True,
        }

    def drafting(spec, engine=BASE, batches=(PROMPTS,), **more):
        engine = {**engine, "speculative_config": spec, "disable_log_stats": False}
        return on_v2(tiny_models["llama"], engine, list(batches), **more)

    def draft_model(path, k):
        return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}

    runs += [
        drafting(
            NGRAM,
            {**ENGINE, "enable_prompt_embeds": True},
            [PROMPTS, PROMPTS, EMBEDDED],
            batch_sampling=[{}, BATCHES["cycle"], {}],
        ),
        # (vLLM profiles the vision tower with dummy images at start-up)
        on_v2(tiny_models[QWEN2_VL], BASE, [PROMPTS]),
        drafting(draft_model(tiny_models["llama"], 3)),
        drafting(draft_model(tiny_models[LLAMA_DRAFT], 2)),
        drafting({**EAGLE, "model": str(tiny_models[LLAMA_EAGLE])}, drafter_parameters=True),
    ]
    result, output = run_spec({"runs": runs}, timeout=900)
    clean_shutdown(output)
    v1, v2, extra, mrope, *drafted = result["runs"]
    assert [r["runner"] for r in result["runs"]] == ["NPUModelRunner"] + ["NPUModelRunnerV2"] * 6
    pairs = {name: (a, b) for name, a, b in zip(BATCHES, v1["batches"], v2["batches"])}
    return pairs, extra, mrope, drafted


def _ids(batch):
    return [r["token_ids"] for r in batch]


def test_v2_ngram_drafts_keep_greedy_tokens(outputs):
    pairs, extra, *_ = outputs
    plain, cycle, _ = extra["batches"]
    assert _ids(plain) == _ids(pairs["plain"][0])
    assert _ids(cycle) == _ids(pairs["cycle"][0])
    counters = extra["counters"]
    assert counters["vllm:spec_decode_num_draft_tokens"] > 0, counters
    # the cycling outputs repeat: drafts taken from them are accepted
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0, counters


def test_v2_draft_model_keeps_greedy_tokens(outputs):
    pairs, _, _, (itself, smaller, _) = outputs
    plain = _ids(pairs["plain"][0])
    for run in (itself, smaller):
        assert _ids(run["batches"][0]) == plain
        assert run["counters"]["vllm:spec_decode_num_draft_tokens"] > 0, run["counters"]
    # the target drafting for itself: every draft is its own greedy token
    counters = itself["counters"]
    assert counters["vllm:spec_decode_num_accepted_tokens"] == counters["vllm:spec_decode_num_draft_tokens"]
    # other weights: drafts were rejected, and the output above is still the target's
    counters = smaller["counters"]
    assert counters["vllm:spec_decode_num_accepted_tokens"] < counters["vllm:spec_decode_num_draft_tokens"]


def test_v2_eagle_keeps_greedy_tokens_with_the_checkpoint_head(outputs, tiny_models):
    from safetensors.torch import load_file

    pairs, _, _, (*_, eagle) = outputs
    assert _ids(eagle["batches"][0]) == _ids(pairs["plain"][0])
    assert eagle["counters"]["vllm:spec_decode_num_draft_tokens"] > 0, eagle["counters"]
    held = eagle["drafter_parameters"]
    checkpoint = load_file(str(tiny_models[LLAMA_EAGLE] / "model.safetensors"))
    fc = checkpoint["fc.weight"].double()
    [(name, (total, count))] = [(n, v) for n, v in held.items() if n.endswith("fc.weight")]
    assert count == fc.numel() and abs(total - float(fc.sum())) < 1e-6 * float(fc.abs().sum()), name
    layer = [v for n, v in held.items() if n.endswith("layers.0.mlp.down_proj.weight")]
    assert (
        layer and abs(layer[0][0] - float(checkpoint["layers.0.mlp.down_proj.weight"].double().sum())) < 1e-6
    )


def test_v2_mrope_model_equals_transformers(outputs, tiny_models):
    # text only: the three position rows are equal, so this checks that they are the
    # model's prefill positions and then the decode positions, not their channel split
    _, _, mrope, _ = outputs
    [batch] = mrope["batches"]
    assert _ids(batch) == hf_greedy(tiny_models[QWEN2_VL], PROMPTS)


def test_v2_prompt_embeds_equal_their_text(outputs, tiny_models):
    pairs, extra, *_ = outputs
    plain, _, embedded = extra["batches"]
    assert _ids(embedded) == _ids(plain)
    assert [r["prompt_len"] for r in embedded] == [r["prompt_len"] for r in plain]
    assert _ids(embedded[::2]) == hf_greedy(tiny_models["llama"], PROMPTS[::2])


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
    v1, v2 = outputs[0][name]
    assert [r["token_ids"] for r in v2] == [r["token_ids"] for r in v1]
    if name == "plain":
        return
    # the option changed what was generated (else this case tests nothing)
    plain = [r["token_ids"] for r in outputs[0]["plain"][0]]
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
