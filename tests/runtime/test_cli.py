"""The CLI on a host with no NPU: --version/--help always work; serving without an NPU
and without VLLM_ASCEND_EMULATE fails with one line that says what to set."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import vllm


def _vllm(*args: str, emulate: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("vllm")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ASCEND_EMULATE"}
    if emulate is not None:
        env["VLLM_ASCEND_EMULATE"] = emulate
    return subprocess.run([str(exe) if exe.exists() else shutil.which("vllm"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_version_and_help_work_without_npu():
    version = _vllm("--version")
    assert version.returncode == 0, version.stderr[-2000:]
    assert version.stdout.strip() == vllm.__version__
    for args in (("--help",), ("serve", "--help")):
        result = _vllm(*args)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "usage:" in result.stdout.lower()


def test_serve_without_npu_or_opt_in_is_one_clear_line(tiny_models):
    result = _vllm("serve", str(tiny_models["llama"]), "--host", "127.0.0.1", "--port", "1")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no Ascend NPU is available")
    assert "VLLM_ASCEND_EMULATE=1" in last
    assert "Traceback" not in result.stderr


def test_collect_env_reports_ascend_section():
    result = _vllm("collect-env", emulate="1")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "torch_npu version" in out and "CANN version" in out
    assert "Device mode                  : host emulation" in out
