"""Model families with sliding-window attention, soft-capped attention logits and q/k norms
vs. Hugging Face transformers, token for token (float32, host emulation, the reference
kernels): a Mistral (a window on every layer), a Gemma 3 (windowed and full layers
alternating: two KV-cache groups in upstream's hybrid manager), a Gemma 2 (the same
alternation, its attention scores soft-capped where the cap changes its tokens:
examples/make_tiny_model.py), a dense Qwen3 and a gpt-oss (attention sinks, alternating
windows, YaRN, biased experts with the clamped SwiGLU; sinks and biases large enough that
dropping any of them changes the tokens).

Windows of 24 tokens over 8-token blocks, prompts up to ~60 tokens and 32 generated ones, so
every sequence outgrows its window (that the kernel never reads the blocks before a window,
which upstream's sliding-window manager may hand back to the pool, is checked in
tests/unit/kernels/test_kernels.py). One runner process serves every engine, each with chunked
prefill and prefix caching (the second prefix batch starts on cached blocks), plus the
Gemma 3 at TP=2; engine cores in the runner process (no second Python start).
"""

from __future__ import annotations

import pytest

from tests.support.engines import IN_PROCESS, clean_shutdown, run_spec
from tests.support.models import FAMILIES
from tests.support.oracle import hf_greedy
from tests.support.prompts import PREFIX_PROMPTS, PROMPTS

WINDOW = 24  # make_tiny_model.py's default --sliding-window
MAX_TOKENS = 32
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "seed": 0,
    "block_size": 8,
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 16,
    "max_num_seqs": 4,
    "enable_prefix_caching": True,
}
BATCHES = [PROMPTS, PREFIX_PROMPTS[:1], PREFIX_PROMPTS[1:]]
TP2 = "gemma3"


@pytest.fixture(scope="module")
def served(tiny_models) -> dict:
    runs = [
        {
            "model": str(tiny_models[family]),
            "engine": ENGINE,
            "batches": BATCHES,
            "max_tokens": MAX_TOKENS,
            "env": IN_PROCESS,
        }
        for family in FAMILIES
    ]
    runs.append(
        {
            "model": str(tiny_models[TP2]),
            "engine": {**ENGINE, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
            "batches": [PROMPTS],
            "max_tokens": MAX_TOKENS,
            "env": IN_PROCESS,
        }
    )
    result, output = run_spec({"runs": runs}, timeout=900)
    clean_shutdown(output)
    served = {family: run["batches"] for family, run in zip(FAMILIES, result["runs"])}
    served["tp2"] = result["runs"][-1]["batches"]
    return served


def _tokens(batch):
    return [r["token_ids"] for r in batch]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers(family, tiny_models, served):
    batches = served[family]
    expected = hf_greedy(tiny_models[family], PROMPTS + PREFIX_PROMPTS, MAX_TOKENS)
    assert _tokens(batches[0] + batches[1] + batches[2]) == expected
    assert all(len(set(t)) >= 8 for t in expected)  # varied outputs: the oracle discriminates
    assert all(r["num_cached_tokens"] > 0 for r in batches[2]), batches[2]
    if family != "qwen3":  # every sequence outgrows the window; some prompts already do
        assert min(r["prompt_len"] for r in batches[0]) + MAX_TOKENS > WINDOW
        assert max(r["prompt_len"] for r in batches[0]) > 2 * WINDOW


def test_hybrid_window_model_at_tensor_parallel_2(tiny_models, served):
    assert _tokens(served["tp2"][0]) == hf_greedy(tiny_models[TP2], PROMPTS, MAX_TOKENS)
