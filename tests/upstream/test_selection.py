"""The selection gate (test files importing a patched module join the selection) and the
counts the doc shows (generated from recorded summaries, never typed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.upstream.counts import check_doc, record_run, render
from tests.upstream.imports import importers
from tests.upstream.run import default_expectations, selection_paths

PATCH_SET = default_expectations().parent


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


UPSTREAM_TESTS = {
    "tests/__init__.py": "",
    "tests/v1/core/utils.py": "from vllm.v1.core.sched.scheduler import Scheduler\n",
    "tests/v1/core/test_direct.py": "from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes\n",
    "tests/v1/core/test_from_package.py": "from vllm.v1.core import kv_cache_utils\n",
    "tests/v1/core/test_helper.py": "def test_x():\n    from tests.v1.core.utils import Scheduler\n",
    "tests/v1/core/test_unrelated.py": "import vllm\nfrom vllm.platforms import current_platform\n",
    "tests/v1/core/test_broken.py": "def (:\n",
    "tests/v1/worker/test_other_dir.py": "import vllm.v1.core.kv_cache_utils as k\n",
}
MODULES = {"vllm.v1.core.kv_cache_utils", "vllm.v1.core.sched.scheduler"}


def test_importers_are_found_directly_and_through_test_helpers(tmp_path):
    source = _write(tmp_path, UPSTREAM_TESTS)
    found = importers(source, ["tests/v1/core"], MODULES)
    assert found == {
        "tests/v1/core/test_direct.py": ["vllm.v1.core.kv_cache_utils"],
        "tests/v1/core/test_from_package.py": ["vllm.v1.core.kv_cache_utils"],
        "tests/v1/core/test_helper.py": ["vllm.v1.core.sched.scheduler"],
    }


def test_a_selection_gains_the_importers_within_another(tmp_path):
    source = _write(tmp_path, UPSTREAM_TESTS)
    selections = {
        "fast": {"paths": ["tests/v1/core/test_direct.py"], "importers-within": "full"},
        "full": {"paths": ["tests/v1/core", "tests/v1/worker"]},
    }
    paths, added = selection_paths("fast", selections, source, PATCH_SET)
    # the committed patch set changes both modules; test_direct.py was listed already
    assert paths == [
        "tests/v1/core/test_direct.py",
        "tests/v1/core/test_from_package.py",
        "tests/v1/core/test_helper.py",
        "tests/v1/worker/test_other_dir.py",
    ]
    assert set(added) == set(paths[1:])
    assert selection_paths("full", selections, source, PATCH_SET) == (selections["full"]["paths"], {})


def test_a_selection_path_upstream_no_longer_has_is_named(tmp_path):
    source = _write(tmp_path, UPSTREAM_TESTS)
    selections = {"fast": {"paths": ["tests/v1/core/test_direct.py", "tests/v1/core/test_gone.py"]}}
    with pytest.raises(SystemExit, match=r"do not have: tests/v1/core/test_gone.py; remove them"):
        selection_paths("fast", selections, source, PATCH_SET)


def test_the_committed_fast_selection_takes_the_importers_of_the_full_one():
    from tests.upstream.run import load_expectations

    _reasons, selections, _ = load_expectations(default_expectations())
    assert selections["fast"].get("importers-within") == "full"


RECORD = {
    "selection": "fast",
    "results": 7,
    "seconds": 150,
    "workers": 2,
    "wheel": "vllm-1.0+ascend.1",
    "directories": {
        "tests/v1/core": {"passed": 4, "fail: cuda": 1, "fail: real-model": 1},
        "tests/v1/worker": {"passed": 0, "unexpected": 1},
    },
}


def test_the_doc_block_is_generated_from_the_recorded_summary(tmp_path):
    patch_set = tmp_path / "patches" / "x-1.0"
    patch_set.mkdir(parents=True)
    doc = tmp_path / "conformance.md"
    doc.write_text(
        "# Counts\n\n<!-- counts:fast -->\nold numbers typed by hand\n<!-- /counts:fast -->\n\nafter\n"
    )
    assert check_doc(patch_set, doc) and "no recorded summary" in check_doc(patch_set, doc)[0]
    record_run(patch_set, RECORD, doc)
    assert json.loads((patch_set / "upstream-counts" / "fast.json").read_text()) == RECORD
    text = doc.read_text()
    assert render(RECORD) in text and "old numbers" not in text and text.endswith("after\n")
    assert "| `tests/v1/core` | 4 | fail: cuda 1, real-model 1 | 0 |" in text
    assert "| **all** | **4** | **2** | **1** |" in text and "7 results in 2.5 minutes" in text
    assert check_doc(patch_set, doc) == []
    doc.write_text(text.replace("| 4 |", "| 5 |"))
    [problem] = check_doc(patch_set, doc)
    assert "differ" in problem and "--record" in problem


def test_a_record_needs_its_block(tmp_path):
    doc = tmp_path / "conformance.md"
    doc.write_text("no blocks\n")
    with pytest.raises(SystemExit, match="no <!-- counts:fast --> block"):
        record_run(tmp_path, RECORD, doc)


def test_the_committed_doc_matches_the_recorded_counts():
    assert check_doc(PATCH_SET) == []


def test_a_kept_run_is_judged_again_against_edited_expectations(tmp_path):
    from tests.upstream.run import main

    source = _write(tmp_path / "src", {"tests/a/test_x.py": "def test_ok(): pass\n"})
    outcomes = tmp_path / "o.jsonl"
    outcomes.write_text(
        '{"test": "tests/a/test_x.py::test_ok", "outcome": "passed", "message": ""}\n'
        '{"test": "tests/a/test_x.py::test_pcp", "outcome": "failed", "message": "x"}\n'
    )
    (tmp_path / "o.jsonl.run.json").write_text('{"paths": ["tests/a"], "seconds": 60, "workers": 1}\n')
    expectations = tmp_path / "e.toml"
    head = '[reasons]\ncuda = "x"\n[selections.s]\npaths = ["tests/a"]\n'
    expectations.write_text(head)
    args = [
        "--source",
        str(source),
        "--selection",
        "s",
        "--expectations",
        str(expectations),
        "--rejudge",
        str(outcomes),
    ]
    assert main(args) == 1
    expectations.write_text(
        head + '[[expect]]\ntests = ["tests/a/test_x.py::test_pcp"]\noutcome = "fail"\nreason = "cuda"\n'
    )
    assert main(args) == 0


GATED = {
    "pyproject.toml": "[tool.pytest.ini_options]\n",
    "tests/a/test_plain.py": "def test_ok():\n    pass\n",
    "tests/a/test_gated.py": (
        "import pytest\n"
        "from vllm.platforms import current_platform\n"
        "if not current_platform.is_cuda_alike():\n"
        "    pytest.skip('V1 currently only supported on CUDA.', allow_module_level=True)\n"
        "def test_runs_on_the_platform_as_it_is():\n"
        "    assert not current_platform.is_cuda() and not current_platform.is_cuda_alike()\n"
    ),
}


def test_a_lifted_cuda_gate_lets_a_file_import_and_its_tests_run_on_the_platform(tmp_path):
    """A selection's ``lift-cuda-gates``: the file's module-level CUDA gate passes (the
    platform answers "CUDA" while it is imported), and its tests then see the platform as
    it is; without it, the file is skipped as upstream skips it."""
    from tests.upstream.run import run_pytest

    source = _write(tmp_path / "src", GATED)
    test = "tests/a/test_gated.py::test_runs_on_the_platform_as_it_is"
    gated = run_pytest(source, ["tests/a"], 120, tmp_path / "hub")
    assert test not in gated and gated["tests/a/test_plain.py::test_ok"]["outcome"] == "passed", gated
    lifted = run_pytest(
        source, ["tests/a"], 120, tmp_path / "hub", lift_cuda_gates=("tests/a/test_gated.py",)
    )
    assert lifted[test]["outcome"] == "passed", lifted


def test_a_selection_runs_its_parts_with_their_own_settings(tmp_path):
    """``parts``: the wider selection runs its own paths, then each part as that part
    runs alone (here: a CUDA gate lifted only in the part); given PATHs go to the part
    whose paths cover them."""
    from tests.upstream.run import plan_parts, run_part

    source = _write(tmp_path / "src", {**GATED, "tests/b/test_gated.py": GATED["tests/a/test_gated.py"]})
    selections = {
        "wide": {"paths": ["tests/a"], "parts": ["engine"]},
        "engine": {"paths": ["tests/b"], "lift-cuda-gates": ["tests/b/test_gated.py"]},
    }
    parts = plan_parts("wide", selections, [], source, PATCH_SET)
    assert [(p.name, p.paths) for p in parts] == [("wide", ["tests/a"]), ("engine", ["tests/b"])]
    outcomes = {}
    for part in parts:
        outcomes |= run_part(part, source, 120, tmp_path / "hub", workers=1)
    assert outcomes["tests/b/test_gated.py::test_runs_on_the_platform_as_it_is"]["outcome"] == "passed"
    assert "tests/a/test_gated.py::test_runs_on_the_platform_as_it_is" not in outcomes  # gate kept
    assert outcomes["tests/a/test_plain.py::test_ok"]["outcome"] == "passed"

    given = plan_parts("wide", selections, [], source, PATCH_SET, ["tests/b/test_gated.py", "tests/a"])
    assert [(p.name, p.paths) for p in given] == [
        ("wide", ["tests/a"]),
        ("engine", ["tests/b/test_gated.py"]),
    ]
    with pytest.raises(SystemExit, match="has parts of its own"):
        plan_parts(
            "wide", {**selections, "engine": {"paths": ["tests/b"], "parts": ["wide"]}}, [], source, PATCH_SET
        )
    with pytest.raises(SystemExit, match="parts names no selection 'gone'"):
        plan_parts("wide", {"wide": {"paths": ["tests/a"], "parts": ["gone"]}}, [], source, PATCH_SET)


def test_the_committed_full_selection_runs_the_serving_one_as_a_part():
    from tests.upstream.run import load_expectations

    _reasons, selections, _ = load_expectations(default_expectations())
    assert selections["full"].get("parts") == ["serving"]
