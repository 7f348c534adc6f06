"""The offline disaggregated-prefill example (examples/disaggregated_prefill/offline.py) as a
user runs it, in host emulation: a prefill LLM and a decode LLM in two processes, the KV
pulled over Mooncake (TCP). Its greedy tokens must equal transformers' and the decode
process's own colocated run, and the decode side must have pulled KV.

Also with Gemma 3 (sliding-window and full layers alternating: two KV-cache groups in
upstream's hybrid manager, each moved by its own block table). A 24-token window over
8-token blocks and prompts of 31, 39 and 47 tokens put the first key the decode side's
last prompt token needs on the last slot of a block, the block a sliding-window group
frees first (kv_transfer/groups.py); 12 generated tokens outgrow the window. The same
prompts with the hybrid manager off (one group: every layer keeps every block) move more
bytes for the same tokens.

The hybrid Gemma 3 run moves its KV layer-wise (``--layerwise``: both processes get the
prompts at once, the decode side reads each layer of each group as the prefill forward
writes it; the example fails if any layer-wise pull failed), the other two pull after
the prefill; a Qwen2 pair runs both modes in NPU-path mode in
tests/engine/test_graph_serving.py, where they move the same bytes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from harness.ports import free_ports
from tests.support.models import ROOT
from tests.support.oracle import hf_greedy
from tests.support.selection import cases_to_start, extended_params

MAX_TOKENS = 12
WINDOWED = ["--block-size", "8", "--prompt-lengths", "31,39,47"]
RUNS = {
    "qwen2": ("qwen2", []),
    "gemma3-hybrid": ("gemma3", [*WINDOWED, "--layerwise"]),
    "gemma3-one-group": ("gemma3", [*WINDOWED, "--disable-hybrid-kv-cache-manager"]),
}


# extended (out of CI's run): the example runs with Qwen2 in NPU-path mode, in both
# transfer modes, in test_graph_serving.py, and P/D with a Qwen2 (one KV head) equals
# transformers in test_pd_serving.py
EXTENDED_RUNS = ("qwen2",)


def _run_example(model, options: list[str], out) -> dict:
    command = [
        sys.executable,
        str(ROOT / "examples" / "disaggregated_prefill" / "offline.py"),
        *("--model", str(model), "--dtype", "float32", "--max-tokens", str(MAX_TOKENS)),
        *("--prefill-kv-port", str(free_ports(1)), "--decode-kv-port", str(free_ports(1))),
        *("--json", str(out)),
        *options,
    ]
    done = subprocess.run(
        command, env=dict(os.environ, VLLM_ASCEND_EMULATE="1"), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "equal greedy outputs" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-4000:]  # in neither process
    if "--layerwise" in options:  # layers were published during the forward, not only at its end
        assert re.search(
            r"publishes [1-9]\d* of \d+ layers as the forward writes them", done.stdout + done.stderr
        )
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tiny_models, tmp_path_factory, request) -> dict:
    out = tmp_path_factory.mktemp("pd-offline")
    return {
        name: _run_example(tiny_models[RUNS[name][0]], RUNS[name][1], out / f"{name}.json")
        for name in cases_to_start(request, "name", RUNS, EXTENDED_RUNS)
    }


@pytest.mark.parametrize("name", extended_params(RUNS, EXTENDED_RUNS))
def test_offline_example_decodes_pulled_kv_like_transformers(name, results, tiny_models):
    result = results[name]
    expected = hf_greedy(tiny_models[RUNS[name][0]], result["prompts"], MAX_TOKENS)
    assert result["disaggregated"] == expected
    assert result["colocated"] == expected
    assert result["pulled_bytes"] > 0
    assert result["failed_pulls"] == 0


def test_the_hybrid_manager_moves_only_the_blocks_inside_each_window(results):
    """Same prompts, same tokens: with one KV-cache group the windowed layers keep and move
    the whole prompt; with the hybrid manager they move the blocks of their window only."""
    hybrid, one_group = results["gemma3-hybrid"], results["gemma3-one-group"]
    assert hybrid["disaggregated"] == one_group["disaggregated"]
    assert 0 < hybrid["pulled_bytes"] < one_group["pulled_bytes"]
