"""The CLI on a host with no NPU: --version/--help always work; serving without an NPU
and without VLLM_ASCEND_EMULATE fails with one line that says what to set."""

from __future__ import annotations

import subprocess

import pytest

import vllm

from ascend_builder.config import pinned_version
from tests.support.vllm_cli import vllm_command


def _vllm(*args: str, timeout: int = 300, **options) -> subprocess.CompletedProcess:
    argv, env = vllm_command(*args, **options)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def test_version_and_help_work_without_npu():
    version = _vllm("--version")
    assert version.returncode == 0, version.stderr[-2000:]
    assert version.stdout.strip() == vllm.__version__
    for args in (("--help",), ("serve", "--help")):
        result = _vllm(*args)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "usage:" in result.stdout.lower()


@pytest.mark.parametrize("torch_npu", ["installed", "missing"])
def test_serve_without_npu_or_opt_in_is_one_clear_line(torch_npu, tiny_models):
    result = _vllm(
        "serve",
        str(tiny_models["llama"]),
        "--host",
        "127.0.0.1",
        "--port",
        "1",
        without_torch_npu=torch_npu == "missing",
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no Ascend NPU is available")
    assert "VLLM_ASCEND_EMULATE=1" in last
    if torch_npu == "missing":  # says exactly what to install
        assert (
            "torch_npu is not installed" in last
            and f"pip install 'torch-npu=={pinned_version('torch-npu', 'ascend-extra-npu.txt')}'" in last
        )
    else:
        assert "torch_npu sees no NPU" in last
    assert "Traceback" not in result.stderr


def test_collect_env_reports_ascend_section():
    result = _vllm("collect-env", emulate="1")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "torch_npu version" in out and "CANN version" in out
    assert "Device mode                  : host emulation" in out
