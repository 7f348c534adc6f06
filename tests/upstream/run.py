"""Run upstream vLLM's own tests against the installed wheel, in host emulation, and
judge the outcome against ``expectations.toml``.

    python -m tests.upstream.run --source DIR [--selection fast|full] [PATH ...]

``DIR`` is upstream's test tree unpacked from the pinned sdist
(``python -m ascend_builder upstream-tests`` prints it; ``nox -s upstream-tests`` does
all of this). Offline hub entries come from ``hub.py``. Every test not listed in the
expectations file must pass; a listed one must fail (or be skipped) as listed. Any
other outcome -- an unexpected failure, skip or pass, or an expectation that no
longer matches any test -- fails the run, so the file stays true. Counts per
directory are printed, and written as JSON with ``--summary``.
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from tests.upstream.hub import ensure_hub

HERE = Path(__file__).resolve().parent
EXPECTATIONS = HERE / "expectations.toml"
ACCEPTS = {"pass": {"passed"}, "fail": {"failed", "error"}, "skip": {"skipped"}}
NEEDS_REF = {"upstream-bug", "not-offered"}
# Variables of this project's own test session that must not leak into upstream's run.
DROP_ENV = ("PYTHONPATH", "TORCH_NPU_DOUBLE_WHEEL", "TORCH_NPU_DOUBLE_DEVICES", "VLLM_ASCEND_KERNELS")


@dataclass(frozen=True)
class Expectation:
    patterns: tuple[str, ...]
    outcome: str
    reason: str
    note: str

    def matches(self, test: str) -> bool:
        return any(fnmatch.fnmatchcase(test, p) for p in self.patterns)


def load_expectations(path: Path = EXPECTATIONS) -> tuple[dict, dict, list[Expectation]]:
    data = tomllib.loads(path.read_text())
    reasons, selections = data["reasons"], data["selections"]
    expectations = []
    for i, item in enumerate(data.get("expect", [])):
        where = f"{path.name}: expect #{i + 1} ({item.get('tests')})"
        if item.get("outcome") not in ("fail", "skip"):
            raise ValueError(f"{where}: outcome must be 'fail' or 'skip'")
        if item.get("reason") not in reasons:
            raise ValueError(f"{where}: reason must be one of {sorted(reasons)}")
        if item["reason"] in NEEDS_REF and not item.get("note"):
            raise ValueError(f"{where}: reason {item['reason']!r} needs a note with the reference")
        expectations.append(Expectation(tuple(item["tests"]), item["outcome"], item["reason"],
                                        item.get("note", "")))
    return reasons, selections, expectations


def judge(outcomes: dict[str, dict], expectations: list[Expectation], selected: list[str]) -> dict:
    """Per test: ok, expected (with reason) or unexpected; plus expectations matching nothing."""
    verdicts = {}
    used = set()
    for test, result in outcomes.items():
        match = next((e for e in expectations if e.matches(test)), None)
        expected = match.outcome if match else "pass"
        if match:
            used.add(match)
        ok = result["outcome"] in ACCEPTS[expected]
        verdicts[test] = {"outcome": result["outcome"], "expected": expected, "ok": ok,
                          "reason": match.reason if match else None, "message": result.get("message", "")}
    ran = {t.split("::")[0] for t in outcomes}
    stale = [e for e in expectations if e not in used
             and any(p.split("::")[0] in ran for p in e.patterns)
             and any(p.split("::")[0].startswith(tuple(selected)) for p in e.patterns)]
    return {"verdicts": verdicts, "stale": stale}


def _directory(test: str) -> str:
    return test.split("::")[0].rsplit("/", 1)[0]


def report(judgement: dict, reasons: dict) -> tuple[str, dict]:
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    lines = []
    for test, v in sorted(judgement["verdicts"].items()):
        d = counts[_directory(test)]
        if not v["ok"]:
            d["unexpected"] += 1
            lines.append(f"UNEXPECTED {v['outcome']} (expected {v['expected']}): {test}\n    {v['message']}")
        elif v["expected"] == "pass":
            d["passed"] += 1
        else:
            d[f"expected {v['expected']}: {v['reason']}"] += 1
    for e in judgement["stale"]:
        lines.append(f"STALE expectation ({e.outcome}, {e.reason}) matches no test: {list(e.patterns)}")
    table = ["", f"{'directory':42} {'passed':>7} {'expected fail/skip (by reason)':>34} {'unexpected':>10}"]
    for d, c in sorted(counts.items()):
        expected = ", ".join(f"{k.split(': ')[1]} {k.split()[1]} {n}" for k, n in sorted(c.items())
                             if k.startswith("expected"))
        table.append(f"{d:42} {c['passed']:>7} {expected or '-':>34} {c['unexpected']:>10}")
    summary = {d: dict(c) for d, c in sorted(counts.items())}
    return "\n".join(lines + table), summary


def run_pytest(source: Path, paths: list[str], timeout: int, hub_cache: Path) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k not in DROP_ENV}
    with tempfile.TemporaryDirectory() as tmp:
        outcomes_file = Path(tmp) / "outcomes.jsonl"
        env.update(VLLM_ASCEND_EMULATE="1", HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", HF_HOME=str(Path(tmp) / "hf-home"), ASCEND_OUTCOMES=str(outcomes_file),
                   PYTHONPATH=str(HERE / "plugin"), VLLM_ASCEND_HOST_KV_CACHE_MB="64")
        cmd = [sys.executable, "-m", "pytest", "-p", "ascend_outcomes", "-p", "no:cacheprovider", "-q",
               "--continue-on-collection-errors", f"--timeout={timeout}", "-o", "addopts=", "-rN",
               "--disable-warnings", *paths]
        subprocess.run(cmd, cwd=source, env=env)
        if not outcomes_file.exists():
            raise SystemExit("error: upstream's pytest run ended without results (see its output above)")
        return {r["test"]: r for r in map(json.loads, outcomes_file.read_text().splitlines())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, required=True, help="upstream test tree (from the pinned sdist)")
    p.add_argument("--selection", default="full", help="named selection in expectations.toml (default: full)")
    p.add_argument("--timeout", type=int, default=180, help="per-test timeout in seconds")
    p.add_argument("--cache", type=Path, default=Path(".work/upstream"), help="where the offline hub is built")
    p.add_argument("--summary", type=Path, help="write per-directory counts as JSON here")
    p.add_argument("paths", nargs="*", help="test paths relative to the upstream tree (default: the selection)")
    args = p.parse_args(argv)

    reasons, selections, expectations = load_expectations()
    paths = args.paths or selections[args.selection]
    hub_cache = ensure_hub(args.cache.resolve())
    started = time.monotonic()
    outcomes = run_pytest(args.source.resolve(), paths, args.timeout, hub_cache)
    judgement = judge(outcomes, expectations, paths)
    text, summary = report(judgement, reasons)
    print(text)
    unexpected = sum(not v["ok"] for v in judgement["verdicts"].values()) + len(judgement["stale"])
    print(f"\nupstream tests: {len(outcomes)} results in {time.monotonic() - started:.0f} s, "
          f"{unexpected} unexpected")
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
