"""The offline disaggregated-prefill example (examples/disaggregated_prefill/offline.py) as a
user runs it, in host emulation: a prefill LLM and a decode LLM in two processes, the KV
pulled over Mooncake (TCP). Its greedy tokens must equal transformers' and the decode
process's own colocated run, and the decode side must have pulled KV. Also with Gemma 3
(sliding-window and full layers alternating: upstream turns its hybrid KV-cache manager off
for a connector without hybrid support, so one KV group moves; prompts of up to 32 tokens
and 12 generated outgrow its 24-token window)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.models import ROOT
from tests.support.oracle import hf_greedy
from tests.support.ports import free_ports

MAX_TOKENS = 12


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_offline_example_decodes_pulled_kv_like_transformers(arch, tiny_models, tmp_path):
    model, out = tiny_models[arch], tmp_path / "result.json"
    command = [
        sys.executable,
        str(ROOT / "examples" / "disaggregated_prefill" / "offline.py"),
        *("--model", str(model), "--dtype", "float32", "--max-tokens", str(MAX_TOKENS)),
        *("--prefill-kv-port", str(free_ports(1)), "--decode-kv-port", str(free_ports(1))),
        *("--json", str(out)),
    ]
    done = subprocess.run(
        command, env=dict(os.environ, VLLM_ASCEND_EMULATE="1"), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "equal greedy outputs" in done.stdout
    result = json.loads(out.read_text())
    expected = hf_greedy(model, result["prompts"], MAX_TOKENS)
    assert result["disaggregated"] == expected
    assert result["colocated"] == expected
    assert result["pulled_bytes"] > 0
    assert "Traceback" not in done.stderr, done.stderr[-4000:]  # in neither process
