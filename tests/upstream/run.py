"""Run upstream vLLM's own tests against the installed wheel, in host emulation, and
judge the outcome against the patch set's ``upstream-expectations.toml``.

    python -m tests.upstream.run --source DIR [--selection fast|full] [PATH ...]

``DIR`` is upstream's test tree unpacked from the pinned sdist
(``python -m ascend_builder upstream-tests`` prints it; ``nox -s upstream-tests`` does
all of this). Offline hub entries come from ``hub.py``. The expectations belong to the
patch set (``patches/<set>/upstream-expectations.toml``). Every test not listed there
must pass; a listed one must fail (or be skipped) as listed. Any
other outcome -- an unexpected failure, skip or pass, or an expectation that no
longer matches any test -- fails the run, so the file stays true. Counts per
directory are printed, and written as JSON with ``--summary``; ``--record`` keeps a
whole selection's counts in the patch set and writes them into docs/conformance.md
(``counts.py``).

A selection with ``importers-within = "<other selection>"`` also runs every test file
of that other selection that imports a module the patch set changes (``imports.py``),
so a patch's module cannot be left out of CI by forgetting to list its tests.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from tests.upstream.counts import record_run
from tests.upstream.hub import ensure_hub
from tests.upstream.imports import importers

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT / "build") not in sys.path:
    sys.path.insert(0, str(ROOT / "build"))  # the builder knows which modules the patches change

from ascend_builder.upstream_tests import patched_modules  # noqa: E402


def default_expectations() -> Path:
    """``patches/<patch set>/upstream-expectations.toml`` of the default patch set."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["vllm-ascend"]
    return ROOT / "patches" / config["patch-set"] / "upstream-expectations.toml"


ACCEPTS = {"pass": {"passed"}, "fail": {"failed", "error"}, "skip": {"skipped"}}
NEEDS_REF = {"upstream-bug", "not-offered", "ascend-semantics", "slow"}
# Variables of this project's own test session that must not leak into upstream's run.
DROP_ENV = (
    "PYTHONPATH",
    "TORCH_NPU_DOUBLE_WHEEL",
    "TORCH_NPU_DOUBLE_DEVICES",
    "VLLM_ASCEND_KERNELS",
    "VLLM_ASCEND_HOST_KV_CACHE_MB",  # a selection's host-kv-cache-mb, or the platform's default
)


@dataclass(frozen=True)
class Expectation:
    patterns: tuple[str, ...]
    outcome: str
    reason: str
    note: str

    def matches(self, test: str) -> bool:
        return any(_pattern(p).fullmatch(test) for p in self.patterns)


def _pattern(text: str) -> re.Pattern:
    """Node ids hold ``[params]``, so only ``*`` is a wildcard (any characters)."""
    return re.compile(".*".join(map(re.escape, text.split("*"))))


def load_expectations(path: Path) -> tuple[dict, dict, list[Expectation]]:
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
        expectations.append(
            Expectation(tuple(item["tests"]), item["outcome"], item["reason"], item.get("note", ""))
        )
    return reasons, selections, expectations


def judge(
    outcomes: dict[str, dict],
    expectations: list[Expectation],
    selected: list[str],
    deselected: tuple[str, ...] = (),
) -> dict:
    """Per test: ok, expected (with reason) or unexpected; plus expectations matching
    nothing (one that matches a test the selection deselects is not stale)."""
    verdicts = {}
    used = set()
    for test, result in outcomes.items():
        match = next((e for e in expectations if e.matches(test)), None)
        expected = match.outcome if match else "pass"
        if match:
            used.add(match)
        ok = result["outcome"] in ACCEPTS[expected]
        verdicts[test] = {
            "outcome": result["outcome"],
            "expected": expected,
            "ok": ok,
            "reason": match.reason if match else None,
            "message": result.get("message", ""),
        }
    stale = [
        e
        for e in expectations
        if e not in used
        and any(_selected(p, selected) for p in e.patterns)
        and not any(e.matches(test) for test in deselected)
    ]
    return {"verdicts": verdicts, "stale": stale}


def _selected(pattern: str, selected: list[str]) -> bool:
    """Whether the run covered what a pattern names: its file lies under a selected
    directory or file (a file that no longer exists included), or it falls within a
    selected node id."""
    file = pattern.split("::")[0].removesuffix("*")
    for path in selected:
        if "::" in path:
            if pattern.startswith(path):
                return True
        elif file == path or file.startswith(path.rstrip("/") + "/"):
            return True
    return False


def selection_paths(name: str, selections: dict, source: Path, patch_set_dir: Path) -> tuple[list[str], dict]:
    """The paths a named selection runs: its own, plus (``importers-within``) the test files
    of another selection that import a module the patch set changes, which it names with
    those modules. Package modules (``__init__.py``: ``vllm``, ``vllm.platforms``) are not
    counted: every test of every selection imports them."""
    selection = selections[name]
    paths = list(selection["paths"])
    gone = [path for path in paths if not (source / path).exists()]
    if gone:  # pytest would end with "no tests ran" and nothing said about why
        raise SystemExit(
            f"error: selection {name!r} names paths that upstream's tests at {source} do not "
            f"have: {', '.join(gone)}; remove them from upstream-expectations.toml "
            "(or name what replaced them)"
        )
    within = selection.get("importers-within")
    if not within:
        return paths, {}
    if within not in selections:
        raise SystemExit(f"error: selection {name!r}: importers-within names no selection {within!r}")
    modules = set(patched_modules(patch_set_dir, packages=False))
    found = importers(source, selections[within]["paths"], modules)
    added = {file: mods for file, mods in found.items() if not _selected(file, paths)}
    return paths + sorted(added), added


def deselected_tests(name: str, selection: dict, expectations: list[Expectation]) -> tuple[str, ...]:
    """A selection's ``deselect`` node ids (left out of it to keep its time, and run in
    wider selections). Each must be a test the expectations list, so why it is not worth
    its time here (a listed timeout, say) is written down."""
    deselected = tuple(selection.get("deselect", ()))
    for test in deselected:
        if not any(e.matches(test) for e in expectations):
            raise SystemExit(
                f"error: selection {name!r} deselects {test}, which no [[expect]] entry lists: "
                "deselect only tests the expectations explain"
            )
    # tests that pass, left out for their time alone (``deselect-passing``): each says why
    passing = []
    for entry in selection.get("deselect-passing", ()):
        test, why = entry.get("test", ""), entry.get("why", "").strip()
        if not test or not why:
            raise SystemExit(
                f"error: selection {name!r}: a deselect-passing entry needs a test and why "
                f"(its measured time), got {entry}"
            )
        if any(e.matches(test) for e in expectations):
            raise SystemExit(
                f"error: selection {name!r} deselects {test} as passing, but an [[expect]] entry "
                "lists it: put it in deselect"
            )
        passing.append(test)
    return deselected + tuple(passing)


def _directory(test: str) -> str:
    return test.split("::")[0].rsplit("/", 1)[0]


def report(judgement: dict, reasons: dict) -> tuple[str, dict]:
    """Unexpected results first, then per directory: passed, expected fail/skip by reason,
    unexpected. The summary is the same counts as data."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    lines = []
    for test, v in sorted(judgement["verdicts"].items()):
        c = counts[_directory(test)]
        if not v["ok"]:
            c["unexpected"] += 1
            lines.append(f"UNEXPECTED {v['outcome']} (expected {v['expected']}): {test}\n    {v['message']}")
        elif v["expected"] == "pass":
            c["passed"] += 1
        else:
            c[f"{v['expected']}: {v['reason']}"] += 1
    for e in judgement["stale"]:
        lines.append(f"STALE expectation ({e.outcome}, {e.reason}) matches no test: {list(e.patterns)}")
    table = ["", f"{'directory':48} {'passed':>7} {'unexpected':>10}  expected fail / skip by reason"]
    for d, c in sorted(counts.items()):
        expected = ", ".join(f"{k} {n}" for k, n in sorted(c.items()) if ":" in k)
        table.append(f"{d:48} {c['passed']:>7} {c['unexpected']:>10}  {expected or '-'}")
    summary = {d: dict(c) for d, c in sorted(counts.items())}
    return "\n".join(lines + table), summary


def run_pytest(
    source: Path,
    paths: list[str],
    timeout: int,
    hub_cache: Path,
    workers: int = 1,
    global_cleanup: bool = True,
    deselected: tuple[str, ...] = (),
    lift_cuda_gates: tuple[str, ...] = (),
    host_kv_cache_mb: int | None = None,
) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k not in DROP_ENV}
    if host_kv_cache_mb is not None:  # otherwise the platform's own default
        env["VLLM_ASCEND_HOST_KV_CACHE_MB"] = str(host_kv_cache_mb)
    if not global_cleanup:
        env["ASCEND_SKIP_GLOBAL_CLEANUP"] = "1"  # read by the ascend_outcomes plugin
    if lift_cuda_gates:
        env["ASCEND_LIFT_CUDA_GATES"] = os.pathsep.join(lift_cuda_gates)  # (the plugin too)
    with tempfile.TemporaryDirectory() as tmp:
        outcomes_file = Path(tmp) / "outcomes.jsonl"
        env.update(
            VLLM_ASCEND_EMULATE="1",
            HF_HUB_CACHE=str(hub_cache),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            HF_HOME=str(Path(tmp) / "hf-home"),
            ASCEND_OUTCOMES=str(outcomes_file),
            PYTHONPATH=str(HERE / "plugin"),
        )
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "ascend_outcomes",
            "-p",
            "no:cacheprovider",
            # pytest's hooks for exceptions raised in __del__ and in threads format the
            # traceback with the traceback module, which on Python 3.11 calls ast.parse; a
            # garbage collection inside pytest's own ast.parse (failure reports) then nests
            # two parses and CPython 3.11.7 aborts the worker ("AST constructor recursion
            # depth mismatch"). Without them Python's own hooks print those exceptions.
            "-p",
            "no:unraisableexception",
            "-p",
            "no:threadexception",
            "-q",
            "--continue-on-collection-errors",
            f"--timeout={timeout}",
            "-o",
            "addopts=",
            "-rN",
            # upstream's pyproject leaves it unset; pytest-asyncio warns in every process
            "-o",
            "asyncio_default_fixture_loop_scope=function",
            "--disable-warnings",
            *(["-n", str(workers)] if workers > 1 else []),
            *(f"--deselect={test}" for test in deselected),
            *paths,
        ]
        code = subprocess.run(cmd, cwd=source, env=env, check=False).returncode
        if not outcomes_file.exists():
            raise SystemExit("error: upstream's pytest run ended without results (see its output above)")
        if code not in (0, 1):  # 2 interrupted, 3 internal error, 4 usage, 5 nothing collected
            raise SystemExit(
                f"error: upstream's pytest run did not complete (exit code {code}; see its output above)"
            )
        return {r["test"]: r for r in map(json.loads, outcomes_file.read_text().splitlines())}


def _run_file(outcomes: Path) -> Path:
    """Beside a kept outcomes file: what ran (paths), its wall time and workers."""
    return outcomes.with_name(outcomes.name + ".run.json")


def read_outcomes(path: Path) -> tuple[dict[str, dict], dict]:
    """The outcomes a run kept with ``--outcomes``, and what ran."""
    outcomes = {r["test"]: r for r in map(json.loads, path.read_text().splitlines())}
    return outcomes, json.loads(_run_file(path).read_text())


@dataclass(frozen=True)
class Part:
    """One pytest run of a selection: a selection's own paths, or one of its ``parts``
    (another selection run after it with that selection's own settings)."""

    name: str
    settings: dict
    paths: list[str]
    deselected: tuple[str, ...]


def plan_parts(
    name: str,
    selections: dict,
    expectations: list[Expectation],
    source: Path,
    patch_set_dir: Path,
    given: list[str] | None = None,
) -> list[Part]:
    """The runs a selection makes: its own paths, then each selection it names in
    ``parts`` (one level: a part has no parts). Given PATHs run in the part whose paths
    cover them, the others in the selection's own run, and nothing is deselected."""
    names = [name, *selections[name].get("parts", ())]
    for part in names[1:]:
        if part not in selections:
            raise SystemExit(f"error: selection {name!r}: parts names no selection {part!r}")
        if selections[part].get("parts"):
            raise SystemExit(f"error: selection {name!r}: its part {part!r} has parts of its own")
    planned = []
    for part in names:
        paths, added = selection_paths(part, selections, source, patch_set_dir)
        for file, modules in added.items():
            print(f"selection {part}: + {file} (imports {', '.join(modules)})")
        planned.append((part, paths))
    if given:
        owner = {
            path: next((part for part, paths in planned[1:] if _selected(path, paths)), name)
            for path in given
        }
        planned = [(part, [path for path in given if owner[path] == part]) for part, _ in planned]
        planned = [(part, paths) for part, paths in planned if paths]
    runs = []
    for part, paths in planned:
        deselected = () if given else deselected_tests(part, selections[part], expectations)
        for test in deselected:
            print(f"selection {part}: - {test} (deselected; it runs in wider selections)")
        runs.append(Part(part, selections[part], paths, deselected))
    return runs


def run_part(part: Part, source: Path, timeout: int, hub_cache: Path, workers: int) -> dict[str, dict]:
    global_cleanup = part.settings.get("global-cleanup", True)
    if not global_cleanup:
        print(f"selection {part.name}: upstream's per-test global clean-up is skipped")
    lifted = tuple(part.settings.get("lift-cuda-gates", ()))
    for file in lifted:
        print(f"selection {part.name}: {file} imported past its CUDA gate")
    return run_pytest(
        source,
        part.paths,
        timeout,
        hub_cache,
        workers=workers,
        global_cleanup=global_cleanup,
        deselected=part.deselected,
        lift_cuda_gates=lifted,
        host_kv_cache_mb=part.settings.get("host-kv-cache-mb"),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, required=True, help="upstream test tree (from the pinned sdist)")
    p.add_argument("--selection", default="full", help="named selection in the expectations (default: full)")
    p.add_argument(
        "--expectations",
        type=Path,
        default=default_expectations(),
        help="expectations file (default: the default patch set's upstream-expectations.toml)",
    )
    p.add_argument("--timeout", type=int, default=180, help="per-test timeout in seconds")
    p.add_argument(
        "--cache", type=Path, default=Path(".work/upstream"), help="where the offline hub is built"
    )
    p.add_argument("--summary", type=Path, help="write per-directory counts as JSON here")
    p.add_argument("--workers", type=int, help="pytest-xdist worker processes (default: the selection's)")
    p.add_argument(
        "--outcomes", type=Path, help="keep every test's outcome, message and seconds (JSON lines) here"
    )
    p.add_argument(
        "--record",
        action="store_true",
        help="keep this whole selection's counts in the patch set and write them into "
        "docs/conformance.md (not with PATHs)",
    )
    p.add_argument(
        "--rejudge",
        type=Path,
        metavar="OUTCOMES",
        help="run nothing: judge the outcomes an earlier run kept with --outcomes against the "
        "expectations as they are now (after an entry was added, say); --record works too",
    )
    p.add_argument(
        "paths", nargs="*", help="test paths relative to the upstream tree (default: the selection)"
    )
    args = p.parse_args(argv)

    reasons, selections, expectations = load_expectations(args.expectations)
    if args.selection not in selections:
        p.error(
            f"no selection {args.selection!r} in {args.expectations}; it has: {', '.join(sorted(selections))}"
        )
    if args.record and args.paths:
        p.error("--record keeps the counts of a whole selection; give no PATHs")
    source = args.source.resolve()
    parts = plan_parts(args.selection, selections, expectations, source, args.expectations.parent, args.paths)
    paths = [path for part in parts for path in part.paths]
    deselected = tuple(test for part in parts for test in part.deselected)
    if args.rejudge:
        outcomes, run = read_outcomes(args.rejudge)
        if run.get("paths") != paths:
            p.error(f"{args.rejudge} was a run of other paths than this selection's now")
        seconds, workers = run["seconds"], run["workers"]
    else:
        hub_cache = ensure_hub(args.cache.resolve())
        outcomes, timings = {}, []
        for part in parts:
            workers = args.workers or part.settings.get("workers", 1)
            started = time.monotonic()
            outcomes |= run_part(part, source, args.timeout, hub_cache, workers)
            timings.append(
                {"selection": part.name, "seconds": round(time.monotonic() - started), "workers": workers}
            )
            if args.outcomes:  # after each part: a later part's crash loses only its own
                args.outcomes.write_text("".join(json.dumps(r) + "\n" for r in outcomes.values()))
        seconds = sum(t["seconds"] for t in timings)
        workers = timings[0]["workers"] if len(timings) == 1 else timings
        if args.outcomes:
            _run_file(args.outcomes).write_text(
                json.dumps({"paths": paths, "seconds": seconds, "workers": workers}) + "\n"
            )
    judgement = judge(outcomes, expectations, paths, deselected)
    text, summary = report(judgement, reasons)
    print(text)
    unexpected = sum(not v["ok"] for v in judgement["verdicts"].values()) + len(judgement["stale"])
    print(f"\nupstream tests: {len(outcomes)} results in {seconds:.0f} s, {unexpected} unexpected")
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    if args.record:
        record = {
            "selection": args.selection,
            "results": len(outcomes),
            "seconds": round(seconds),
            "workers": workers,
            "wheel": f"vllm-{importlib.metadata.version('vllm')}",
            "directories": summary,
        }
        print(f"recorded: {record_run(args.expectations.parent, record)} and docs/conformance.md")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
