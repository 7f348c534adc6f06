"""LoRA (lora/punica.py) against transformers + peft: two adapters made here with peft
(random weights, different ranks, on every attention and MLP projection of the tiny
Qwen2, whose q/k/v projections have biases) served beside requests without an adapter,
in one runner process:

- TP=1, ``--max-loras 2``: both adapters and the base model in the same batches, under
  chunked prefill (prompts cross chunk boundaries with an adapter active);
- TP=2, ``--max-loras 1``: the same batches, so the scheduler must hold back requests of
  the second adapter while the first is active, and each TP rank applies its shard of
  the adapters' weights.

Each request's greedy tokens must equal transformers' with its adapter loaded by peft
(float32). LoRA on MoE and MLA models is refused at start-up (test_platform.py)."""

from __future__ import annotations

import pytest

from tests.support.engines import IN_PROCESS, clean_shutdown, run_spec
from tests.support.oracle import hf_lora_greedy, make_lora_adapter
from tests.support.prompts import PROMPTS

MAX_TOKENS = 12
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ENGINE = {"dtype": "float32", "max_model_len": 256, "seed": 0, "enable_lora": True, "max_lora_rank": 8}
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 32}
LAYOUTS = {
    "tp1": ({**ENGINE, **CHUNKED, "max_loras": 2}, IN_PROCESS),
    "tp2": (
        {**ENGINE, "max_loras": 1, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
        IN_PROCESS,
    ),
}


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = tiny_models["qwen2"]
    return {
        "a": make_lora_adapter(model, root / "a", rank=8, seed=1, targets=TARGETS),
        "b": make_lora_adapter(model, root / "b", rank=4, seed=2, targets=TARGETS),
    }


def _assignments() -> list[list]:
    """Two batches of the prompts, each prompt with adapter a, b or none (rotated)."""
    names = ["a", None, "b"]
    return [[names[(i + shift) % 3] for i in range(len(PROMPTS))] for shift in (0, 1)]


@pytest.fixture(scope="module")
def served(tiny_models, adapters):
    assignments = _assignments()
    runs = [
        {
            "model": str(tiny_models["qwen2"]),
            "engine": engine,
            "batches": [PROMPTS] * len(assignments),
            "batch_loras": [
                [None if n is None else str(adapters[n]) for n in batch] for batch in assignments
            ],
            "max_tokens": MAX_TOKENS,
            "env": env,
        }
        for engine, env in LAYOUTS.values()
    ]
    result, output = run_spec({"runs": runs})
    return dict(zip(LAYOUTS, result["runs"])), assignments, output


@pytest.fixture(scope="module")
def expected(tiny_models, adapters):
    model = tiny_models["qwen2"]
    return {name: hf_lora_greedy(model, adapters.get(name), PROMPTS, MAX_TOKENS) for name in ("a", "b", None)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_request_equals_transformers_with_its_adapter(served, expected, layout):
    runs, assignments, _ = served
    for batch, names in zip(runs[layout]["batches"], assignments):
        for i, (completion, name) in enumerate(zip(batch, names)):
            assert completion["token_ids"] == expected[name][i], (layout, i, name)


def test_the_adapters_change_the_tokens(expected):
    # otherwise the comparison above would hold with LoRA ignored
    for i in range(len(PROMPTS)):
        assert expected["a"][i] != expected[None][i] or expected["b"][i] != expected[None][i], i
    assert expected["a"] != expected[None] and expected["b"] != expected[None]


def test_engines_shut_down_cleanly(served):
    clean_shutdown(served[2])
