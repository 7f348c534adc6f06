"""Pipeline parallelism on one node (Model Runner V2's PP handler through the platform's
streams): PP=2 over the mp executor, greedy tokens equal to transformers' for the tiny Qwen2,
the engine core in the runner process. PP=2 of the MoE + MLA model (tiny DeepSeek-V3) runs
across two nodes in test_multi_node.py."""

from __future__ import annotations

import pytest

from tests.support.engines import IN_PROCESS, clean_shutdown, run_spec
from tests.support.oracle import hf_greedy
from tests.support.prompts import PROMPTS

ARCHS = ("qwen2",)
ENGINE = {"dtype": "float32", "max_model_len": 512, "seed": 0, "pipeline_parallel_size": 2}


@pytest.fixture(scope="module")
def served(tiny_models):
    runs = [
        {"model": str(tiny_models[arch]), "engine": ENGINE, "batches": [PROMPTS], "env": IN_PROCESS}
        for arch in ARCHS
    ]
    result, output = run_spec({"runs": runs})
    return dict(zip(ARCHS, result["runs"])), output


@pytest.mark.parametrize("arch", ARCHS)
def test_pp2_equals_transformers(served, tiny_models, arch):
    runs, _ = served
    tokens = [c["token_ids"] for c in runs[arch]["batches"][0]]
    assert tokens == hf_greedy(tiny_models[arch], PROMPTS)


def test_engines_shut_down_cleanly(served):
    clean_shutdown(served[1])
