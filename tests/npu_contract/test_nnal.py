"""The double's NNAL switch mirrors the pinned wheel's lazy ATB guard
(``torch_npu/op_plugin/atb/_atb_ops.py``), and the distribution's start-up check names
a missing NNAL in one line instead of dying at the first MLA step."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

from harness.doubles import torch_npu_wheel as npu_wheel

torch_npu = pytest.importorskip("torch_npu")
if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
    pytest.skip("needs the torch_npu contract double", allow_module_level=True)

from torch_npu.op_plugin.atb import _atb_ops as double_guard  # noqa: E402

WHEEL_GUARD = "torch_npu/op_plugin/atb/_atb_ops.py"


def _string_constants(source: str) -> set[str]:
    """Every string literal of the module, adjacent pieces joined as Python joins them."""
    return {
        n.value
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def test_the_doubles_message_and_names_are_the_wheels():
    with zipfile.ZipFile(npu_wheel.fetch()) as zf:
        source = zf.read(WHEEL_GUARD).decode()
    assert double_guard.MISSING in _string_constants(source)
    assert '"libatb.so" in str(e)' in source  # the condition that picks that message
    assert "raise NNAL_EX from GLOBAL_E" in source  # raised lazily, at the first ATB call
    assert double_guard.NNAL_VARIABLE == "TORCH_NPU_DOUBLE_NNAL"


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True, timeout=300
    )


def test_without_nnal_the_first_atb_call_fails_and_the_start_up_check_says_why():
    code = """
        import vllm, torch, torch_npu
        from vllm.ascend.device.npu_runtime import atb_failure
        from types import SimpleNamespace
        from vllm.ascend.platform.checks import check_atb
        print("IMPORTED", torch_npu.npu_swiglu is torch.ops.npu.npu_swiglu)  # non-ATB ops untouched
        try:
            torch_npu._npu_reshape_and_cache(None, None, None, None, None)
        except OSError as exc:
            print("FIRST_CALL", type(exc.__cause__).__name__, exc.strerror)
        except Exception:  # past the guard: the dispatcher rejects the arguments
            print("REACHED_OP yes")
        print("FAILURE", atb_failure())
        check_atb(SimpleNamespace(model_config=SimpleNamespace(use_mla=False)))  # no MLA: no ATB needed
        try:
            check_atb(SimpleNamespace(model_config=SimpleNamespace(use_mla=True)))
        except Exception as exc:
            print("CHECK", type(exc).__name__, str(exc))
    """
    off = _run(code, TORCH_NPU_DOUBLE_NNAL="0", VLLM_ASCEND_EMULATE="1", VLLM_ASCEND_KERNELS="npu")
    assert off.returncode == 0, off.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in off.stdout.splitlines() if " " in line)
    assert lines["IMPORTED"] == "True"
    assert lines["FIRST_CALL"] == f"OSError {double_guard.MISSING}"
    assert lines["FAILURE"] == f"{double_guard.MISSING} ({double_guard.LOADER_ERROR})"
    check = lines["CHECK"]
    assert check.startswith("AscendConfigError MLA models need torch_npu's ATB ops"), check
    assert "nnal package is installed" in check and "/usr/local/Ascend/nnal/atb/set_env.sh" in check
    assert "\n" not in check

    on = _run(code, TORCH_NPU_DOUBLE_NNAL="1", VLLM_ASCEND_EMULATE="1", VLLM_ASCEND_KERNELS="npu")
    assert on.returncode == 0, on.stderr[-3000:]
    assert "FAILURE None" in on.stdout and "CHECK" not in on.stdout
    assert "REACHED_OP yes" in on.stdout  # with NNAL the call reached the op
