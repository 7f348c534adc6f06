"""Each bad input ends with one clear line, a non-zero exit, and nothing new in dist/."""

from __future__ import annotations

import hashlib

import pytest

from .synthetic import Project, core_module, make_patch, make_sdist, upstream_files


def assert_refused(proj: Project, *needles: str) -> str:
    before = sorted(p.name for p in proj.dist_dir.iterdir()) if proj.dist_dir.exists() else []
    result = proj.cli("build")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    line = errors[0]
    for needle in needles:
        assert needle in line, line
    after = sorted(p.name for p in proj.dist_dir.iterdir()) if proj.dist_dir.exists() else []
    assert after == before, "a failed build must leave dist/ untouched"
    assert not list((proj.root / ".work").glob("build-*")), "work directory left behind"
    return line


def test_sdist_hash_mismatch(project: Project):
    project.write(list(project.patch_set_dir.glob("*.patch")), sha256="0" * 64)
    line = assert_refused(project, "sha256 mismatch", str(project.sdist), "0" * 64)
    assert "expected" in line


def test_hash_is_checked_before_unpacking(tmp_path):
    """A tampered sdist whose bytes would unpack fine is still refused, and never unpacked."""
    proj = Project(root=tmp_path / "repo")
    good = make_sdist(tmp_path / "good", "1.0", upstream_files())
    proj.sdist = make_sdist(tmp_path / "evil", "1.0", upstream_files(core_module({1: "EVIL = 1"})))
    proj.write([], sha256=hashlib.sha256(good.read_bytes()).hexdigest())
    assert_refused(proj, "sha256 mismatch")
    assert not (proj.cache / "pristine").exists()


def test_patch_needing_fuzz_names_patch_and_hunk(tmp_path):
    """Upstream changed a context line of the second hunk: git could fuzz it; we refuse."""
    base = upstream_files()
    changed_upstream = upstream_files(core_module({41: "VALUE_41 = 'moved on'"}))
    proj = Project(root=tmp_path / "repo")
    proj.sdist = make_sdist(tmp_path / "sdists", "1.0", changed_upstream)
    patch = make_patch(
        tmp_path,
        base,
        {"fakeup/core.py": core_module({10: "VALUE_10 = 'a'", 40: "VALUE_40 = 'b'"})},
        "core: two hunks",
    )
    proj.write([patch])
    line = assert_refused(proj, patch.name, "hunk #2", "@@ -37,7 +37,7 @@", "fakeup/core.py", "fuzz")
    assert "nox -s tree" in line


def test_patch_for_missing_file(tmp_path):
    base = upstream_files()
    proj = Project(root=tmp_path / "repo")
    reduced = dict(base)
    del reduced["fakeup/core.py"]
    proj.sdist = make_sdist(tmp_path / "sdists", "1.0", reduced)
    patch = make_patch(tmp_path, base, {"fakeup/core.py": core_module({5: "X = 1"})}, "core: edit")
    proj.write([patch])
    assert_refused(proj, patch.name, "does not apply", "fakeup/core.py")


def test_overlay_clobbering_an_undeclared_upstream_file(project: Project):
    project.overlay = {"fakeup/core.py": "CLOBBER = 1\n"}
    project.write(list(project.patch_set_dir.glob("*.patch")))
    assert_refused(project, "overlay/fakeup/core.py", "would overwrite", "[[overlay-replace]]")


def test_overlay_replacement_with_stale_upstream_hash(project: Project):
    project.overlay = {"fakeup/__init__.py": "REPLACED = 1\n"}
    project.write(
        list(project.patch_set_dir.glob("*.patch")),
        replacements=(
            f'\n[[overlay-replace]]\npath = "fakeup/__init__.py"\nupstream-sha256 = "{"a" * 64}"\nreason = "t"\n'
        ),
    )
    assert_refused(project, "fakeup/__init__.py", "upstream changed", "a" * 64)


def test_series_entry_naming_a_missing_file(project: Project):
    series = project.patch_set_dir / "series"
    series.write_text(series.read_text() + "not-there.patch\n")
    assert_refused(project, "not-there.patch", "missing file")


@pytest.mark.parametrize(
    ("trailers", "needle"),
    [
        ("Upstream-Status: Pending", "missing required trailer 'Drop-When:'"),
        ("Drop-When: upstream has it", "missing required trailer 'Upstream-Status:'"),
        ("Upstream-Status: Maybe later\nDrop-When: x", "malformed 'Upstream-Status: Maybe later'"),
        ("Upstream-Status: Submitted soon\nDrop-When: x", "malformed 'Upstream-Status: Submitted soon'"),
    ],
)
def test_patch_with_bad_trailers(tmp_path, trailers, needle):
    base = upstream_files()
    proj = Project(root=tmp_path / "repo")
    proj.sdist = make_sdist(tmp_path / "sdists", "1.0", base)
    patch = make_patch(
        tmp_path, base, {"fakeup/core.py": core_module({5: "X = 1"})}, "core: edit", trailers=trailers
    )
    proj.write([patch])
    assert_refused(proj, patch.name, needle)


def test_patch_without_rationale(tmp_path):
    base = upstream_files()
    proj = Project(root=tmp_path / "repo")
    proj.sdist = make_sdist(tmp_path / "sdists", "1.0", base)
    patch = make_patch(tmp_path, base, {"fakeup/core.py": core_module({5: "X = 1"})}, "core: edit", body="")
    proj.write([patch])
    assert_refused(proj, patch.name, "no rationale")


def test_local_sdist_that_does_not_exist(project: Project, tmp_path):
    project.sdist = tmp_path / "nope.tar.gz"
    assert_refused(project, "nope.tar.gz", "does not exist")


def test_unknown_patch_set(project: Project):
    result = project.cli("--patch-set", "fakeup-9.9", "build")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: patch set 'fakeup-9.9' does not exist")


def test_failed_wheel_build_leaves_dist_untouched(tmp_path):
    files = upstream_files()
    files["setup.py"] = "raise SystemExit('upstream setup.py is broken')\n"
    proj = Project(root=tmp_path / "repo")
    proj.sdist = make_sdist(tmp_path / "sdists", "1.0", files)
    proj.write([])
    proj.dist_dir.mkdir(parents=True)
    (proj.dist_dir / "older.whl").write_text("keep me")
    result = proj.cli("build")
    assert result.returncode == 1
    assert "the wheel build failed" in result.stderr
    assert [p.name for p in proj.dist_dir.iterdir()] == ["older.whl"]
