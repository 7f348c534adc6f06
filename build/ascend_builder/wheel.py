"""Building the wheel from the prepared tree, and checking what came out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from .errors import BuildError
from .overlay import GENERATED

_COMPILED_SUFFIXES = (".so", ".pyd", ".dylib", ".dll", ".a", ".o")
# Variables that would make upstream's setup.py download or compile something.
_CLEARED = (
    "VLLM_USE_PRECOMPILED",
    "VLLM_USE_PRECOMPILED_RUST",
    "VLLM_REQUIRE_RUST_FRONTEND",
    "VLLM_PRECOMPILED_WHEEL_LOCATION",
    "SETUPTOOLS_SCM_PRETEND_VERSION",
)


def build_wheel(tree: Path, version: str, source_date_epoch: int, out_dir: Path, log_path: Path) -> Path:
    """Run ``python -m build --wheel --no-isolation`` with the empty target; return the wheel."""
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update(
        VLLM_TARGET_DEVICE="empty",
        VLLM_VERSION_OVERRIDE=version,
        SOURCE_DATE_EPOCH=str(source_date_epoch),
        PYTHONHASHSEED="0",
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",  # setup.py imports torch; torch_npu needs CANN
        TZ="UTC",
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out_dir), "."]
    with open(log_path, "w") as log:
        result = subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    wheels = sorted(out_dir.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise BuildError(
            f"the wheel build failed (exit {result.returncode}); is the build environment "
            f"installed (`pip install -r build/requirements.txt`)? Last lines of {log_path}:\n{tail}"
        )
    return wheels[0]


def check_wheel(wheel: Path, package: str, version: str, provenance: dict) -> None:
    """Refuse a wheel with the wrong name/tag, compiled code, or a provenance mismatch."""
    expected_prefix = f"{package}-{version}-"
    if not wheel.name.startswith(expected_prefix) or not wheel.name.endswith("-py3-none-any.whl"):
        raise BuildError(
            f"built {wheel.name}, expected {expected_prefix}py3-none-any.whl; the wheel must be "
            "pure Python (check the patch that keeps compiled extensions out of the empty target)"
        )
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        compiled = [n for n in names if n.endswith(_COMPILED_SUFFIXES)]
        if compiled:
            raise BuildError(
                f"{wheel.name} contains compiled files ({compiled[0]}, ...); the wheel must be pure Python"
            )
        member = f"{package}/{GENERATED}"
        if member not in names:
            raise BuildError(f"{wheel.name} lacks {member}; check the package-data patch")
        if json.loads(zf.read(member)) != provenance:
            raise BuildError(f"{member} in {wheel.name} differs from the provenance the builder wrote")
