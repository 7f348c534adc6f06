"""The maintainer work tree: pristine + one commit per patch, with the overlay linked in."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .errors import BuildError
from .export import export_to_patch_set
from .gitutil import git
from .overlay import overlay_files, plan_overlay
from .patched import patched_tree
from .patchfile import parse_patch
from .patchset import lint_patch_set, lint_series, load_patch_set

PRISTINE_TAG = "pristine"


def link_overlay(overlay: Path, tree: Path) -> list[str]:
    """Symlink overlay paths into the tree so edits are live; return the linked paths.

    A directory that does not exist upstream is linked whole (new files inside it
    appear without re-running); otherwise files are linked one by one.
    """
    overlay = overlay.resolve()
    linked: list[str] = []
    wanted = set(overlay_files(overlay))

    def visit(rel: Path) -> None:
        for child in sorted((overlay / rel).iterdir()):
            child_rel = rel / child.name
            posix = child_rel.as_posix()
            target = tree / child_rel
            if child.is_dir():
                if not any(w.startswith(posix + "/") for w in wanted):
                    continue
                if target.exists():
                    visit(child_rel)
                    continue
            elif posix not in wanted:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists() or target.is_symlink():
                target.unlink()
            os.symlink(os.path.relpath(child, target.parent), target)
            linked.append(posix)

    visit(Path("."))
    return linked


def prepare_worktree(
    patch_set_dir: Path,
    overlay: Path,
    dest: Path,
    cache: Path,
    sdist: Path | None = None,
    force: bool = False,
    note=print,
) -> Path:
    """Pristine + one commit per patch in ``dest``, tag ``pristine`` on the upstream commit,
    the overlay linked in. The series must be consistent; a patch's name or header problems
    do not stop it (the tree is where they are fixed): they are printed."""
    if dest.exists() and not force:
        raise BuildError(
            f"work tree {dest} already exists; export your commits first "
            "(`nox -s patches -- export`), then re-run with --force to recreate it"
        )
    patch_set = load_patch_set(patch_set_dir)
    series_problems = lint_series(patch_set)
    if series_problems:
        raise BuildError(series_problems[0])
    patches = [parse_patch(path) for path in patch_set.patch_paths()]
    if dest.exists():
        shutil.rmtree(dest)
    tree = patched_tree(patch_set.pin, patches, dest, cache, sdist=sdist, note=note)
    attach_overlay(dest, tree.base, overlay, patch_set.replacements, patch_set.pin.package)
    for problem in lint_patch_set(patch_set):
        note(f"to fix here before exporting: {problem}")
    note(f"work tree ready at {dest}: commit on top of tag '{PRISTINE_TAG}', one commit per patch")
    return dest


def attach_overlay(dest: Path, base: str, overlay: Path, replacements, package: str) -> None:
    """Tag ``base`` as the pristine upstream and link the overlay into ``dest``, kept out of
    commits (git's exclude list; replaced upstream files marked skip-worktree)."""
    git("tag", PRISTINE_TAG, base, cwd=dest)
    plan_overlay(overlay, dest, replacements, package)
    linked = link_overlay(overlay, dest)
    exclude = dest / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with open(exclude, "a") as f:
        f.write("# overlay/ links (nox -s tree)\n" + "".join(f"/{p}\n" for p in linked))
    replaced = [p for p in linked if p in replacements]
    if replaced:
        git("update-index", "--skip-worktree", *replaced, cwd=dest)


def export_worktree(tree: Path, patch_set_dir: Path, note=print) -> list[str]:
    if not (tree / ".git").exists():
        raise BuildError(f"no work tree at {tree}; create it with `nox -s tree`")
    status = git("status", "--porcelain", "--untracked-files=no", cwd=tree).stdout.strip()
    if status:
        raise BuildError(
            f"work tree {tree} has uncommitted changes ({status.splitlines()[0].strip()} ...); "
            "commit them (amend the patch's commit) before exporting"
        )
    names = export_to_patch_set(tree, PRISTINE_TAG, patch_set_dir)
    note(f"exported {len(names)} patches to {patch_set_dir}")
    return names
