"""Start-up checks of the NPU platform that need no engine: upstream's environment
variable check knows the distribution's own variables (and suggests the likely one for a
misspelling), and a script that builds an engine at import time is told why the spawned
children need the ``__main__`` guard; sleep-mode settings with no Ascend form are
refused by name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm.ascend import envs
from vllm.ascend.errors import AscendConfigError, AscendStartupError
from vllm.ascend.platform import checks, npu

ROOT = Path(__file__).resolve().parents[3]


def _read_in(paths) -> set[str]:
    names = set()
    for path in paths:
        names |= set(re.findall(r"\bVLLM_ASCEND_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return names


def _documented() -> set[str]:
    # the rows of the docs' variable tables
    names = set()
    for path in (ROOT / "docs").glob("*.md"):
        names |= set(re.findall(r"^\| `(VLLM_ASCEND_[A-Z0-9_]+)`", path.read_text(), re.MULTILINE))
    return names


def test_every_variable_the_code_reads_or_the_docs_list_is_known():
    read = _read_in([*(ROOT / "overlay").rglob("*.py"), *(ROOT / "build").rglob("*.py")])
    documented = _documented()
    assert read and documented, "the scan found no variable: the pattern or the paths are wrong"
    assert read | documented == set(envs.DISTRIBUTION_VARIABLES)
    assert read <= documented, f"read but not in a docs table: {sorted(read - documented)}"


def test_known_variables_pass_and_unknown_ones_are_named(monkeypatch):
    for name in [n for n in os.environ if n.startswith("VLLM_")]:  # the caller's (the suite sets its own)
        monkeypatch.delenv(name)
    for name in [*envs.DISTRIBUTION_VARIABLES, "VLLM_LOGGING_LEVEL"]:
        monkeypatch.setenv(name, "1")
    npu.NPUPlatform.validate_environ(hard_fail=True)  # nothing unknown

    warned = []
    monkeypatch.setattr(npu.logger, "warning", lambda fmt, *args: warned.append(fmt % args))
    monkeypatch.setenv("VLLM_ASCEND_KERNEL", "npu")  # one letter short
    monkeypatch.setenv("VLLM_NOT_A_SETTING_AT_ALL", "1")
    npu.NPUPlatform.validate_environ(hard_fail=False)
    assert sorted(warned) == [
        "Unknown vLLM environment variable detected: VLLM_ASCEND_KERNEL (did you mean VLLM_ASCEND_KERNELS?)",
        "Unknown vLLM environment variable detected: VLLM_NOT_A_SETTING_AT_ALL",
    ]
    with pytest.raises(ValueError, match="VLLM_ASCEND_KERNEL .did you mean VLLM_ASCEND_KERNELS"):
        npu.NPUPlatform.validate_environ(hard_fail=True)


def test_a_spawned_child_that_reimports_an_unguarded_script_says_why(tmp_path):
    # the child re-imports the script while multiprocessing bootstraps it; the check fires
    # there, and not in the parent (which imports the script as __main__ and goes on to spawn)
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            import multiprocessing
            from vllm.ascend.platform.npu import _check_not_bootstrapping

            _check_not_bootstrapping()
            child = multiprocessing.get_context("spawn").Process(target=print)
            child.start()
            child.join()
            print("child exit code", child.exitcode)
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "child exit code 1" in out.stdout, out.stderr[-2000:]
    assert AscendStartupError.__name__ in out.stderr
    assert "'spawn'" in out.stderr and 'if __name__ == "__main__":' in out.stderr


@pytest.mark.parametrize(
    "setting,named",
    [
        ({"sleep_mode_backend": "cuda_checkpoint"}, "--sleep-mode-backend"),
        ({"enable_nccl_comm_suspend": True}, "--enable-nccl-comm-suspend"),
    ],
)
def test_sleep_mode_settings_without_an_ascend_form_are_refused_by_name(setting, named):
    model_config = SimpleNamespace(
        **{
            "enable_sleep_mode": True,
            "sleep_mode_backend": "cumem",
            "enable_nccl_comm_suspend": False,
            **setting,
        }
    )
    with pytest.raises(AscendConfigError, match=named):
        checks.check_sleep_mode(SimpleNamespace(model_config=model_config))
    checks.check_sleep_mode(
        SimpleNamespace(
            model_config=SimpleNamespace(
                enable_sleep_mode=True, sleep_mode_backend="cumem", enable_nccl_comm_suspend=False
            )
        )
    )


def test_workers_spawn_unless_the_caller_chose_a_start_method(monkeypatch):
    warned = []
    monkeypatch.setattr(npu.logger, "warning_once", lambda fmt, *args: warned.append(fmt % args))
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    npu._default_multiproc_method()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and not warned

    # a caller's choice is kept (upstream's own tests fork to inherit a monkeypatch) and said
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    npu._default_multiproc_method()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    assert len(warned) == 1 and "VLLM_WORKER_MULTIPROC_METHOD=fork is kept" in warned[0]


def test_the_shared_experts_side_stream_stays_off_and_a_request_for_it_is_answered(monkeypatch):
    warned = []
    monkeypatch.setattr(npu.logger, "warning_once", lambda fmt, *args: warned.append(fmt % args))
    for unset_or_off in (None, "1"):
        if unset_or_off is None:
            monkeypatch.delenv("VLLM_DISABLE_SHARED_EXPERTS_STREAM", raising=False)
        else:
            monkeypatch.setenv("VLLM_DISABLE_SHARED_EXPERTS_STREAM", unset_or_off)
        npu._no_shared_experts_stream()
        assert os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] == "1" and not warned
    # a caller's 0 cannot be honoured (the side stream needs CUDA events): overridden and said
    monkeypatch.setenv("VLLM_DISABLE_SHARED_EXPERTS_STREAM", "0")
    npu._no_shared_experts_stream()
    assert os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] == "1"
    assert len(warned) == 1 and "VLLM_DISABLE_SHARED_EXPERTS_STREAM=0 is overridden" in warned[0]
