"""The counts of a conformance run, recorded and shown in ``docs/conformance.md``.

A run of a whole named selection with ``--record`` writes its summary to
``patches/<set>/upstream-counts/<selection>.json`` (per directory: passed, expected
failures and skips by reason, unexpected; plus results, wall time and workers) and
rewrites that selection's block in the doc, between ``<!-- counts:<selection> -->`` and
``<!-- /counts:<selection> -->``. ``check_doc`` (a test in ``tests/upstream``) fails when
a block differs from what its recorded summary renders to, so the doc's numbers are
never typed by hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "conformance.md"


def counts_dir(patch_set_dir: Path) -> Path:
    return patch_set_dir / "upstream-counts"


def _expected(counts: dict) -> str:
    """``fail: cuda 59, real-model 1; skip: cuda 7`` from ``{"fail: cuda": 59, ...}``."""
    parts = []
    for outcome in ("fail", "skip"):
        items = sorted(
            ((k.split(": ", 1)[1], n) for k, n in counts.items() if k.startswith(outcome + ": ")),
            key=lambda item: (-item[1], item[0]),
        )
        if items:
            parts.append(f"{outcome}: " + ", ".join(f"{reason} {n}" for reason, n in items))
    return "; ".join(parts) or "-"


def render(record: dict) -> str:
    """The markdown a recorded summary stands for in the doc."""
    dirs = record["directories"]
    total = {"passed": 0, "expected": 0, "unexpected": 0}
    rows = []
    for directory, counts in sorted(dirs.items()):
        expected = sum(n for k, n in counts.items() if ":" in k)
        total["passed"] += counts.get("passed", 0)
        total["expected"] += expected
        total["unexpected"] += counts.get("unexpected", 0)
        rows.append(
            f"| `{directory}` | {counts.get('passed', 0)} | {_expected(counts)} | "
            f"{counts.get('unexpected', 0)} |"
        )
    minutes = record["seconds"] / 60
    workers = record["workers"]
    head = f"Selection `{record['selection']}`: {record['results']} results in {minutes:.1f} minutes"
    if isinstance(workers, list):  # a selection with parts: one pytest run each
        runs = " and ".join(
            ("its own paths" if run["selection"] == record["selection"] else f"part `{run['selection']}`")
            + f" ({run['seconds'] / 60:.1f} minutes, {run['workers']} worker(s))"
            for run in workers
        )
        head += f" against `{record['wheel']}`, in {len(workers)} pytest runs: {runs}."
    else:
        head += f" on {workers} pytest worker(s), against `{record['wheel']}`."
    lines = [
        head + " Passed / expected failures and skips by reason / unexpected:",
        "",
        "| directory | passed | expected (by reason) | unexpected |",
        "|---|---:|---|---:|",
        *rows,
        f"| **all** | **{total['passed']}** | **{total['expected']}** | **{total['unexpected']}** |",
    ]
    return "\n".join(lines)


def _block(name: str) -> re.Pattern:
    return re.compile(
        rf"(<!-- counts:{re.escape(name)} -->\n)(.*?)(\n<!-- /counts:{re.escape(name)} -->)", re.DOTALL
    )


def record_run(patch_set_dir: Path, record: dict, doc: Path = DOC) -> Path:
    """Keep ``record`` as the selection's summary and rewrite its block in ``doc``."""
    path = counts_dir(patch_set_dir) / f"{record['selection']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    text = doc.read_text()
    block = _block(record["selection"])
    if not block.search(text):
        raise SystemExit(f"error: {doc} has no <!-- counts:{record['selection']} --> block to write")
    doc.write_text(block.sub(lambda m: m.group(1) + render(record) + m.group(3), text))
    return path


def check_doc(patch_set_dir: Path, doc: Path = DOC) -> list[str]:
    """Problems: a recorded summary without its block, or a block that differs from it."""
    text = doc.read_text()
    problems = []
    for path in sorted(counts_dir(patch_set_dir).glob("*.json")):
        record = json.loads(path.read_text())
        match = _block(record["selection"]).search(text)
        if match is None:
            problems.append(f"{doc.name} has no <!-- counts:{record['selection']} --> block for {path.name}")
        elif match.group(2) != render(record):
            problems.append(
                f"{doc.name}: the {record['selection']!r} counts differ from {path}; "
                f"run `nox -s upstream-tests -- --selection {record['selection']} --record`"
            )
    for name in re.findall(r"<!-- counts:([\w-]+) -->", text):
        if not (counts_dir(patch_set_dir) / f"{name}.json").is_file():
            problems.append(
                f"{doc.name} has a counts:{name} block but no recorded summary "
                f"{counts_dir(patch_set_dir) / (name + '.json')}"
            )
    return problems
