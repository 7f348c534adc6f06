"""The Ascend runner (Model Runner V2) in one runner process. The sampling options whose V2
kernels run as the Ascend torch forms (penalties, logit bias, allowed tokens, min tokens
with stop ids, bad words, min-p, logprobs and prompt logprobs) give the greedy tokens and
raw logprobs of an oracle that shares no code with them: transformers' logits with each
option applied in plain torch (``tests/support/sampling_oracle.py``). The thinking-token
budget is checked by what it must do (force the end marker); its kernel is held to
upstream's under Triton's interpreter in tests/unit/worker.

A second engine runs n-gram speculative decoding
(greedy tokens equal to plain decoding, drafts accepted where the output repeats) and
prompt embeddings (equal to the text prompts they embed, and to transformers), both
under chunked prefill, so embeddings and drafts cross chunk boundaries. A third serves a
Qwen2-VL on V2 (M-RoPE positions, text prompts, chunked prefill) against transformers. Two
more draft with a separate draft model: the target itself (every draft must be accepted)
and a smaller Llama with other weights (drafts rejected; the tokens must not change). The
last drafts with an EAGLE head made here (random weights: the tokens must not change, and
the head the drafter holds is the checkpoint's)."""

from __future__ import annotations

import pytest

from tests.support import sampling_oracle
from tests.support.engines import IN_PROCESS, clean_shutdown, run_spec
from tests.support.models import LLAMA_DRAFT, LLAMA_EAGLE, QWEN2_VL
from tests.support.oracle import hf_greedy
from tests.support.prompts import PROMPTS

# Reasoning markers for the thinking budget: pieces of the tiny Llama's vocabulary that some
# prompts contain (its vocabulary is random byte pairs; no model here reasons).
REASONING = {"reasoning_start_str": " and", "reasoning_end_str": " done"}
MAX_TOKENS = 16
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
    # stop ids from the tiny Llama's greedy output: some inside the first 10 tokens
    # (banned there), one later (the request stops on it)
    "min_tokens": {"min_tokens": 10, "stop_token_ids": [7, 409, 23], "ignore_eos": False},
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
            "max_tokens": MAX_TOKENS,
            "env": IN_PROCESS,
            "report_runner": True,
        }
    ]

    def on_v2(model, engine, batches, **more):
        engine = {**CHUNKED, **engine}
        return {
            "model": str(model),
            "engine": engine,
            "batches": batches,
            "max_tokens": MAX_TOKENS,
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
    sampled, extra, mrope, *drafted = result["runs"]
    assert [r["runner"] for r in result["runs"]] == ["NPUModelRunner"] * 6
    return dict(zip(BATCHES, sampled["batches"])), extra, mrope, drafted


def _ids(batch):
    return [r["token_ids"] for r in batch]


def test_v2_ngram_drafts_keep_greedy_tokens(outputs):
    batches, extra, *_ = outputs
    plain, cycle, _ = extra["batches"]
    assert _ids(plain) == _ids(batches["plain"])
    assert _ids(cycle) == _ids(batches["cycle"])
    counters = extra["counters"]
    assert counters["vllm:spec_decode_num_draft_tokens"] > 0, counters
    # the cycling outputs repeat: drafts taken from them are accepted
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0, counters


def test_v2_draft_model_keeps_greedy_tokens(outputs):
    batches, _, _, (itself, smaller, _) = outputs
    plain = _ids(batches["plain"])
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

    batches, _, _, (*_, eagle) = outputs
    assert _ids(eagle["batches"][0]) == _ids(batches["plain"])
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
    batches, extra, *_ = outputs
    plain, _, embedded = extra["batches"]
    assert _ids(embedded) == _ids(plain)
    assert [r["prompt_len"] for r in embedded] == [r["prompt_len"] for r in plain]
    assert _ids(embedded[::2]) == hf_greedy(tiny_models["llama"], PROMPTS[::2])


TOL = 1e-4  # float32 logprobs of the same weights through two implementations


def _check_logprobs(got, row, k, what, also):
    """vLLM's entries at one position (sorted [id, logprob]) against the oracle's full
    log-softmax ``row``: the top ``k`` plus ``also`` (the sampled or prompt token) when it
    is not among them, each value equal within TOL."""
    assert got is not None, what
    ids = [t for t, _ in got]
    for t, lp in got:
        assert abs(lp - float(row[t])) < TOL, (what, t, lp, float(row[t]))
    assert also in ids and len(ids) in (k, k + 1), (what, also, ids)
    kth = float(row.topk(k).values[-1])
    assert all(float(row[t]) >= kth - TOL for t in ids if t != also), (what, got)


@pytest.mark.parametrize("name", list(BATCHES))
def test_sampling_options_equal_an_independent_oracle(outputs, name, tiny_models):
    batch = outputs[0][name]
    if name == "thinking_budget":
        _check_thinking_budget(outputs[0], tiny_models)
        return
    expected = sampling_oracle.greedy(tiny_models["llama"], PROMPTS, MAX_TOKENS, BATCHES[name])
    assert _ids(batch) == [e["token_ids"] for e in expected]
    plain = _ids(outputs[0]["plain"])
    if name not in ("plain", "logprobs", "min_p"):  # these do not change greedy tokens
        assert _ids(batch) != plain, f"{name} changed nothing: the case tests nothing"
    if name == "min_tokens":  # some request stopped at a stop id, after the minimum
        stopped = [r["token_ids"] for r in batch if len(r["token_ids"]) < MAX_TOKENS]
        assert stopped and all(len(t) > BATCHES[name]["min_tokens"] for t in stopped), stopped
    if name == "logprobs":
        for i, (got, exp) in enumerate(zip(batch, expected)):
            for step, (entries, row) in enumerate(zip(got["logprobs"], exp["rows"])):
                _check_logprobs(entries, row, 3, (i, step), also=got["token_ids"][step])
            assert got["prompt_logprobs"][0] is None
            for pos, entries in enumerate(got["prompt_logprobs"][1:], start=1):
                row = exp["prompt_rows"][pos - 1]
                _check_logprobs(entries, row, 2, (i, "prompt", pos), also=exp["prompt_ids"][pos])


def _find(seq, sub):
    """Start indices of ``sub`` in ``seq``."""
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i : i + len(sub)] == sub]


def _check_thinking_budget(batches, tiny_models):
    """A request whose prompt leaves a reasoning span open (start marker after the last
    end marker) with at least the budget's tokens in it gets the end marker forced right
    away; one with no span open, that never starts one, decodes as without a budget."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    start = tok.encode(REASONING["reasoning_start_str"], add_special_tokens=False)
    end = tok.encode(REASONING["reasoning_end_str"], add_special_tokens=False)
    budget = BATCHES["thinking_budget"]["thinking_token_budget"]
    forced = untouched = 0
    for prompt, got, plain in zip(PROMPTS, batches["thinking_budget"], batches["plain"]):
        ids = tok(prompt).input_ids
        starts, ends = _find(ids, start), _find(ids, end)
        open_at = starts[-1] + len(start) if starts and (not ends or starts[-1] > ends[-1]) else None
        if open_at is not None and len(ids) - open_at >= budget:
            assert got["token_ids"][: len(end)] == end, (prompt, got["token_ids"], end)
            forced += 1
        elif open_at is None and not _find(plain["token_ids"], start):
            assert got["token_ids"] == plain["token_ids"], prompt
            untouched += 1
    assert forced and untouched, (forced, untouched)
