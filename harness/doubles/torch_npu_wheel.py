"""The pinned torch_npu wheel, fetched once with pip and cached by its sha256
(``python -m harness.doubles.torch_npu_wheel`` from the repository root prints its path).

The contract double reads torch_npu's own meta functions (and the tests read its
docs) from this file; nothing from it is imported as torch_npu or installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.doubles import TORCH_NPU_SITE as SITE

HERE = Path(__file__).resolve().parent


def pinned() -> dict:
    return json.loads((HERE / "schemas.json").read_text())["torch_npu"]


def cache_dir() -> Path:
    base = os.environ.get("VLLM_ASCEND_BUILD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm-ascend-build"
    )
    return Path(base) / "torch-npu"


def download(version: str, directory: Path) -> Path:
    """torch_npu ``version``'s wheel downloaded into ``directory`` with pip (no dependencies,
    no install)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary",
            ":all:",
            "-d",
            str(directory),
            f"torch-npu=={version}",
        ],
        check=True,
    )
    [wheel] = directory.glob("*.whl")
    return wheel


def fetch() -> Path:
    """Path of the pinned wheel, downloading it (no dependencies, no install) if needed."""
    pin = pinned()
    target = cache_dir() / pin["sha256"] / pin["wheel"]
    if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == pin["sha256"]:
        return target
    with tempfile.TemporaryDirectory() as tmp:
        got = download(pin["version"], Path(tmp))
        digest = hashlib.sha256(got.read_bytes()).hexdigest()
        if digest != pin["sha256"]:
            raise RuntimeError(f"downloaded {got.name} has sha256 {digest}, expected {pin['sha256']}")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(got), target)
    return target


def double_env(wheel: Path | None = None) -> dict[str, str]:
    """Environment for a process that should import the double as torch_npu."""
    path = os.environ.get("PYTHONPATH")
    return {
        "PYTHONPATH": str(SITE) + (os.pathsep + path if path else ""),
        "TORCH_NPU_DOUBLE_WHEEL": str(wheel or fetch()),
    }


if __name__ == "__main__":
    print(fetch())
