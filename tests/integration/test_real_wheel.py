"""Build the real vLLM wheel twice, install it into a fresh venv, and check what it is.

Slow (a few minutes on a cold machine: the sdist download builds metadata, the
venv installs vLLM's dependencies). Uses VLLM_ASCEND_SDIST if set.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ascend_builder.config import pinned_version, wheelhouse_dir
from ascend_builder.patchset import load_patch_set, sha256_file

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["vllm-ascend"]
PATCH_SET = load_patch_set(ROOT / "patches" / CONFIG["patch-set"])
VERSION = f"{PATCH_SET.pin.version}+ascend.{CONFIG['build-number']}"


TORCH = pinned_version("torch")
TORCH_NPU = pinned_version("torch-npu", "ascend-extra-npu.txt")


def _build(dist: Path) -> Path:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "build"))
    result = subprocess.run(
        [sys.executable, "-m", "ascend_builder", "build", "--dist-dir", str(dist)],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
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
    assert f"torch=={TORCH}" in requires
    # torch-npu only with the `npu` extra: on a host without CANN it would break `import torch`.
    assert f'torch-npu=={TORCH_NPU}; sys_platform == "linux" and extra == "npu"' in requires
    assert not any(r.startswith("torch-npu") and "extra ==" not in r for r in requires)
    assert any(r.startswith("mooncake-transfer-engine-npu") and 'extra == "mooncake"' in r for r in requires)
    assert any(
        r.startswith("mooncake-transfer-engine-non-cuda") and 'extra == "mooncake-host"' in r
        for r in requires
    )
    # Ray only as an extra (the multi-node tests run the release it names)
    assert any(r.startswith("ray") and 'extra == "ray"' in r for r in requires)
    assert not any(r.startswith("ray") and "extra ==" not in r for r in requires)
    # What upstream's code imports for the served model families (docs/conformance.md).
    assert "numba==0.65.0" in requires
    assert f"torchvision=={pinned_version('torchvision')}" in requires
    # Upstream's common requirements are all there too.
    assert any(r.startswith("transformers") for r in requires)
    assert not any(r.startswith("torch==") and r != f"torch=={TORCH}" for r in requires)


FRESH_ENV_DROP = (
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
    "PYTHONPATH",
    "TORCH_NPU_DOUBLE_WHEEL",
    "VLLM_ASCEND_EMULATE",
    "VLLM_ASCEND_KERNELS",
)


def _pip_install(python: str, requirement: str, *options: str) -> None:
    """Install from the package index; a second try if the index fails us (a CI run once
    lost this install to an index error), then the end of pip's own report."""
    command = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q", *options, requirement]
    for attempt in (1, 2):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode == 0:
            return
        report = [line for line in (done.stdout + done.stderr).splitlines() if "is ignored" not in line]
        print(f"pip install {requirement} failed (attempt {attempt} of 2):", *report[-40:], sep="\n")
    pytest.fail(f"pip install {requirement} into a fresh venv failed twice:\n" + "\n".join(report[-40:]))


@pytest.fixture(scope="module")
def fresh_venv(wheels, tmp_path_factory) -> Iterator[tuple[str, dict]]:
    """The README's CPU-host install: the pinned torch, then the wheel (no extras)."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # the pinned torch as pip takes it from the index; nox's wheelhouse holds those files
    # when a session has fetched them (3 GB not downloaded twice in one CI run)
    house = wheelhouse_dir()
    offline = ("--no-index", "--find-links", str(house)) if list(house.glob(f"torch-{TORCH}-*.whl")) else ()
    _pip_install(python, f"torch=={TORCH}", *offline)
    _pip_install(python, str(wheels[0]))
    env = {k: v for k, v in os.environ.items() if k not in FRESH_ENV_DROP}
    yield python, env
    # 4-7 GB that no later test reads: CI machines share their disk
    shutil.rmtree(venv, ignore_errors=True)


def test_installs_into_fresh_venv_and_matches_the_pins(fresh_venv, tmp_path):
    python, env = fresh_venv
    probe = textwrap.dedent(
        """
        import json, importlib.metadata as md, importlib.util
        import vllm, vllm.ascend
        import torch
        print(json.dumps({
            "version": vllm.__version__,
            "dist_version": md.version("vllm"),
            "torch": torch.__version__,
            "torch_npu_installed": importlib.util.find_spec("torch_npu") is not None,
            "provenance": vllm.ascend.provenance(),
        }))
        """
    )
    result = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["version"] == VERSION == info["dist_version"]
    assert info["torch"].startswith(TORCH)
    assert not info["torch_npu_installed"]
    prov = info["provenance"]
    pin = PATCH_SET.pin
    assert prov["upstream"] == {"name": pin.name, "version": pin.version, "sdist_sha256": pin.sdist_sha256}
    assert [p["name"] for p in prov["patches"]] == PATCH_SET.series
    for entry in prov["patches"]:
        assert entry["sha256"] == sha256_file(PATCH_SET.directory / entry["name"])
        assert entry["upstream_status"]
    assert prov["version"] == VERSION


@pytest.mark.parametrize(
    "program",
    [
        "import torch; torch.ones(1)",
        "import transformers; transformers.AutoTokenizer",
        "import torch, vllm",
        "import vllm, torch",
        "import transformers, vllm; transformers.AutoTokenizer",
        "import vllm, transformers; transformers.AutoTokenizer",
    ],
)
def test_torch_and_transformers_import_in_any_order(fresh_venv, program, tmp_path):
    python, env = fresh_venv
    result = subprocess.run([python, "-c", program], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


def test_host_quick_start_and_npu_install_hint(fresh_venv, tmp_path):
    """README quick start in the fresh environment: make a tiny model, `vllm serve` it
    in host emulation, complete a prompt. Without emulation it says what to install."""
    import httpx

    python, env = fresh_venv
    vllm_cli = str(Path(python).with_name("vllm"))
    model = tmp_path / "tiny-llama"
    subprocess.run(
        [python, str(ROOT / "examples" / "make_tiny_model.py"), "--arch", "llama", "--out", str(model)],
        check=True,
        capture_output=True,
        env=env,
    )
    refused = subprocess.run(
        [vllm_cli, "serve", str(model), "--port", "1"], capture_output=True, text=True, env=env, timeout=300
    )
    assert refused.returncode == 1
    assert f"pip install 'torch-npu=={TORCH_NPU}'" in refused.stderr.strip().splitlines()[-1]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115  (the server writes it until it stops)
    server = subprocess.Popen(
        [vllm_cli, "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"],
        env={**env, "VLLM_ASCEND_EMULATE": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vllm serve not healthy after 300 s"
            time.sleep(1)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"model": str(model), "prompt": "The quick brown fox", "max_tokens": 8},
        )
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def test_npu_extra_brings_the_matching_torch_npu(fresh_venv, wheels, tmp_path):
    """The documented Ascend-host install resolves the pinned torch-npu (dry run: nothing installed)."""
    python, env = fresh_venv
    report = tmp_path / "report.json"
    subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "-q",
            "--dry-run",
            "--report",
            str(report),
            f"{wheels[0]}[npu]",
        ],
        check=True,
        env=env,
    )
    installs = {
        i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    assert installs.get("torch-npu") == TORCH_NPU
