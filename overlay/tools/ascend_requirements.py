"""Dependencies of the vLLM Ascend distribution, read by upstream's setup.py (patch
``setup-take-the-ascend-distribution-s-requirements-and-extras``).

The data lives in requirements/ascend.txt (always installed with the empty target)
and requirements/ascend-extra-<name>.txt (one file per extra), all from overlay/.
"""

from __future__ import annotations

from pathlib import Path

EXTRA_PREFIX = "ascend-extra-"


def _read(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def install_requires(requirements_dir: Path) -> list[str]:
    return _read(Path(requirements_dir) / "ascend.txt")


def extras_require(requirements_dir: Path) -> dict[str, list[str]]:
    return {
        path.stem.removeprefix(EXTRA_PREFIX): _read(path)
        for path in sorted(Path(requirements_dir).glob(f"{EXTRA_PREFIX}*.txt"))
    }
