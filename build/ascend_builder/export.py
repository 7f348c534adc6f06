"""Deterministic export of patch commits, and the freshness check that relies on it."""

from __future__ import annotations

import filecmp
import shutil
import tempfile
from pathlib import Path

from .apply import apply_series
from .errors import BuildError
from .gitutil import git
from .patchset import SERIES_FILE, checked_patches, load_patch_set, read_series
from .pristine import checkout_pristine, pristine_repo
from .fetch import obtain_pinned_sdist

# Fixed options: the same commits always give the same bytes, whoever runs it.
FORMAT_PATCH = (
    "format-patch", "--zero-commit", "--no-signature", "--full-index", "--no-numbered",
    "--no-cover-letter", "--stat=72", "--no-renames", "--no-binary",
)
SERIES_HEADER = "# Applied in this order by `git am`. Written by `nox -s patches -- export`.\n"


def export_commits(repo: Path, base: str, dest: Path) -> list[str]:
    """Write ``base..HEAD`` of ``repo`` as numbered patch files into ``dest``; return the names."""
    dest.mkdir(parents=True, exist_ok=True)
    out = git(*FORMAT_PATCH, "-o", str(dest), f"{base}..HEAD", cwd=repo).stdout
    return [Path(line).name for line in out.splitlines() if line.strip()]


def write_series(directory: Path, names: list[str]) -> None:
    (directory / SERIES_FILE).write_text(SERIES_HEADER + "".join(n + "\n" for n in names))


def export_to_patch_set(repo: Path, base: str, patch_set_dir: Path) -> list[str]:
    """Replace the patch set's patches and series with the commits ``base..HEAD``."""
    with tempfile.TemporaryDirectory() as tmp:
        names = export_commits(repo, base, Path(tmp))
        for old in patch_set_dir.glob("*.patch"):
            old.unlink()
        for name in names:
            shutil.copyfile(Path(tmp) / name, patch_set_dir / name)
    write_series(patch_set_dir, names)
    return names


def freshness_problems(patch_set_dir: Path, cache: Path, work_root: Path, sdist: Path | None, note=print) -> list[str]:
    """Apply the series to pristine, re-export, and compare with the committed files."""
    patch_set = load_patch_set(patch_set_dir)
    patches = checked_patches(patch_set)
    pin = patch_set.pin
    sdist_path = obtain_pinned_sdist(pin, cache, sdist, note)
    repo = pristine_repo(sdist_path, pin.name, pin.version, pin.sdist_sha256, cache, note)
    work_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fresh-", dir=work_root) as tmp:
        tree = Path(tmp) / "tree"
        date = checkout_pristine(repo, tree)
        base = git("rev-parse", "HEAD", cwd=tree).stdout.strip()
        apply_series(tree, patches, date, note=lambda _m: None)
        exported = Path(tmp) / "exported"
        names = export_commits(tree, base, exported)
        problems = []
        series = read_series(patch_set_dir)
        if names != series:
            problems.append(
                f"series {series} would be re-exported as {names}; run `nox -s patches -- export`"
            )
        for name in names:
            committed = patch_set_dir / name
            if committed.is_file() and not filecmp.cmp(committed, exported / name, shallow=False):
                problems.append(
                    f"{name} is not byte-identical to its re-export (stale or hand-edited); "
                    "regenerate it with `nox -s tree` then `nox -s patches -- export`"
                )
        return problems


def require_fresh(patch_set_dir: Path, cache: Path, work_root: Path, sdist: Path | None, note=print) -> None:
    problems = freshness_problems(patch_set_dir, cache, work_root, sdist, note)
    if problems:
        raise BuildError(problems[0])
