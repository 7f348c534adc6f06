"""Repository-level settings: the one place that picks the default patch set and build number."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .errors import BuildError

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DistConfig:
    root: Path
    patch_set: str  # directory name under patches/, e.g. "vllm-0.33.0"
    build_number: int  # the <n> in <upstream>+ascend.<n>

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def overlay_dir(self) -> Path:
        return self.root / "overlay"

    @property
    def patch_set_dir(self) -> Path:
        return self.patches_dir / self.patch_set

    @property
    def dist_dir(self) -> Path:
        return self.root / "dist"

    @property
    def work_root(self) -> Path:
        return self.root / ".work"


def load_config(root: Path = REPO_ROOT, patch_set: str | None = None) -> DistConfig:
    """Read ``[tool.vllm-ascend]`` from pyproject.toml; ``patch_set`` overrides the default."""
    root = root.resolve()
    path = root / "pyproject.toml"
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    table = data.get("tool", {}).get("vllm-ascend", {})
    default = table.get("patch-set")
    number = table.get("build-number")
    if not isinstance(default, str) or not isinstance(number, int) or number < 0:
        raise BuildError(
            f"{path}: [tool.vllm-ascend] needs patch-set (string) and build-number (non-negative integer)"
        )
    chosen = patch_set or default
    if not (root / "patches" / chosen).is_dir():
        available = sorted(p.name for p in (root / "patches").iterdir() if p.is_dir())
        raise BuildError(
            f"patch set {chosen!r} does not exist under {root / 'patches'}; "
            f"available: {', '.join(available) or 'none'}"
        )
    return DistConfig(root=root, patch_set=chosen, build_number=number)


def cache_dir() -> Path:
    """Where fetched sdists and pristine trees are kept (``VLLM_ASCEND_BUILD_CACHE``)."""
    explicit = os.environ.get("VLLM_ASCEND_BUILD_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm-ascend-build"


def wheelhouse_dir() -> Path:
    """Where nox keeps the pinned torch stack's wheels, downloaded once for every session
    (the index's torch is a CUDA build of about 3 GB)."""
    return cache_dir() / "wheelhouse"


def pinned_version(name: str, requirements: str = "ascend.txt", root: Path = REPO_ROOT) -> str:
    """The version ``overlay/requirements/<requirements>`` pins ``name`` to (``name == X``):
    the wheel's own pins, read by nox (the torch stack it installs) and by the tests."""
    path = root / "overlay" / "requirements" / requirements
    for line in path.read_text().splitlines():
        requirement = line.split("#", 1)[0].split(";", 1)[0].replace(" ", "")
        if requirement.startswith(f"{name}=="):
            return requirement.removeprefix(f"{name}==")
    raise BuildError(f"{path} pins no {name}")
