"""Build the real vLLM wheel twice, install it into a fresh venv, and check what it is.

Slow (a few minutes on a cold machine: the sdist download builds metadata, the
venv installs vLLM's dependencies). Uses VLLM_ASCEND_SDIST if set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

from ascend_builder.patchset import load_patch_set, sha256_file

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["vllm-ascend"]
PATCH_SET = load_patch_set(ROOT / "patches" / CONFIG["patch-set"])
VERSION = f"{PATCH_SET.pin.version}+ascend.{CONFIG['build-number']}"


def _build(dist: Path) -> Path:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "build"))
    result = subprocess.run([sys.executable, "-m", "ascend_builder", "build", "--dist-dir", str(dist)],
                            env=env, capture_output=True, text=True, cwd=ROOT)
    sys.stderr.write(result.stderr)
    assert result.returncode == 0, result.stderr[-3000:]
    [wheel] = dist.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> tuple[Path, Path]:
    """Two independent builds. ``VLLM_ASCEND_TEST_WHEEL`` (set by ``nox -s tests``, which
    has just built the wheel it installs) stands in for the first one."""
    base = tmp_path_factory.mktemp("real")
    prebuilt = os.environ.get("VLLM_ASCEND_TEST_WHEEL")
    first = Path(prebuilt) if prebuilt else _build(base / "dist1")
    return first, _build(base / "dist2")


def test_wheel_name_tag_and_reproducibility(wheels):
    first, second = wheels
    assert first.name == f"vllm-{VERSION}-py3-none-any.whl"
    assert first.read_bytes() == second.read_bytes(), "two builds must be byte-identical"
    with zipfile.ZipFile(first) as zf:
        names = zf.namelist()
        assert not [n for n in names if n.endswith((".so", ".pyd")) or n.endswith("/vllm-rs")]
        meta = zf.read(f"vllm-{VERSION}.dist-info/METADATA").decode()
        wheel_info = zf.read(f"vllm-{VERSION}.dist-info/WHEEL").decode()
    assert "Root-Is-Purelib: true" in wheel_info and "Tag: py3-none-any" in wheel_info
    requires = [line.split(": ", 1)[1] for line in meta.splitlines() if line.startswith("Requires-Dist: ")]
    assert "torch==2.13.0" in requires
    assert 'torch-npu==2.13.0; sys_platform == "linux"' in requires
    assert any(r.startswith("mooncake-transfer-engine-npu") and 'extra == "mooncake"' in r for r in requires)
    assert any(r.startswith("mooncake-transfer-engine-non-cuda") and 'extra == "mooncake-host"' in r
               for r in requires)
    # Upstream's common requirements are all there too.
    assert any(r.startswith("transformers") for r in requires)
    assert not any(r.startswith("torch==") and r != "torch==2.13.0" for r in requires)


def test_installs_into_fresh_venv_and_matches_the_pins(wheels, tmp_path):
    wheel = wheels[0]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, str(wheel)], check=True)
    probe = textwrap.dedent(
        """
        import json, importlib.metadata as md
        import vllm, vllm.ascend
        import torch  # after vllm: the autoload hook keeps a CANN-less torch_npu from breaking this
        print(json.dumps({
            "version": vllm.__version__,
            "dist_version": md.version("vllm"),
            "torch": torch.__version__,
            "torch_npu_installed": bool(md.distribution("torch-npu")),
            "provenance": vllm.ascend.provenance(),
        }))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    result = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["version"] == VERSION == info["dist_version"]
    assert info["torch"].startswith("2.13.0")
    assert info["torch_npu_installed"]
    prov = info["provenance"]
    pin = PATCH_SET.pin
    assert prov["upstream"] == {"name": pin.name, "version": pin.version, "sdist_sha256": pin.sdist_sha256}
    assert [p["name"] for p in prov["patches"]] == PATCH_SET.series
    for entry in prov["patches"]:
        assert entry["sha256"] == sha256_file(PATCH_SET.directory / entry["name"])
        assert entry["upstream_status"]
    assert prov["version"] == VERSION
