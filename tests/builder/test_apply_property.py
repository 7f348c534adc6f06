"""Property: any set of line edits, made into a patch by git, applies to an upstream shifted
down by N lines with offset N reported for every hunk, and yields the edited text -- except
that a hunk anchored at the start of the file (it says line 1) must be refused, not fuzzed."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_builder.apply import apply_series
from ascend_builder.errors import BuildError
from ascend_builder.gitutil import commit_all, git
from ascend_builder.patchfile import parse_patch

from .synthetic import core_module, make_patch, upstream_files

edits = st.dictionaries(
    st.integers(1, 60), st.sampled_from(["X = 1", "Y = 'two'", "# gone", ""]), min_size=1, max_size=6
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=edits, shift=st.integers(0, 5))
def test_patch_applies_with_reported_offsets(changes, shift):
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        patch = make_patch(tmp_path, upstream_files(), {"fakeup/core.py": core_module(changes)}, "edit")
        info = parse_patch(patch)
        tree = tmp_path / "tree"
        tree.mkdir()
        shifted = upstream_files(core_module(prefix=["# upstream"] * shift))
        for rel, text in shifted.items():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_text(text)
        git("init", "-q", cwd=tree)
        commit_all(tree, "pristine", 1_700_000_000)
        anchored = [h for h in info.hunks if h.old_start == 1]
        if shift and anchored:
            with pytest.raises(BuildError, match=f"hunk #{anchored[0].number} "):
                apply_series(tree, [info], 1_700_000_000, note=lambda _m: None)
            return
        report = apply_series(tree, [info], 1_700_000_000, note=lambda _m: None)
        assert (tree / "fakeup/core.py").read_text() == core_module(changes, prefix=["# upstream"] * shift)
        offsets = report[patch.name]
        expected = [(h.number, shift) for h in info.hunks] if shift else []
        assert sorted((o.hunk, o.offset) for o in offsets) == expected
