"""Patch lint, deterministic export, freshness, the maintainer work tree, and rebase reports."""

from __future__ import annotations

from pathlib import Path

from ascend_builder.export import export_commits, freshness_problems
from ascend_builder.gitutil import commit_all, git
from ascend_builder.patchfile import NAME_MAX, lint_patch, parse_patch, patch_file_name
from ascend_builder.patchset import lint_patch_set, load_patch_set
from ascend_builder.rebase import rebase_report
from ascend_builder.worktree import export_worktree, prepare_worktree

from .synthetic import Project, core_module, make_patch, make_sdist, upstream_files


def _silent(_message: str) -> None:
    pass


def test_unlisted_patch_file_is_a_lint_error(project: Project):
    stray = project.patch_set_dir / "stray.patch"
    stray.write_text("x")
    problems = lint_patch_set(load_patch_set(project.patch_set_dir))
    assert any("stray.patch is not listed" in p for p in problems)
    result = project.cli("patches", "check")
    assert result.returncode == 1 and "stray.patch is not listed" in result.stderr


def test_check_passes_on_a_fresh_patch_set(project: Project):
    result = project.cli("patches", "check")
    assert result.returncode == 0, result.stderr
    assert "byte-identically" in result.stderr


def test_check_catches_a_hand_edited_patch(project: Project):
    [patch] = project.patch_set_dir.glob("*.patch")
    text = patch.read_text()
    # Still applies (at an offset) and lints, but is not what `export` would write.
    assert "@@ -27,7 +27,7 @@" in text
    patch.write_text(text.replace("@@ -27,7 +27,7 @@", "@@ -25,7 +25,7 @@"))
    assert lint_patch_set(load_patch_set(project.patch_set_dir)) == []
    problems = freshness_problems(
        project.patch_set_dir, project.cache, project.root / ".work", project.sdist, _silent
    )
    assert len(problems) == 1 and patch.name in problems[0] and "byte-identical" in problems[0]


def _tree_with_commit(tmp_path: Path, name: str) -> tuple[Path, str]:
    repo = tmp_path / name
    repo.mkdir()
    for rel, text in upstream_files().items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git("init", "-q", cwd=repo)
    base = commit_all(repo, "base", 1_700_000_000)
    (repo / "fakeup/core.py").write_text(core_module({7: "VALUE_7 = 'seven'"}))
    (repo / "fakeup/new.py").write_text("NEW = 1\n")
    git("add", "-A", cwd=repo)
    git(
        "commit",
        "-q",
        "-m",
        "core: a change\n\nBecause.\n\nUpstream-Status: Pending\nDrop-When: x",
        cwd=repo,
        date=1_700_000_100,
    )
    return repo, base


def test_export_is_deterministic_whatever_the_user_config(tmp_path, monkeypatch):
    repo, base = _tree_with_commit(tmp_path, "one")
    first = export_commits(repo, base, tmp_path / "out1")
    # A maintainer's config that would change plain `git format-patch` output.
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text(
        "[core]\n\tabbrev = 7\n[diff]\n\talgorithm = histogram\n\tnoprefix = true\n"
        "[format]\n\tsignature = hello\n\tnumbered = true\n"
    )
    monkeypatch.setenv("HOME", str(home))
    second = export_commits(repo, base, tmp_path / "out2")
    assert first == second
    for name in first:
        assert (tmp_path / "out1" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes()
    text = (tmp_path / "out1" / first[0]).read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: [PATCH] core: a change" in text
    # Sanity: the user config really would have changed plain git output.
    plain = git(
        "format-patch",
        "--stdout",
        f"{base}..HEAD",
        cwd=repo,
        env={"GIT_CONFIG_GLOBAL": str(home / ".gitconfig")},
    ).stdout
    assert plain != text


def test_worktree_round_trip(project: Project, tmp_path):
    tree = prepare_worktree(
        project.patch_set_dir,
        project.root / "overlay",
        tmp_path / "work",
        project.cache,
        project.sdist,
        note=_silent,
    )
    # One commit per patch on top of the pristine tag.
    log = git("log", "--format=%s", "pristine..HEAD", cwd=tree).stdout.split("\n")
    assert log[0] == "core: patch value 30"
    # The overlay is linked, so edits in overlay/ are live in the tree.
    linked = tree / "fakeup" / "ascend"
    assert linked.is_symlink()
    (project.root / "overlay/fakeup/ascend/__init__.py").write_text("ADDED = 'edited'\n")
    assert (linked / "__init__.py").read_text() == "ADDED = 'edited'\n"
    assert git("status", "--porcelain", cwd=tree).stdout == ""
    # A maintainer adds a patch as a commit and exports.
    (tree / "fakeup/core.py").write_text(
        (tree / "fakeup/core.py").read_text().replace("VALUE_50 = 50", "VALUE_50 = 'fifty'")
    )
    git(
        "commit",
        "-q",
        "-a",
        "-m",
        "core: fifty\n\nA reason.\n\nUpstream-Status: Backport v1.1\nDrop-When: rebased onto 1.1",
        cwd=tree,
        date=1_700_000_200,
    )
    names = export_worktree(tree, project.patch_set_dir, note=_silent)
    assert len(names) == 2 and names[1].startswith("core-fifty")
    ps = load_patch_set(project.patch_set_dir)
    assert ps.series == names
    assert lint_patch_set(ps) == []
    assert (
        freshness_problems(
            project.patch_set_dir, project.cache, project.root / ".work", project.sdist, _silent
        )
        == []
    )


def test_worktree_refuses_to_clobber_existing(project: Project, tmp_path):
    import pytest

    from ascend_builder.errors import BuildError

    dest = tmp_path / "work"
    dest.mkdir()
    with pytest.raises(BuildError, match="already exists"):
        prepare_worktree(
            project.patch_set_dir, project.root / "overlay", dest, project.cache, project.sdist, note=_silent
        )


def test_export_refuses_uncommitted_changes(project: Project, tmp_path):
    import pytest

    from ascend_builder.errors import BuildError

    tree = prepare_worktree(
        project.patch_set_dir,
        project.root / "overlay",
        tmp_path / "work",
        project.cache,
        project.sdist,
        note=_silent,
    )
    (tree / "setup.py").write_text("# dirty\n")
    with pytest.raises(BuildError, match="uncommitted changes"):
        export_worktree(tree, project.patch_set_dir, note=_silent)


def _project_with_one_patch_per_edit(tmp_path, base: dict, edits: dict) -> Project:
    """A project pinned to release 1.0 of ``base`` with one patch ``core: <kind>`` per edit."""
    patches = [
        make_patch(tmp_path, base, {"fakeup/core.py": core_module(change)}, f"core: {kind}")
        for kind, change in edits.items()
    ]
    proj = Project(root=tmp_path / "repo")
    proj.sdist = make_sdist(tmp_path / "old", "1.0", base)
    proj.write(patches)
    return proj


def test_rebase_report_classifies_every_patch(tmp_path):
    base = upstream_files()
    edit = {  # line number -> new text, one patch each
        "clean": {5: "VALUE_5 = 'clean'"},
        "offset": {20: "VALUE_20 = 'offset'"},
        "needs-3way": {35: "VALUE_35 = '3way'"},
        "conflict": {45: "VALUE_45 = 'ours'"},
        "already-upstream": {55: "VALUE_55 = 'upstreamed'"},
    }
    proj = _project_with_one_patch_per_edit(tmp_path, base, edit)
    # Version 2.0: lines inserted after line 10 shift later hunks; line 37 (context of
    # the 3way patch, two lines from its change) changed; line 45 changed differently;
    # the already-upstream change landed.
    lines = core_module(
        {37: "VALUE_37 = 'upstream'", 45: "VALUE_45 = 'theirs'", 55: "VALUE_55 = 'upstreamed'"}
    ).splitlines()
    lines[10:10] = ["# new upstream line"] * 3
    new_sdist = make_sdist(tmp_path / "new", "2.0", upstream_files("\n".join(lines) + "\n"))
    report = rebase_report(
        proj.patch_set_dir,
        proj.root / "overlay",
        "2.0",
        proj.cache,
        proj.root / ".work",
        _silent,
        target_sdist=new_sdist,
        pinned_sdist=proj.sdist,
    )
    assert [(p.patch, p.status) for p in report.patches] == [
        ("core-clean.patch", "clean"),
        ("core-offset.patch", "offset"),
        ("core-needs-3way.patch", "needs-3way"),
        ("core-conflict.patch", "conflict"),
        ("core-already-upstream.patch", "already-upstream"),
    ]
    assert "(offset +3)" in report.patches[1].detail
    # each row carries its patch's Drop-When, the condition a reviewer re-checks
    assert {p.drop_when for p in report.patches} == {"never, it is a test"}
    assert report.conflicts == 1
    # The command line writes the report and fails because one patch conflicts.
    result = proj.cli("rebase", "2.0", "--sdist", str(new_sdist), "--out", str(tmp_path / "rep"))
    assert result.returncode == 1
    assert "1 patch(es) conflict" in result.stderr
    md = (tmp_path / "rep" / "fakeup-1.0-to-2.0.md").read_text()
    assert (
        "| conflict |" in md
        and "| never, it is a test |" in md
        and "Summary: 1 clean, 1 offset, 1 needs-3way, 1 conflict, 1 already-upstream" in md
    )
    assert (tmp_path / "rep" / "fakeup-1.0-to-2.0.json").is_file()


def test_rebase_keeps_its_tree_as_the_new_version_s_work_tree(tmp_path):
    """`rebase --tree`: the new release tagged pristine, one commit per applied patch, the
    overlay linked; a conflicting patch resolved there by hand; exporting gives the new
    version's patch set, fresh against its own sdist."""
    from ascend_builder.patchset import sha256_file

    base = upstream_files()
    edits = {"clean": {5: "VALUE_5 = 'clean'"}, "conflict": {45: "VALUE_45 = 'ours'"}}
    proj = _project_with_one_patch_per_edit(tmp_path, base, edits)
    new_files = upstream_files(core_module({45: "VALUE_45 = 'theirs'"}))
    new_sdist = make_sdist(tmp_path / "new", "2.0", new_files)
    tree = tmp_path / "work-2.0"
    result = proj.cli(
        "rebase", "2.0", "--sdist", str(new_sdist), "--out", str(tmp_path / "rep"), "--tree", str(tree)
    )
    assert result.returncode == 1 and "1 patch(es) conflict" in result.stderr
    assert f"git am -3 {proj.patch_set_dir / 'core-conflict.patch'}" in result.stdout
    assert git("log", "--format=%s", "pristine..HEAD", cwd=tree).stdout.splitlines() == ["core: clean"]
    assert "2.0" in git("log", "-1", "--format=%s", "pristine", cwd=tree).stdout
    assert (tree / "fakeup" / "ascend").is_symlink()
    # the maintainer resolves the conflict in the tree, then pins and exports 2.0
    core = tree / "fakeup" / "core.py"
    core.write_text(core.read_text().replace("VALUE_45 = 'theirs'", "VALUE_45 = 'ours'"))
    message = "core: conflict\n\nResolved by hand.\n\nUpstream-Status: Pending\n"
    message += "Pending-Reason: a test patch, never sent upstream\nDrop-When: never, it is a test"
    git("commit", "-q", "-a", "-m", message, cwd=tree)
    new_set = proj.root / "patches" / "fakeup-2.0"
    new_set.mkdir()
    (new_set / "patchset.toml").write_text(
        f'[upstream]\nname = "fakeup"\nversion = "2.0"\nsdist-sha256 = "{sha256_file(new_sdist)}"\n'
    )
    assert export_worktree(tree, new_set, note=_silent) == ["core-clean.patch", "core-conflict.patch"]
    assert freshness_problems(new_set, proj.cache, proj.root / ".work", new_sdist, _silent) == []


def test_exported_names_come_from_subjects_without_numbers_or_diffstat(tmp_path):
    repo, base = _tree_with_commit(tmp_path, "named")
    [name] = export_commits(repo, base, tmp_path / "out")
    assert name == "core-a-change.patch" == patch_file_name("core: a change")
    text = (tmp_path / "out" / name).read_text()
    assert "\n---\n" not in text and "files changed" not in text  # no diffstat
    assert parse_patch(tmp_path / "out" / name).files == ["fakeup/core.py", "fakeup/new.py"]
    long = "setup: keep the Rust frontend out of empty-target wheels, with a very long tail of words"
    assert patch_file_name(long) == "setup-keep-the-rust-frontend-out-of-empty-target-wheels-with-a.patch"
    assert len(patch_file_name(long)) <= NAME_MAX + len(".patch")


def test_inserting_a_patch_renames_and_rewrites_no_other(project: Project, tmp_path):
    tree = prepare_worktree(
        project.patch_set_dir,
        project.root / "overlay",
        tmp_path / "work",
        project.cache,
        project.sdist,
        note=_silent,
    )
    (tree / "fakeup/core.py").write_text(
        (tree / "fakeup/core.py").read_text().replace("VALUE_50 = 50", "VALUE_50 = 'last'")
    )
    git(
        "commit",
        "-q",
        "-a",
        "-m",
        "core: last\n\nWhy.\n\nUpstream-Status: Pending [test]\nDrop-When: x",
        cwd=tree,
        date=1_700_000_200,
    )
    first = export_worktree(tree, project.patch_set_dir, note=_silent)
    before = {name: (project.patch_set_dir / name).read_bytes() for name in first}
    # A new patch (to another file) between the two: the history rebuilt with it inserted.
    git("checkout", "-q", "-b", "insert", "HEAD~1", cwd=tree)
    (tree / "fakeup/__init__.py").write_text("MIDDLE = 1\n")
    git(
        "commit",
        "-q",
        "-a",
        "-m",
        "core: middle\n\nWhy.\n\nUpstream-Status: Pending [test]\nDrop-When: x",
        cwd=tree,
        date=1_700_000_300,
    )
    git("cherry-pick", "main", cwd=tree, date=1_700_000_200)
    second = export_worktree(tree, project.patch_set_dir, note=_silent)
    assert second == [first[0], "core-middle.patch", first[1]]
    assert {name: (project.patch_set_dir / name).read_bytes() for name in first} == before
    assert load_patch_set(project.patch_set_dir).series == second


def test_two_commits_with_one_name_are_refused(tmp_path):
    import pytest

    from ascend_builder.errors import BuildError

    repo, base = _tree_with_commit(tmp_path, "dup")
    (repo / "fakeup/new.py").write_text("NEW = 2\n")
    git("commit", "-q", "-a", "-m", "core: a change!\n\nAgain.", cwd=repo, date=1_700_000_200)
    with pytest.raises(BuildError, match=r"two commits would both be exported as core-a-change\.patch"):
        export_commits(repo, base, tmp_path / "out")


def _patch_named(tmp_path: Path, subject: str, trailers: str, name: str | None = None) -> Path:
    patch = make_patch(
        tmp_path, upstream_files(), {"fakeup/core.py": core_module({5: "X = 1"})}, subject, trailers=trailers
    )
    if name is not None:
        patch = patch.rename(patch.with_name(name))
    return patch


DROP = "\nDrop-When: x"


def test_lint_names_come_from_subjects(tmp_path):
    ok = _patch_named(tmp_path, "core: edit", "Upstream-Status: Backport v2" + DROP)
    assert ok.name == "core-edit.patch" and lint_patch(parse_patch(ok)) == []
    numbered = _patch_named(
        tmp_path, "core: edit", "Upstream-Status: Backport v2" + DROP, "0001-core-edit.patch"
    )
    [problem] = lint_patch(parse_patch(numbered))
    assert "starts with a number" in problem and "series" in problem
    other = _patch_named(tmp_path, "core: edit", "Upstream-Status: Backport v2" + DROP, "core-tweak.patch")
    [problem] = lint_patch(parse_patch(other))
    assert "does not come from the subject" in problem and "expected core-edit.patch" in problem


def test_lint_refuses_two_patches_whose_subjects_give_one_name(tmp_path):
    proj = Project(root=tmp_path / "repo")
    proj.sdist = make_sdist(tmp_path / "sdists", "1.0", upstream_files())
    a = _patch_named(tmp_path / "a", "core: edit", "Upstream-Status: Backport v2" + DROP)
    b = _patch_named(tmp_path / "b", "core: edit!", "Upstream-Status: Backport v2" + DROP, "core-edit-.patch")
    proj.write([a, b])
    problems = lint_patch_set(load_patch_set(proj.patch_set_dir))
    assert any("both give the file name core-edit.patch" in p for p in problems), problems


def test_a_pending_patch_says_why_it_is_not_submitted(tmp_path):
    def problems(trailers: str) -> list[str]:
        return lint_patch(parse_patch(_patch_named(tmp_path, "core: edit", trailers + DROP)))

    [bare] = problems("Upstream-Status: Pending")
    assert "does not say why" in bare and "Pending [why]" in bare
    assert problems("Upstream-Status: Pending [the hook's form is not settled yet]") == []
    assert problems("Upstream-Status: Pending https://github.com/vllm-project/vllm/issues/1") == []
    assert problems("Upstream-Status: Pending\nPending-Reason: waits for the 0.33 refactor") == []
    [malformed] = problems("Upstream-Status: Pending soon")
    assert "malformed 'Upstream-Status: Pending soon'" in malformed
    [empty] = problems("Upstream-Status: Pending []")
    assert "malformed" in empty
