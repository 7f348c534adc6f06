"""The patched upstream tree: the pinned sdist's pristine commit plus the series, one
commit per patch. The build, the freshness check, the maintainer work tree and rebase
trials all make their tree with :func:`patched_tree`."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .apply import apply_series
from .fetch import obtain_pinned_sdist
from .gitutil import commit_all, head
from .patchfile import PatchInfo
from .patchset import Pin
from .pristine import checkout_pristine, pristine_repo, sdist_epoch, unpack_sdist


@dataclass
class PatchedTree:
    path: Path
    base: str  # the commit the series sits on (the pristine upstream)
    date: int  # commit date of the base and of every patch commit
    applied: dict  # patch file name -> what ``apply`` reported for it (offsets, a rebase outcome)


@dataclass(frozen=True)
class Retarget:
    """Another release of the same upstream whose files replace the pristine tree's, committed
    on top of it (rebase trials: the patches' index lines still find the old blobs for 3-way)."""

    sdist: Path
    version: str


def _no_step(_title: str):
    return contextlib.nullcontext()


def patched_tree(
    pin: Pin,
    patches: list[PatchInfo],
    dest: Path,
    cache: Path,
    *,
    sdist: Path | None = None,
    note: Callable[[str], None] = print,
    step: Callable[[str], contextlib.AbstractContextManager] = _no_step,
    retarget: Retarget | None = None,
    apply: Callable[..., dict] = apply_series,
) -> PatchedTree:
    """Check out ``pin``'s pristine tree into ``dest`` (fetched and verified through the
    cache, or from the local ``sdist``) and apply ``patches`` with ``apply`` (default: git am,
    no fuzz, stop at the first failure). ``step`` names the three phases (the build's
    progress lines)."""
    with step("fetch: obtain the sdist and verify its sha256"):
        sdist_path = obtain_pinned_sdist(pin, cache, sdist, note)
    with step("pristine: upstream tree as a git repository"):
        repo = pristine_repo(sdist_path, pin.name, pin.version, pin.sdist_sha256, cache, note)
        dest.parent.mkdir(parents=True, exist_ok=True)
        date = checkout_pristine(repo, dest)
        if retarget is not None:
            date = _retarget(dest, pin, retarget)
        base = head(dest)
    with step(f"apply: git am {len(patches)} patches (no fuzz, no 3-way)"):
        applied = apply(dest, patches, date, note)
    return PatchedTree(dest, base, date, applied)


def _retarget(tree: Path, pin: Pin, target: Retarget) -> int:
    """Replace ``tree``'s files by the target release's and commit them; return its date."""
    unpacked = tree.parent / f".{tree.name}-retarget"
    shutil.rmtree(unpacked, ignore_errors=True)
    source = unpack_sdist(target.sdist, unpacked, f"{pin.name}-{target.version}")
    os.rename(tree / ".git", source / ".git")
    shutil.rmtree(tree)
    os.rename(source, tree)
    shutil.rmtree(unpacked)
    date = sdist_epoch(target.sdist)
    commit_all(tree, f"pristine {pin.name} {target.version}", date, force=True)
    return date
