"""Deterministic export of patch commits, and the freshness check that relies on it.

A patch file is named from its subject alone (``patchfile.patch_file_name``), with no
number and no diffstat: the ``series`` file is the only place that says the order, so
inserting or dropping a patch changes no other patch's name or bytes.
"""

from __future__ import annotations

import filecmp
import shutil
import tempfile
from pathlib import Path

from .apply import apply_series
from .errors import BuildError
from .gitutil import git
from .patched import patched_tree
from .patchfile import PatchInfo, parse_patch, patch_file_name
from .patchset import SERIES_FILE, checked_patches, load_patch_set, read_series

# Fixed options: the same commits always give the same bytes, whoever runs it. No
# diffstat (--no-stat): it repeats the diff and churns with unrelated whitespace.
FORMAT_PATCH = (
    "format-patch",
    "--zero-commit",
    "--no-signature",
    "--full-index",
    "--no-numbered",
    "--no-cover-letter",
    "--no-stat",
    "--no-renames",
    "--no-binary",
    "--no-thread",
    "--no-base",
)
SERIES_HEADER = "# Applied in this order by `git am`. Written by `nox -s patches -- export`.\n"


def export_commits(repo: Path, base: str, dest: Path) -> list[str]:
    """Write ``base..HEAD`` of ``repo`` into ``dest`` as one file per commit, named from its
    subject; return the names in commit order. Two commits whose subjects give the same
    name are refused."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="format-patch-", dir=dest) as tmp:
        out = git(*FORMAT_PATCH, "-o", tmp, f"{base}..HEAD", cwd=repo).stdout
        written = [Path(line) for line in out.splitlines() if line.strip()]
        names: dict[str, str] = {}  # file name -> subject
        for path in written:
            subject = parse_patch(path).subject
            name = patch_file_name(subject)
            if name in names:
                raise BuildError(
                    f"two commits would both be exported as {name} (subjects {names[name]!r} and "
                    f"{subject!r}); patch names come from subjects: reword one of them "
                    "(git commit --amend or rebase -i in the work tree)"
                )
            if name[:1].isdigit():
                raise BuildError(
                    f"the subject {subject!r} starts with a number, so its file name {name} would "
                    "read as a series position; reword the subject"
                )
            names[name] = subject
        for path, name in zip(written, names):
            shutil.move(path, dest / name)
    return list(names)


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


def freshness_problems(
    patch_set_dir: Path, cache: Path, work_root: Path, sdist: Path | None, note=print
) -> list[str]:
    """Apply the series to pristine, re-export, and compare with the committed files."""
    patch_set = load_patch_set(patch_set_dir)
    patches = checked_patches(patch_set)
    work_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fresh-", dir=work_root) as tmp:
        tree = patched_tree(
            patch_set.pin, patches, Path(tmp) / "tree", cache, sdist=sdist, note=note, apply=_apply_quietly
        )
        exported = Path(tmp) / "exported"
        names = export_commits(tree.path, tree.base, exported)
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


def _apply_quietly(tree: Path, patches: list[PatchInfo], date: int, _note) -> dict:
    return apply_series(tree, patches, date, note=lambda _m: None)
