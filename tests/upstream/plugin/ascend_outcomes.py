"""pytest plugin loaded into upstream's test run (``-p ascend_outcomes``): one JSON line
per test with its outcome, and one per module that fails to collect.

Outcomes: passed, failed (the test body), error (setup or teardown), skipped. A test
that passes but errors in teardown counts as error. Written to the file named by
``ASCEND_OUTCOMES``; a module with its own name so it cannot clash with upstream's
``tests`` package, which is first on ``sys.path`` during the run.
"""

from __future__ import annotations

import json
import os

_results: dict[str, dict] = {}


def _summary(report) -> str:
    """One line: the skip reason, or the last ``E`` line of a failure."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:300]
    text = (getattr(report, "longreprtext", "") or "").strip()
    errors = [line[2:].strip() for line in text.splitlines() if line.startswith("E ")]
    last = errors[-1] if errors else (text.splitlines()[-1] if text else "")
    return last[:300]


def pytest_runtest_logreport(report) -> None:
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if report.when == "call" and report.failed:
        entry.update(outcome="failed", message=_summary(report))
    elif report.failed and entry["outcome"] != "failed":
        entry.update(outcome="error", message=f"{report.when}: {_summary(report)}")
    elif report.skipped and entry["outcome"] == "passed":
        entry.update(outcome="skipped", message=_summary(report))
    if report.when == "call" and getattr(report, "wasxfail", None) is not None:
        entry["outcome"] = "skipped" if report.skipped else "passed"


def pytest_collectreport(report) -> None:
    if report.failed:
        _results[report.nodeid] = {"outcome": "error", "message": f"collection: {_summary(report)}"}


def pytest_sessionfinish(session, exitstatus) -> None:
    path = os.environ.get("ASCEND_OUTCOMES")
    if path:
        with open(path, "w") as f:
            for nodeid, entry in sorted(_results.items()):
                f.write(json.dumps({"test": nodeid, **entry}) + "\n")
