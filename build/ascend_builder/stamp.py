"""The distribution version and the provenance file written into the wheel."""

from __future__ import annotations

import json
from pathlib import Path

from .gitutil import git
from .overlay import GENERATED
from .patchfile import PatchInfo
from .patchset import Pin, sha256_file

PROVENANCE_SCHEMA = 1


def dist_version(pin: Pin, build_number: int) -> str:
    return f"{pin.version}+ascend.{build_number}"


def builder_revision(root: Path) -> str:
    """The builder repository's commit, with ``-dirty`` if tracked files differ from it."""
    result = git("rev-parse", "HEAD", cwd=root, check=False)
    if result.returncode != 0:
        return "unknown"
    rev = result.stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no", cwd=root, check=False).stdout.strip()
    return rev + ("-dirty" if dirty else "")


def provenance(
    pin: Pin,
    build_number: int,
    patches: list[PatchInfo],
    overlay_sha256: str,
    revision: str,
    source_date_epoch: int,
) -> dict:
    return {
        "schema": PROVENANCE_SCHEMA,
        "version": dist_version(pin, build_number),
        "upstream": {"name": pin.name, "version": pin.version, "sdist_sha256": pin.sdist_sha256},
        "patches": [
            {
                "name": info.path.name,
                "sha256": sha256_file(info.path),
                "upstream_status": info.upstream_status,
                "subject": info.subject,
            }
            for info in patches
        ],
        "overlay": {"sha256": overlay_sha256},
        "builder": {"revision": revision},
        "source_date_epoch": source_date_epoch,
    }


def write_provenance(tree: Path, package: str, data: dict) -> Path:
    path = tree / package / GENERATED
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path
