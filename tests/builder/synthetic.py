"""Synthetic upstreams for builder tests: tiny sdists, patch sets and overlays in tmp dirs.

A synthetic upstream ``fakeup`` keeps the contract the builder relies on in vLLM:
an sdist ``<name>-<version>/`` whose setup.py takes its version from
``VLLM_VERSION_OVERRIDE`` and ships ``<name>/ascend/provenance.json``.
"""

from __future__ import annotations

import io
import itertools
import subprocess
import sys
import tarfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from ascend_builder.config import load_config
from ascend_builder.export import export_commits
from ascend_builder.gitutil import commit_all, git
from ascend_builder.patchset import sha256_file
from ascend_builder.pipeline import BuildInputs

NAME = "fakeup"
SETUP_PY = textwrap.dedent(
    """\
    import os
    from setuptools import find_packages, setup

    setup(
        name="fakeup",
        version=os.environ["VLLM_VERSION_OVERRIDE"],
        packages=find_packages(include=["fakeup*"]),
        package_data={"fakeup": ["ascend/provenance.json"]},
    )
    """
)
_PATCH_COUNTER = itertools.count()
PYPROJECT = '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'


def core_module(changes: dict[int, str] | None = None, prefix: list[str] | None = None) -> str:
    """A 60-line module; ``changes`` replaces numbered lines, ``prefix`` shifts them down."""
    lines = [f"VALUE_{i} = {i}" for i in range(1, 61)]
    for number, text in (changes or {}).items():
        lines[number - 1] = text
    return "\n".join((prefix or []) + lines) + "\n"


def upstream_files(core: str | None = None) -> dict[str, str]:
    return {
        "setup.py": SETUP_PY,
        "pyproject.toml": PYPROJECT,
        "fakeup/__init__.py": '"""A synthetic upstream."""\n',
        "fakeup/core.py": core if core is not None else core_module(),
    }


def make_sdist(directory: Path, version: str, files: dict[str, str], mtime: int = 1_700_000_000) -> Path:
    """A reproducible ``fakeup-<version>.tar.gz`` holding ``files`` under ``fakeup-<version>/``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{NAME}-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for rel in sorted(files):
            data = files[rel].encode()
            info = tarfile.TarInfo(f"{NAME}-{version}/{rel}")
            info.size, info.mtime, info.mode = len(data), mtime, 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


def make_patch(
    work: Path,
    base_files: dict[str, str],
    edits: dict[str, str],
    subject: str,
    body: str = "Why: a synthetic change for a builder test.",
    trailers: str = (
        "Upstream-Status: Pending\nPending-Reason: a test patch, never sent upstream\n"
        "Drop-When: never, it is a test"
    ),
) -> Path:
    """A ``git format-patch`` file changing ``base_files`` by ``edits`` (made by git itself)."""
    repo = work / f"patch-src-{next(_PATCH_COUNTER)}"
    repo.mkdir(parents=True)
    for rel, text in base_files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git("init", "-q", cwd=repo)
    base = commit_all(repo, "base", 1_700_000_000)
    for rel, text in edits.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    message = subject + ("\n\n" + body if body else "") + ("\n\n" + trailers if trailers else "")
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", message, cwd=repo, date=1_700_000_100)
    out = work / "made-patches" / repo.name
    [name] = export_commits(repo, base, out)
    return out / name


@dataclass
class Project:
    """A builder checkout in miniature: pyproject, patches/, overlay/, dist/, cache."""

    root: Path
    version: str = "1.0"
    sdist: Path | None = None
    build_number: int = 3
    overlay: dict[str, str] = field(default_factory=lambda: {"fakeup/ascend/__init__.py": "ADDED = True\n"})

    @property
    def patch_set_dir(self) -> Path:
        return self.root / "patches" / f"{NAME}-{self.version}"

    @property
    def dist_dir(self) -> Path:
        return self.root / "dist"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    def write(
        self,
        patches: list[Path],
        sha256: str | None = None,
        series: list[str] | None = None,
        replacements: str = "",
    ) -> None:
        self.patch_set_dir.mkdir(parents=True, exist_ok=True)
        (self.root / "pyproject.toml").write_text(
            f'[tool.vllm-ascend]\npatch-set = "{NAME}-{self.version}"\nbuild-number = {self.build_number}\n'
        )
        (self.patch_set_dir / "patchset.toml").write_text(
            f'[upstream]\nname = "{NAME}"\nversion = "{self.version}"\n'
            f'sdist-sha256 = "{sha256 or sha256_file(self.sdist)}"\n' + replacements
        )
        names = []
        for patch in patches:
            (self.patch_set_dir / patch.name).write_bytes(patch.read_bytes())
            names.append(patch.name)
        (self.patch_set_dir / "series").write_text("\n".join(series if series is not None else names) + "\n")
        for rel, text in self.overlay.items():
            (self.root / "overlay" / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.root / "overlay" / rel).write_text(text)

    def inputs(self, dist_dir: Path | None = None) -> BuildInputs:
        return BuildInputs.from_config(
            load_config(self.root), dist_dir=dist_dir, cache=self.cache, sdist=self.sdist
        )

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run the builder's command line against this project, as nox would."""
        env_path = str(Path(__file__).resolve().parents[2] / "build")
        import os

        env = dict(os.environ, PYTHONPATH=env_path, VLLM_ASCEND_BUILD_CACHE=str(self.cache))
        if self.sdist is not None:
            env["VLLM_ASCEND_SDIST"] = str(self.sdist)
        return subprocess.run(
            [sys.executable, "-m", "ascend_builder", "--root", str(self.root), *args],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
