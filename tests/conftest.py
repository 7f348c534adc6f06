"""Session set-up: on a host where the real torch_npu cannot run, the torch_npu
contract double (harness/doubles/torch_npu_site) stands in for it, in this process and in
every process the tests start (engines, workers, CLI), through PYTHONPATH.

So every run of the suite exercises "torch_npu installed, no NPU visible"; tests that
want the NPU kernels end to end also set VLLM_ASCEND_KERNELS=npu. On an Ascend host
with a working torch_npu nothing is replaced and the ``npu``-marked tests run for real.

Fixtures shared by the unit and engine tiers live here; plain helpers in tests/support/.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

# the builder's settings (pins, cache) for every tier, as `nox -s tests` gives them
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build"))

from harness.doubles import torch_npu_wheel as npu_wheel  # noqa: E402
from tests.support.models import TinyModels  # noqa: E402
from tests.support.processes import kill_leftovers, mark_test_run  # noqa: E402


def _real_torch_npu_works() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    probe = "import torch, torch_npu; assert torch_npu.npu.device_count() > 0"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


def _install_contract_double() -> None:
    if importlib.util.find_spec("vllm") is None:  # builder-only environment
        return
    if _real_torch_npu_works():
        return
    for key, value in npu_wheel.double_env().items():
        os.environ[key] = value
    sys.path.insert(0, str(npu_wheel.SITE))


_install_contract_double()

# The suite runs on two pytest-xdist workers (`nox -s tests`), so a TP=2 engine may stop
# while another test's engine loads both cores; upstream's 5 s grace for a worker to exit
# is then too short and it force-kills (which clean_shutdown() fails). Every process the
# tests start inherits a longer grace; a worker that really hangs is still killed, and
# reported, after it.
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "60")
# One OpenMP thread in every test process and all they start (vLLM's engines drop to one
# for serving already): with two workers, each starting several processes on two cores,
# more threads only wait for each other (a 4-rank gloo MoE test: 237 s with two threads,
# 201 s with one, one run each, one after the other, while a P/D cluster ran).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The P/D instances the tests start form one deployment: they share this secret
# (vllm/ascend/kv_transfer/trust.py), as every process the tests start inherits it.
os.environ.setdefault("VLLM_ASCEND_KV_SECRET", "test-deployment-secret-" + "0" * 32)
mark_test_run()  # (in the controller first: the xdist workers and all they start inherit it)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    """The tiny models (tests/support/models.py) by name, each made on first use."""
    return TinyModels(tmp_path_factory.mktemp("models"))


def _controller(config) -> bool:
    return not hasattr(config, "workerinput")  # not a pytest-xdist worker


def pytest_sessionfinish(session, exitstatus):
    """A process a test left running (an engine, a server, a Ray node) would take CPU from
    everything after it; name it, then kill it."""
    if not _controller(session.config):
        return
    found = kill_leftovers()
    if found:
        lines = "\n".join(f"  {pid}: {command[:200]}" for pid, command in sorted(found.items()))
        print(f"\nkilled {len(found)} process(es) the tests left running:\n{lines}", file=sys.stderr)


def pytest_terminal_summary(terminalreporter, config):
    """Seconds per test file (set-up, calls and teardown): what the CI time budget is spent on."""
    if not _controller(config):
        return
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if hasattr(report, "duration") and hasattr(report, "nodeid") and report.nodeid:
                path = report.nodeid.split("::")[0]
                per_file[path] = per_file.get(path, 0.0) + report.duration
    if len(per_file) < 2:
        return
    terminalreporter.section("seconds per test file (slowest 30)")
    for path, seconds in sorted(per_file.items(), key=lambda item: -item[1])[:30]:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
