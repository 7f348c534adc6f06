"""The maintainer work tree: pristine + one commit per patch, with the overlay linked in."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .apply import apply_series
from .errors import BuildError
from .export import export_to_patch_set
from .fetch import obtain_pinned_sdist
from .gitutil import git
from .overlay import overlay_files, plan_overlay
from .patchset import checked_patches, load_patch_set
from .pristine import checkout_pristine, pristine_repo

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


def prepare_worktree(patch_set_dir: Path, overlay: Path, dest: Path, cache: Path,
                     sdist: Path | None = None, force: bool = False, note=print) -> Path:
    if dest.exists():
        if not force:
            raise BuildError(
                f"work tree {dest} already exists; export your commits first "
                "(`nox -s patches -- export`), then re-run with --force to recreate it"
            )
        shutil.rmtree(dest)
    patch_set = load_patch_set(patch_set_dir)
    patches = checked_patches(patch_set)
    pin = patch_set.pin
    sdist_path = obtain_pinned_sdist(pin, cache, sdist, note)
    repo = pristine_repo(sdist_path, pin.name, pin.version, pin.sdist_sha256, cache, note)
    dest.parent.mkdir(parents=True, exist_ok=True)
    date = checkout_pristine(repo, dest)
    git("tag", PRISTINE_TAG, cwd=dest)
    apply_series(dest, patches, date, note)
    plan_overlay(overlay, dest, patch_set.replacements, pin.package)
    linked = link_overlay(overlay, dest)
    # Linked overlay paths are not part of any patch: keep them out of commits.
    exclude = dest / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with open(exclude, "a") as f:
        f.write("# overlay/ links (nox -s tree)\n" + "".join(f"/{p}\n" for p in linked))
    replaced = [p for p in linked if p in patch_set.replacements]
    if replaced:
        git("update-index", "--skip-worktree", *replaced, cwd=dest)
    note(f"work tree ready at {dest}: commit on top of tag '{PRISTINE_TAG}', one commit per patch")
    return dest


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
