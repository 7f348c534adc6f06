"""The pristine upstream tree: the verified sdist unpacked into a git repository.

The first build of an sdist unpacks it and commits it once ("pristine") with a
fixed identity and a date taken from the sdist itself; that repository is
cached by the sdist's sha256, and later builds clone it (seconds instead of
re-hashing ten thousand files).
"""

from __future__ import annotations

import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

from .errors import BuildError
from .gitutil import commit_all, git

PRISTINE_MESSAGE = "pristine {name} {version}\n\nUnpacked from {filename} (sha256 {sha256})."
_CACHE_LAYOUT = "v2"  # v2: ignored-by-.gitignore files committed too


def sdist_epoch(sdist: Path) -> int:
    """The newest member mtime of the sdist: a date fixed by the upstream release."""
    with tarfile.open(sdist, "r:gz") as tar:
        return int(max((m.mtime for m in tar.getmembers()), default=0))


def unpack_sdist(sdist: Path, dest: Path, top: str) -> Path:
    """Unpack ``sdist`` (already hash-verified) into ``dest``; return the ``top`` directory."""
    dest.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["tar", "--no-same-owner", "--no-same-permissions", "-xzf", str(sdist), "-C", str(dest)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise BuildError(f"could not unpack {sdist}: {result.stderr.strip()}")
    entries = [p.name for p in dest.iterdir()]
    if entries != [top]:
        raise BuildError(
            f"{sdist} does not unpack to a single directory {top}/ (found: {', '.join(sorted(entries))})"
        )
    return dest / top


def init_pristine(source: Path, message: str, date: int) -> str:
    """Make ``source`` a git repository whose single commit is the unpacked upstream."""
    git("init", "-q", cwd=source)
    return commit_all(source, message, date, force=True)


def pristine_repo(sdist: Path, name: str, version: str, sha256: str, cache: Path, note=print) -> Path:
    """A bare repository holding the pristine commit for this sdist (cached by sha256)."""
    target = cache / "pristine" / _CACHE_LAYOUT / f"{sha256}.git"
    cached = (target / "HEAD").is_file()
    if cached and git("rev-parse", "-q", "--verify", "HEAD", cwd=target, check=False).returncode == 0:
        note(f"pristine tree cached at {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="make-") as tmp:
        top = f"{name}-{version}"
        note(f"unpacking {sdist.name} and committing it as pristine (first build of this sdist)")
        source = unpack_sdist(sdist, Path(tmp) / "src", top)
        message = PRISTINE_MESSAGE.format(name=name, version=version, filename=sdist.name, sha256=sha256)
        init_pristine(source, message, sdist_epoch(sdist))
        bare = Path(tmp) / "bare.git"
        os.rename(source / ".git", bare)
        git("config", "core.bare", "true", cwd=bare)
        try:
            os.rename(bare, target)
        except OSError:
            if not (target / "HEAD").is_file():
                raise
    return target


def checkout_pristine(repo: Path, dest: Path) -> int:
    """Clone the cached pristine repository into ``dest``; return the pristine commit date."""
    git("clone", "-q", "--shared", "--branch", "main", str(repo), str(dest), cwd=repo.parent)
    return int(git("log", "-1", "--format=%ct", cwd=dest).stdout.strip())
