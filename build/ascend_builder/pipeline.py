"""``nox -s build``: pin → fetch → pristine → apply → overlay → stamp → wheel.

Each step is one function in its own module; this file only sequences them and
makes sure a failure leaves nothing in ``dist/``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .config import DistConfig, cache_dir
from .gitutil import commit_all
from .overlay import copy_overlay, overlay_digest, plan_overlay
from .patched import patched_tree
from .patchset import checked_patches, load_patch_set
from .progress import Progress
from .stamp import builder_revision, dist_version, provenance, write_provenance
from .wheel import build_wheel, check_wheel


@dataclass
class BuildInputs:
    patch_set_dir: Path
    overlay_dir: Path
    build_number: int
    dist_dir: Path
    work_root: Path
    cache: Path
    builder_root: Path
    sdist: Path | None = None
    keep_work: bool = False

    @classmethod
    def from_config(
        cls,
        config: DistConfig,
        *,
        dist_dir: Path | None = None,
        cache: Path | None = None,
        sdist: Path | None = None,
        keep_work: bool = False,
    ) -> BuildInputs:
        """The inputs of a build of ``config``'s patch set and overlay; ``dist_dir`` defaults
        to ``dist/``, ``cache`` to ``cache_dir()``."""
        return cls(
            patch_set_dir=config.patch_set_dir,
            overlay_dir=config.overlay_dir,
            build_number=config.build_number,
            dist_dir=(dist_dir or config.dist_dir).resolve(),
            work_root=config.work_root,
            cache=cache or cache_dir(),
            builder_root=config.root,
            sdist=sdist,
            keep_work=keep_work,
        )


@dataclass
class PreparedTree:
    path: Path
    version: str
    provenance: dict
    source_date_epoch: int
    package: str


STEPS = 7


def prepare_tree(inputs: BuildInputs, workdir: Path, progress: Progress) -> PreparedTree:
    """Steps 1-6: a patched, overlaid, stamped upstream tree in ``workdir/tree``."""
    with progress.step("pin: read the patch set and lint its patches"):
        patch_set = load_patch_set(inputs.patch_set_dir)
        patches = checked_patches(patch_set)
        pin = patch_set.pin
        progress.note(f"{pin.name} {pin.version}, {len(patches)} patches from {patch_set.directory}")
    patched = patched_tree(
        pin,
        patches,
        workdir / "tree",
        inputs.cache,
        sdist=inputs.sdist,
        note=progress.note,
        step=progress.step,
    )
    tree, epoch = patched.path, patched.date
    with progress.step("overlay: copy overlay/ into the tree"):
        files = plan_overlay(inputs.overlay_dir, tree, patch_set.replacements, pin.package)
        copy_overlay(inputs.overlay_dir, tree, files)
        digest = overlay_digest(inputs.overlay_dir)
        commit_all(tree, "overlay", epoch)
        progress.note(f"{len(files)} files, digest {digest[:16]}")
    with progress.step("stamp: version and provenance"):
        version = dist_version(pin, inputs.build_number)
        data = provenance(
            pin, inputs.build_number, patches, digest, builder_revision(inputs.builder_root), epoch
        )
        write_provenance(tree, pin.package, data)
        commit_all(tree, f"stamp {version}", epoch)
        progress.note(f"version {version}")
    return PreparedTree(tree, version, data, epoch, pin.package)


def build_distribution(inputs: BuildInputs, progress: Progress | None = None) -> Path:
    """Build the wheel into ``inputs.dist_dir``; on any failure ``dist_dir`` is untouched."""
    progress = progress or Progress(STEPS)
    inputs.work_root.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="build-", dir=inputs.work_root))
    try:
        prepared = prepare_tree(inputs, workdir, progress)
        with progress.step("wheel: build with VLLM_TARGET_DEVICE=empty"):
            wheel = build_wheel(
                prepared.path,
                prepared.version,
                prepared.source_date_epoch,
                workdir / "out",
                workdir / "wheel-build.log",
            )
            check_wheel(wheel, prepared.package, prepared.version, prepared.provenance)
            inputs.dist_dir.mkdir(parents=True, exist_ok=True)
            final = inputs.dist_dir / wheel.name
            staged = inputs.dist_dir / f".{wheel.name}.partial"
            try:
                shutil.copyfile(wheel, staged)
                os.replace(staged, final)  # atomic: dist/ only ever sees a complete wheel
            finally:
                staged.unlink(missing_ok=True)
            progress.note(f"{final} ({final.stat().st_size / 1e6:.1f} MB)")
        progress.finish(f"built {final.name}")
        return final
    finally:
        if inputs.keep_work:
            progress.note(f"work directory kept at {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
