"""Copying ``overlay/`` into the upstream tree, refusing silent replacements."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from .errors import BuildError
from .patchset import Replacement, sha256_file

_IGNORED_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
_IGNORED_SUFFIXES = (".pyc", ".pyo", ".swp", "~")
GENERATED = "ascend/provenance.json"  # relative to the upstream package directory


def overlay_files(overlay: Path) -> list[str]:
    """Overlay paths (POSIX, relative), sorted, without caches and editor droppings."""
    files = []
    for path in overlay.rglob("*"):
        rel = path.relative_to(overlay)
        if any(part in _IGNORED_DIRS for part in rel.parts) or path.name.endswith(_IGNORED_SUFFIXES):
            continue
        if path.is_symlink():
            raise BuildError(f"overlay file {rel} is a symlink; the overlay must hold real files")
        if path.is_file():
            files.append(rel.as_posix())
    return sorted(files)


def overlay_digest(overlay: Path) -> str:
    """sha256 over every overlay path, executable bit and content, in sorted order."""
    digest = hashlib.sha256()
    for rel in overlay_files(overlay):
        path = overlay / rel
        executable = b"x" if path.stat().st_mode & 0o111 else b"-"
        digest.update(rel.encode() + b"\0" + executable + b"\0")
        digest.update(sha256_file(path).encode() + b"\n")
    return digest.hexdigest()


def plan_overlay(overlay: Path, tree: Path, replacements: dict[str, Replacement], package: str) -> list[str]:
    """Check the overlay against the tree; return the files to copy or raise BuildError."""
    files = overlay_files(overlay)
    generated = f"{package}/{GENERATED}"
    if generated in files:
        raise BuildError(f"overlay/{generated} is written by the builder; delete it from the overlay")
    for rel in files:
        target = tree / rel
        for parent in Path(rel).parents:
            if str(parent) != "." and (tree / parent).exists() and not (tree / parent).is_dir():
                raise BuildError(f"overlay/{rel} needs directory {parent}, which is a file upstream")
        if not target.exists() and not target.is_symlink():
            continue
        declared = replacements.get(rel)
        if declared is None:
            raise BuildError(
                f"overlay/{rel} would overwrite the upstream file {rel}, which no manifest "
                "declares; change it with a patch, or declare the replacement under "
                "[[overlay-replace]] in the patch set's patchset.toml with the upstream sha256"
            )
        actual = sha256_file(target)
        if actual != declared.upstream_sha256:
            raise BuildError(
                f"overlay/{rel} replaces upstream {rel}, whose sha256 is now {actual}, not the "
                f"declared {declared.upstream_sha256}; upstream changed under the replacement: "
                "review the new upstream file and update the manifest"
            )
    stale = sorted(set(replacements) - set(files))
    if stale:
        raise BuildError(
            f"patchset.toml declares a replacement of {stale[0]} but overlay/{stale[0]} does "
            "not exist; remove the stale [[overlay-replace]] entry"
        )
    return files


def copy_overlay(overlay: Path, tree: Path, files: list[str]) -> None:
    for rel in files:
        source, target = overlay / rel, tree / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            target.unlink()
        shutil.copyfile(source, target)
        target.chmod(0o755 if source.stat().st_mode & 0o111 else 0o644)
