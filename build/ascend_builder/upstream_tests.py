"""Upstream's own test suite, taken from the pinned, verified sdist (not copied into this repo).

Only ``tests/``, ``examples/`` (some tests import them) and the top-level
``pyproject.toml`` (its pytest markers) are unpacked, never ``vllm/``: pytest puts
the tree's root first on ``sys.path``, and the installed wheel must be the ``vllm``
the tests import. Unpacked once per sdist sha256.
"""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

from .errors import BuildError
from .fetch import obtain_pinned_sdist
from .patchfile import parse_patch
from .patchset import Pin, load_patch_set

WANTED = ("tests/", "examples/", "pyproject.toml")
MARKER = ".unpacked-from-sdist"


def upstream_test_tree(pin: Pin, cache: Path, dest_root: Path, sdist: Path | None = None, note=print) -> Path:
    """The directory holding upstream's tests for ``pin`` (unpacked if needed)."""
    sdist_path = obtain_pinned_sdist(pin, cache, sdist, note)
    dest = dest_root / f"{pin.name}-{pin.version}"
    marker = dest / MARKER
    if marker.is_file() and marker.read_text().strip() == pin.sdist_sha256:
        note(f"upstream tests at {dest} (from sdist {pin.sdist_sha256[:12]})")
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    prefix = f"{pin.name}-{pin.version}/"
    tmp = dest.with_name(dest.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    with tarfile.open(sdist_path) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix) and m.name[len(prefix) :].startswith(WANTED)
        ]
        if not any(m.name.startswith(prefix + "tests/") for m in members):
            raise BuildError(f"{sdist_path.name} has no {prefix}tests/ to run")
        for member in members:
            member.name = member.name[len(prefix) :]
        tar.extractall(tmp, members=members, filter="data")
    (tmp / MARKER).write_text(pin.sdist_sha256 + "\n")
    tmp.rename(dest)
    note(f"unpacked upstream tests to {dest}")
    return dest


def patched_modules(patch_set_dir: Path, packages: bool = True) -> dict[str, list[str]]:
    """Every Python module of the upstream package the series changes, with the patches that
    change it: ``vllm/v1/core/kv_cache_utils.py`` -> ``vllm.v1.core.kv_cache_utils``. Package
    modules (``__init__.py``) are named ``vllm.platforms`` and so on, and left out with
    ``packages=False``; files outside the package (``setup.py``) are not modules."""
    patch_set = load_patch_set(patch_set_dir)
    package = patch_set.pin.package
    modules: dict[str, list[str]] = {}
    for path in patch_set.patch_paths():
        for file in parse_patch(path).files:
            parts = Path(file).with_suffix("").parts
            if file.endswith(".py") and parts[0] == package and (packages or parts[-1] != "__init__"):
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                modules.setdefault(name, []).append(path.name)
    return dict(sorted(modules.items()))
