"""The first-NPU-run script (tests/npu/smoke.py, ``nox -s npu-smoke``) runs: through the
contract double here, where every check must pass or report (the double's answers are its
models of the device, so this proves the checks run, not what an NPU does); without an NPU
and without the double it skips with its reason."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.doubles import torch_npu_wheel as wheel
from tests.support.models import ROOT

pytest.importorskip("vllm")


def _smoke(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.npu.smoke", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_every_check_runs_through_the_double():
    done = _smoke(wheel.double_env(), "--double")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line[:4] in ("PASS", "FAIL", "INFO")]
    from tests.npu.smoke import CHECKS

    assert len(lines) == len(CHECKS), done.stdout
    assert "0 failed" in done.stdout
    # what the double models: the band applies, the sparse-0 mask and one over-full call are refused
    assert any(line.startswith("PASS  band_in_decode") for line in lines)
    assert any(line.startswith("INFO  mask_past_512: refused") for line in lines)
    assert any("one call refused" in line for line in lines if "blocknum_shared_blocks" in line)


def test_without_an_npu_it_says_why_and_passes():
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.npu.smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.startswith("npu-smoke skipped: "), done.stdout + done.stderr
