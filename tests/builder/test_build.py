"""The build pipeline on synthetic upstreams: output, reproducibility, offsets, provenance."""

from __future__ import annotations

import json
import zipfile

from ascend_builder.gitutil import commit_all, git
from ascend_builder.patchset import sha256_file
from ascend_builder.pipeline import build_distribution
from ascend_builder.progress import Silent

from .synthetic import Project, core_module, make_patch, make_sdist, upstream_files


def test_build_applies_patches_overlay_and_stamps(project: Project):
    wheel = build_distribution(project.inputs(), Silent())
    assert wheel.name == "fakeup-1.0+ascend.3-py3-none-any.whl"
    assert [p.name for p in project.dist_dir.iterdir()] == [wheel.name]
    with zipfile.ZipFile(wheel) as zf:
        core = zf.read("fakeup/core.py").decode()
        assert "VALUE_30 = 'patched'" in core and "VALUE_29 = 29" in core
        assert zf.read("fakeup/ascend/__init__.py") == b"ADDED = True\n"
        prov = json.loads(zf.read("fakeup/ascend/provenance.json"))
    assert prov["version"] == "1.0+ascend.3"
    assert prov["upstream"] == {
        "name": "fakeup",
        "version": "1.0",
        "sdist_sha256": sha256_file(project.sdist),
    }
    [entry] = prov["patches"]
    assert entry["sha256"] == sha256_file(project.patch_set_dir / entry["name"])
    assert entry["upstream_status"] == "Pending"


def test_two_builds_are_byte_identical(project: Project, tmp_path):
    first = build_distribution(project.inputs(tmp_path / "d1"), Silent())
    # The second build starts from the warm pristine cache, at another wall-clock time.
    second = build_distribution(project.inputs(tmp_path / "d2"), Silent())
    assert first.name == second.name
    assert first.read_bytes() == second.read_bytes()


def test_provenance_names_the_builder_revision(project: Project):
    git("init", "-q", cwd=project.root)
    rev = commit_all(project.root, "builder", 1_700_000_000)
    wheel = build_distribution(project.inputs(), Silent())
    with zipfile.ZipFile(wheel) as zf:
        prov = json.loads(zf.read("fakeup/ascend/provenance.json"))
    assert prov["builder"]["revision"] == rev
    (project.root / "pyproject.toml").write_text((project.root / "pyproject.toml").read_text() + "# edit\n")
    wheel = build_distribution(project.inputs(), Silent())
    with zipfile.ZipFile(wheel) as zf:
        prov = json.loads(zf.read("fakeup/ascend/provenance.json"))
    assert prov["builder"]["revision"] == rev + "-dirty"


def test_offsets_are_reported(tmp_path):
    """A patch made against an older layout applies with an offset, which is reported."""
    shifted = upstream_files(core_module(prefix=["# added upstream"] * 4))
    proj = Project(root=tmp_path / "repo")
    proj.sdist = make_sdist(tmp_path / "sdists", "1.0", shifted)
    patch = make_patch(
        tmp_path,
        upstream_files(),
        {"fakeup/core.py": core_module({30: "VALUE_30 = 'patched'"})},
        "core: patch 30",
    )
    proj.write([patch])
    notes: list[str] = []

    class Recorder(Silent):
        def note(self, message: str) -> None:
            notes.append(message)

    wheel = build_distribution(proj.inputs(), Recorder())
    with zipfile.ZipFile(wheel) as zf:
        assert "VALUE_30 = 'patched'" in zf.read("fakeup/core.py").decode()
    [line] = [n for n in notes if "applied with offsets" in n]
    assert patch.name in line and "fakeup/core.py hunk #1" in line and "(offset +4)" in line


def test_cli_prints_progress_per_step(project: Project):
    result = project.cli("build")
    assert result.returncode == 0, result.stderr
    for step in (
        "[1/7] pin",
        "[2/7] fetch",
        "[3/7] pristine",
        "[4/7] apply",
        "[5/7] overlay",
        "[6/7] stamp",
        "[7/7] wheel",
    ):
        assert step in result.stderr
    assert (project.dist_dir / "fakeup-1.0+ascend.3-py3-none-any.whl").is_file()


def test_declared_replacement_is_allowed(tmp_path):
    files = upstream_files()
    proj = Project(root=tmp_path / "repo", overlay={"fakeup/core.py": "REPLACED = 1\n"})
    proj.sdist = make_sdist(tmp_path / "sdists", "1.0", files)
    import hashlib

    upstream_sha = hashlib.sha256(files["fakeup/core.py"].encode()).hexdigest()
    proj.write(
        [],
        replacements=(
            f'\n[[overlay-replace]]\npath = "fakeup/core.py"\nupstream-sha256 = "{upstream_sha}"\n'
            'reason = "test"\n'
        ),
    )
    wheel = build_distribution(proj.inputs(), Silent())
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read("fakeup/core.py") == b"REPLACED = 1\n"


def test_keep_work_keeps_the_work_directory_after_a_successful_build(project: Project):
    from ascend_builder.pipeline import BuildInputs

    inputs = BuildInputs(**{**project.inputs().__dict__, "keep_work": True})
    build_distribution(inputs, Silent())
    [kept] = (project.root / ".work").glob("build-*")
    assert (kept / "tree" / "fakeup" / "core.py").is_file() and (kept / "wheel-build.log").is_file()


def test_patched_modules_come_from_the_patches(project: Project):
    from ascend_builder.upstream_tests import patched_modules

    [patch] = project.patch_set_dir.glob("*.patch")
    assert patched_modules(project.patch_set_dir) == {"fakeup.core": [patch.name]}


def test_files_the_upstream_gitignore_names_still_ship(tmp_path):
    """vLLM 0.33's .gitignore has ``*_hip*`` and its sdist ships ``rdna3_hip.py``: the pristine
    commit must hold the whole release, not what the release's .gitignore lets git see."""
    files = upstream_files() | {".gitignore": "*_hip*\n*.so\n", "fakeup/kernel_hip.py": "HIP = 1\n"}
    proj = Project(root=tmp_path / "repo")
    proj.sdist = make_sdist(tmp_path / "sdists", "1.0", files)
    proj.write(
        [make_patch(tmp_path, files, {"fakeup/core.py": core_module({30: "VALUE_30 = 'x'"})}, "core: x")]
    )
    wheel = build_distribution(proj.inputs(), Silent())
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read("fakeup/kernel_hip.py") == b"HIP = 1\n"
