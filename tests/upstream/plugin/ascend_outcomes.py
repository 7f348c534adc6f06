"""pytest plugin loaded into upstream's test run (``-p ascend_outcomes``): one JSON line
per test with its outcome, and one per module that fails to collect; and the platform's
Triton-kernel replacements registered at session start, as a vLLM worker does.

Upstream's per-test global clean-up is skipped when ``ASCEND_SKIP_GLOBAL_CLEANUP=1``
(a selection's ``global-cleanup = false``).

The test files named in ``ASCEND_LIFT_CUDA_GATES`` (``os.pathsep``-separated paths of
upstream's tree; a selection's ``lift-cuda-gates``) are collected with the platform
answering "CUDA" to ``is_cuda()`` / ``is_cuda_alike()`` in their module-level gates
alone: upstream skips them at module level on every other platform, though what they
test (the engine core, its client, the async engine) runs on this one. Everything else
(upstream modules they import, ``skipif`` marks, the tests) sees the platform as it is.

Outcomes: passed, failed (the test body), error (setup or teardown), skipped. A test
that passes but errors in teardown counts as error. Written to the file named by
``ASCEND_OUTCOMES`` as each test finishes, so a run that is killed keeps what it did;
a module with its own name so it cannot clash with upstream's ``tests`` package, which
is first on ``sys.path`` during the run.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import sys
from pathlib import Path

_results: dict[str, dict] = {}
_writer = True  # False in pytest-xdist workers: their reports reach the controller, which writes


def pytest_configure(config) -> None:
    global _writer
    _writer = not hasattr(config, "workerinput")


def pytest_sessionstart(session) -> None:
    """What every vLLM worker process does before it builds a model runner
    (``WorkerWrapperBase.init_worker``): the platform puts its kernels in place of
    upstream's Triton kernels. Upstream's kernel-level tests never pass through a
    worker, so this process does it too (each xdist worker runs its own session)."""
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()


def pytest_collection_modifyitems(config, items) -> None:
    """A selection with ``global-cleanup = false`` gives every test upstream's own
    ``skip_global_cleanup`` marker: no ``cleanup_dist_env_and_memory()`` after each test
    (a full garbage collection of a heap holding vLLM, about 0.5 s per test here). Tests
    that start engines or process groups still clean up after themselves."""
    if os.environ.get("ASCEND_SKIP_GLOBAL_CLEANUP") != "1":
        return
    import pytest

    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)


def _lifted() -> set[str]:
    return {p for p in os.environ.get("ASCEND_LIFT_CUDA_GATES", "").split(os.pathsep) if p}


def _gate_lines(path: str) -> set[int]:
    """The lines of a file's module-level CUDA gates: the condition of each top-level
    ``if`` whose body calls ``pytest.skip(..., allow_module_level=True)``."""
    lines: set[int] = set()
    for node in ast.parse(Path(path).read_text(), path).body:
        if not isinstance(node, ast.If):
            continue
        skips = any(
            isinstance(call, ast.Call) and any(k.arg == "allow_module_level" for k in call.keywords)
            for statement in node.body
            for call in ast.walk(statement)
        )
        if skips:
            lines.update(range(node.test.lineno, node.test.end_lineno + 1))
    return lines


@contextlib.contextmanager
def _answering_cuda(module_file: str):
    """``is_cuda()`` / ``is_cuda_alike()`` answer "CUDA" to the file's gate conditions
    alone: upstream modules it imports meanwhile (asked "CUDA?", ``fa_utils`` would import
    FlashAttention) and its tests' own ``skipif`` marks see the platform as it is."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    gates = _gate_lines(module_file)
    saved = {name: platform.__dict__.get(name) for name in ("is_cuda", "is_cuda_alike")}

    def answer(name):
        own = getattr(current_platform, name)  # bound before it is replaced

        def asked(cls):
            caller = sys._getframe(1)
            return (caller.f_code.co_filename == module_file and caller.f_lineno in gates) or own()

        return classmethod(asked)

    for name in saved:
        setattr(platform, name, answer(name))
    try:
        yield
    finally:
        for name, attribute in saved.items():
            if attribute is None:
                delattr(platform, name)
            else:
                setattr(platform, name, attribute)


def _import_gate_lifted(collector) -> bool:
    import pytest

    if not isinstance(collector, pytest.Module):
        return False
    path = os.path.relpath(str(collector.path), str(collector.config.rootpath))
    return path in _lifted()


def pytest_make_collect_report(collector):
    """A listed test file is collected (imported, its tests gathered) while its gate
    conditions hear "CUDA"; an import that then fails is reported as the collection error
    it is, not hidden behind the gate's skip."""
    if not _import_gate_lifted(collector):
        return None
    from _pytest.runner import pytest_make_collect_report as collect

    with _answering_cuda(str(collector.path)):
        return collect(collector)


def _summary(report) -> str:
    """One line: the skip reason, or a failure's ``E`` lines (the exception and its
    detail, e.g. pydantic's "Value error, ..." below "1 validation error for ...")."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:300]
    text = (getattr(report, "longreprtext", "") or "").strip()
    errors = [line[2:].strip() for line in text.splitlines() if line.startswith("E ") and line[2:].strip()]
    if not errors:
        return text.splitlines()[-1][:300] if text else ""
    return " | ".join(errors[:3] + errors[-1:] if len(errors) > 4 else errors)[:500]


def pytest_runtest_logreport(report) -> None:
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "message": "", "seconds": 0.0})
    entry["seconds"] = round(entry["seconds"] + report.duration, 3)
    if report.when == "call" and report.failed:
        entry.update(outcome="failed", message=_summary(report))
    elif report.failed and entry["outcome"] != "failed":
        entry.update(outcome="error", message=f"{report.when}: {_summary(report)}")
    elif report.skipped and entry["outcome"] == "passed":
        entry.update(outcome="skipped", message=_summary(report))
    if report.when == "call" and getattr(report, "wasxfail", None) is not None:
        entry["outcome"] = "skipped" if report.skipped else "passed"


def pytest_runtest_logfinish(nodeid, location) -> None:
    _write(nodeid, _results.pop(nodeid, {"outcome": "passed", "message": "", "seconds": 0.0}))


def pytest_collectreport(report) -> None:
    if report.failed:
        _write(report.nodeid, {"outcome": "error", "message": f"collection: {_summary(report)}"})


def _write(nodeid: str, entry: dict) -> None:
    path = os.environ.get("ASCEND_OUTCOMES")
    if path and _writer:
        with open(path, "a") as f:
            f.write(json.dumps({"test": nodeid, **entry}) + "\n")
