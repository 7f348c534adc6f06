"""The conformance judge: what counts as expected, unexpected and stale."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.upstream.run import (
    Expectation,
    default_expectations,
    deselected_tests,
    judge,
    load_expectations,
    report,
)

FILE = "tests/v1/core/test_a.py"


def _outcomes(**tests: str) -> dict:
    return {
        f"{FILE}::{name}": {"outcome": outcome, "message": f"{name} {outcome}"}
        for name, outcome in tests.items()
    }


def _unexpected(judgement: dict) -> set[str]:
    return {t.split("::")[1] for t, v in judgement["verdicts"].items() if not v["ok"]}


EXPECT = [
    Expectation((f"{FILE}::test_cuda*",), "fail", "cuda", ""),
    Expectation((f"{FILE}::test_skipped",), "skip", "cuda", ""),
]


def test_listed_failures_and_skips_are_expected_and_others_must_pass():
    outcomes = _outcomes(test_ok="passed", test_cuda_1="failed", test_cuda_2="error", test_skipped="skipped")
    judgement = judge(outcomes, EXPECT, [FILE])
    assert not _unexpected(judgement) and not judgement["stale"]
    _text, summary = report(judgement, {"cuda": "needs CUDA"})
    assert summary["tests/v1/core"] == {"passed": 1, "fail: cuda": 2, "skip: cuda": 1}


def test_unexpected_failure_pass_and_skip_are_reported():
    outcomes = _outcomes(test_ok="failed", test_cuda_1="passed", test_skipped="passed", test_new="skipped")
    judgement = judge(outcomes, EXPECT, [FILE])
    assert _unexpected(judgement) == {"test_ok", "test_cuda_1", "test_skipped", "test_new"}
    text, _ = report(judgement, {})
    assert "UNEXPECTED passed (expected fail)" in text and "UNEXPECTED failed (expected pass)" in text


def test_an_expectation_that_matches_nothing_in_a_run_module_is_stale():
    judgement = judge(_outcomes(test_ok="passed"), EXPECT, [FILE])
    assert len(judgement["stale"]) == 2
    # ... but not when its module was not part of the selection.
    assert not judge(_outcomes(test_ok="passed"), EXPECT, ["tests/v1/other"])["stale"]
    # An entry for a file that is gone from a selected directory is stale too (a rebase
    # that renamed it), and a test-level selection covers only what it names.
    gone = [Expectation(("tests/v1/core/test_gone.py*",), "fail", "cuda", "")]
    assert judge(_outcomes(test_ok="passed"), gone, ["tests/v1/core"])["stale"] == gone
    assert not judge(_outcomes(test_ok="passed"), gone, ["tests/v1/core_extra"])["stale"]
    assert not judge(_outcomes(test_ok="passed"), EXPECT, [f"{FILE}::test_ok"])["stale"]


def test_a_deselected_test_must_be_listed_and_its_entry_is_not_stale():
    deselected = deselected_tests("fast", {"deselect": [f"{FILE}::test_skipped"]}, EXPECT)
    judgement = judge(_outcomes(test_ok="passed", test_cuda_1="failed"), EXPECT, [FILE], deselected)
    assert not judgement["stale"] and not _unexpected(judgement)
    # without the deselection the same run leaves the entry stale
    assert judge(_outcomes(test_ok="passed", test_cuda_1="failed"), EXPECT, [FILE])["stale"] == [EXPECT[1]]
    with pytest.raises(SystemExit, match="no \\[\\[expect\\]\\] entry lists"):
        deselected_tests("fast", {"deselect": [f"{FILE}::test_ok"]}, EXPECT)


def test_a_passing_test_is_deselected_only_with_why_and_only_if_no_entry_lists_it():
    blast = f"{FILE}::test_blast"
    why = {"test": blast, "why": "400 s in CI's fast run"}
    assert deselected_tests("fast", {"deselect-passing": [why]}, EXPECT) == (blast,)
    with pytest.raises(SystemExit, match="needs a test and why"):
        deselected_tests("fast", {"deselect-passing": [{"test": blast, "why": " "}]}, EXPECT)
    with pytest.raises(SystemExit, match="put it in deselect"):
        deselected_tests(
            "fast", {"deselect-passing": [{"test": f"{FILE}::test_skipped", "why": "x"}]}, EXPECT
        )


def test_the_committed_expectations_are_well_formed():
    reasons, selections, expectations = load_expectations(default_expectations())
    # the reasons are the ones docs/conformance.md explains, each in its table row
    doc = (Path(__file__).parents[2] / "docs" / "conformance.md").read_text()
    assert set(reasons) == set(re.findall(r"^\| `([a-z-]+)` \| [a-z]", doc, re.MULTILINE))
    assert {"cuda", "real-model", "upstream-bug", "not-offered"} <= set(reasons)
    assert {"fast", "full"} <= set(selections)
    assert all(e.reason in reasons for e in expectations)
    for name, selection in selections.items():
        deselected_tests(name, selection, expectations)  # each deselected test is explained


def test_a_reference_is_required_for_bugs_and_features_not_offered(tmp_path: Path):
    bad = tmp_path / "e.toml"
    bad.write_text(
        '[reasons]\nupstream-bug = "x"\n[selections]\nfast = []\n'
        '[[expect]]\ntests = ["a"]\noutcome = "fail"\nreason = "upstream-bug"\n'
    )
    with pytest.raises(ValueError, match="needs a note"):
        load_expectations(bad)


def test_brackets_in_node_ids_are_literal_and_star_spans_parameters():
    e = Expectation((f"{FILE}::test_x[cuda-*]", f"{FILE}::test_y[a]"), "skip", "cuda", "")
    assert e.matches(f"{FILE}::test_x[cuda-True]") and e.matches(f"{FILE}::test_y[a]")
    assert not e.matches(f"{FILE}::test_x[cpu-True]") and not e.matches(f"{FILE}::test_ya")


def test_a_selection_without_global_clean_up_marks_every_test(monkeypatch):
    from tests.upstream.plugin import ascend_outcomes as plugin

    class Item:
        def __init__(self):
            self.markers = []

        def add_marker(self, marker):
            self.markers.append(marker.name)

    items = [Item(), Item()]
    monkeypatch.delenv("ASCEND_SKIP_GLOBAL_CLEANUP", raising=False)
    plugin.pytest_collection_modifyitems(None, items)
    assert [i.markers for i in items] == [[], []]
    monkeypatch.setenv("ASCEND_SKIP_GLOBAL_CLEANUP", "1")
    plugin.pytest_collection_modifyitems(None, items)
    # upstream's conftest skips cleanup_dist_env_and_memory() for this marker
    assert [i.markers for i in items] == [["skip_global_cleanup"], ["skip_global_cleanup"]]
