"""Developer and CI entry points. `nox -s build` builds the wheel; `nox -s tests` tests."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox
from nox.command import CommandFailed

ROOT = Path(__file__).resolve().parent
BUILDER_ENV = {"PYTHONPATH": str(ROOT / "build")}
sys.path.insert(0, str(ROOT / "build"))
# the builder's own reading of the configuration and the patch sets (stdlib only)
from ascend_builder.benchmarks import benchmarks  # noqa: E402
from ascend_builder.benchmarks import script as benchmark_script  # noqa: E402
from ascend_builder.config import load_config, pinned_version, wheelhouse_dir  # noqa: E402
from ascend_builder.patchfile import parse_patch  # noqa: E402
from ascend_builder.patchset import load_patch_set  # noqa: E402

BUILD_REQUIREMENTS = str(ROOT / "build" / "requirements.txt")

nox.options.sessions = ["build"]
nox.options.reuse_venv = "yes"


def _builder(session: nox.Session, *args: str) -> None:
    session.run("python", "-m", "ascend_builder", *args, env=BUILDER_ENV)


def _torch_stack() -> list[str]:
    """torch and torchvision as the wheel pins them (overlay/requirements/ascend.txt)."""
    return [f"{name}=={pinned_version(name)}" for name in ("torch", "torchvision")]


def _install_torch(session: nox.Session, python: str = "python") -> None:
    """Install the pinned torch stack from the wheelhouse. The index's torch is a CUDA build
    (about 3 GB with its nvidia-* wheels) and pip's HTTP cache cannot be relied on to keep
    it (this CI's index answers uncacheable), so it is downloaded once (`pip download`
    skips files already there) and every session installs it with no index."""
    stack, house = _torch_stack(), str(wheelhouse_dir())
    session.log(f"torch stack {' '.join(stack)} via the wheelhouse {house}")
    pip = [python, "-m", "pip"]
    session.run(*pip, "download", "-q", "--only-binary", ":all:", "-d", house, *stack, external=True)
    session.run(*pip, "install", "-q", "--no-index", "--find-links", house, *stack, external=True)


@nox.session
def build(session: nox.Session) -> None:
    """Build dist/vllm-<upstream>+ascend.<n>-py3-none-any.whl (args: --sdist PATH, --patch-set NAME)."""
    _install_torch(session)
    session.install("-r", BUILD_REQUIREMENTS)
    _builder(session, "build", *session.posargs)


def _install_built_wheel(session: nox.Session) -> Path:
    """Build the wheel and install it into the session (the tests and benchmarks)."""
    dist = ROOT / ".work" / "nox-dist"
    shutil.rmtree(dist, ignore_errors=True)  # a wheel of another upstream must not linger
    _builder(session, "build", "--dist-dir", str(dist))
    [wheel] = sorted(dist.glob("*.whl"))
    # with the Mooncake engine for CPU hosts (the P/D tests and benchmark move KV over it)
    # and Ray (the multi-node tests start a local two-node Ray cluster)
    session.install(f"{wheel}[mooncake-host,ray]")
    session.install("--force-reinstall", "--no-deps", str(wheel))  # same version, new bytes
    return wheel


UPSTREAM_TEST_REQUIREMENTS = str(ROOT / "tests" / "upstream" / "requirements.txt")
TEST_REQUIREMENTS = str(ROOT / "tests" / "requirements.txt")
LINT_REQUIREMENTS = str(ROOT / "tests" / "lint-requirements.txt")
LINT_PATHS = ("overlay", "build", "tests", "harness", "benchmarks", "examples", "noxfile.py")
TYPED_PATHS = ("overlay/vllm/ascend", "build/ascend_builder")  # what mypy checks


def _install_test_requirements(session: nox.Session) -> None:
    _install_torch(session)
    session.install("-r", BUILD_REQUIREMENTS, "-r", TEST_REQUIREMENTS, "-r", UPSTREAM_TEST_REQUIREMENTS)


def _upstream_conformance(session: nox.Session, *args: str) -> None:
    """Upstream's own tests (unpacked from the pinned sdist) against the installed wheel."""
    source = (
        session.run("python", "-m", "ascend_builder", "upstream-tests", env=BUILDER_ENV, silent=True)
        .strip()
        .splitlines()[-1]
    )
    session.run("python", "-m", "tests.upstream.run", "--source", source, *args)


@nox.session
def tests(session: nox.Session) -> None:
    """Everything CI runs against the built wheel: the builder tests (synthetic upstreams),
    the unit tier (tests/unit), the engine tier (tests/engine: host emulation against
    Hugging Face transformers, the NPU path under the torch_npu contract), the real-wheel
    integration test and the contract double's own tests, then upstream's fast
    conformance selection; not the ``extended`` cases (``-- tests -m extended`` runs them).
    Args replace the pytest arguments (and skip the conformance)."""
    _install_test_requirements(session)
    wheel = _install_built_wheel(session)
    # Two workers, each taking whole files (a module's engine fixture stays in one process):
    # on 2 cores one worker's engine start overlaps the other's waits and imports. The
    # slowest tests are listed so the CI time budget can be kept; `extended` cases (paths
    # other cases cover too) stay out of this run for that budget.
    session.run(
        "python",
        "-m",
        "pytest",
        *(
            session.posargs
            or ["tests", "-m", "not extended", "-n", "2", "--dist", "loadfile", "--durations=40"]
        ),
        env={**BUILDER_ENV, "VLLM_ASCEND_TEST_WHEEL": str(wheel)},
    )
    if not session.posargs:
        # outcomes kept so a run can be judged again (`--rejudge`) or recorded without re-running
        outcomes = ROOT / ".work" / "upstream" / "fast.outcomes.jsonl"
        outcomes.parent.mkdir(parents=True, exist_ok=True)
        _upstream_conformance(session, "--selection", "fast", "--outcomes", str(outcomes))


def _patch_set_version(patch_set: str | None = None) -> tuple[str, str]:
    """A patch set (default: pyproject.toml's) and the editable install's version for it,
    as the builder reads them."""
    config = load_config(patch_set=patch_set)
    upstream = load_patch_set(config.patch_set_dir).pin.version
    return config.patch_set, f"{upstream}+ascend.{config.build_number}.dev"


def _install_stamp(tree: Path, version: str) -> str:
    """What an editable install of ``tree`` depends on: its packaging files and requirements
    (code changes need no reinstall: the install points at the tree)."""
    digest = hashlib.sha256(f"{tree.resolve()}\0{version}".encode())
    for path in [tree / "setup.py", tree / "pyproject.toml", *sorted(tree.glob("requirements/*.txt"))]:
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _stale_work_tree(tree: Path, patch_dir: Path) -> str | None:
    """Why the work tree's patch commits are not the patch set's (by subject, in series
    order), or None. Catches a tree made before the patches changed."""
    wanted = [parse_patch(path).subject for path in load_patch_set(patch_dir).patch_paths()]
    log = subprocess.run(
        ["git", "-C", str(tree), "log", "--reverse", "--format=%s", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.splitlines()
    have = log[1:]  # after the pristine commit
    if have[: len(wanted)] != wanted:
        return f"{len(have)} patch commits, the series has {len(wanted)} patches"
    return None


@nox.session
def unit(session: nox.Session) -> None:
    """The unit tier (tests/unit: no vLLM engine, seconds to minutes) against the maintainer
    work tree work/<patch-set> installed editable: no wheel build. The tree is made with
    the builder's `tree` command if it does not exist; an existing one is used as it is
    (`nox -s tree -- --force` recreates it). Args replace the pytest arguments."""
    _install_torch(session)  # torch first: setup.py imports it
    session.install("-r", BUILD_REQUIREMENTS, "-r", TEST_REQUIREMENTS)
    patch_set, version = _patch_set_version()
    tree = ROOT / "work" / patch_set
    if not tree.exists():
        _builder(session, "tree")
    stale = _stale_work_tree(tree, ROOT / "patches" / patch_set)
    if stale:
        session.error(
            f"work tree {tree} does not match patches/{patch_set}/ ({stale}): export commits you "
            "made there (`nox -s patches -- export`), or recreate it (`nox -s tree -- --force --no-install`)"
        )
    stamp = Path(session.virtualenv.location) / "unit-tree.stamp"
    if not stamp.exists() or stamp.read_text() != _install_stamp(tree, version):
        # the mooncake-host extra: the KV transport tests move bytes over Mooncake TCP
        session.run(
            "python",
            "-m",
            "pip",
            "install",
            "--no-build-isolation",
            "-e",
            f"{tree}[mooncake-host]",
            env={
                "VLLM_TARGET_DEVICE": "empty",
                "VLLM_VERSION_OVERRIDE": version,
                "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
            },
        )
        stamp.write_text(_install_stamp(tree, version))
    else:
        session.log(f"editable install of {tree} is current")
    session.run("python", "-m", "pytest", *(session.posargs or ["tests/unit", "--durations=10"]))


@nox.session
def lint(session: nox.Session) -> None:
    """`ruff check` and `ruff format --check` (ruff pinned in tests/lint-requirements.txt,
    config in pyproject.toml) over overlay/, build/, tests/, benchmarks/, examples/ and
    this file, then mypy over the overlay and the builder. Args replace the ruff paths."""
    session.install("-r", LINT_REQUIREMENTS)
    paths = session.posargs or LINT_PATHS
    failed = []
    # the format check names the files (`ruff format --diff PATH` shows the changes)
    for command in (["check", "--no-fix"], ["format", "--check", "--output-format", "concise"]):
        try:
            session.run("ruff", *command, *paths)
        except CommandFailed:
            failed.append("ruff " + " ".join(command))
    if not session.posargs:
        try:
            session.run("mypy", *TYPED_PATHS)
        except CommandFailed:
            failed.append("mypy")
    if failed:
        session.error("failed: " + ", ".join(failed))


@nox.session(name="upstream-tests")
def upstream_tests(session: nox.Session) -> None:
    """Upstream vLLM's test suite against the built wheel in host emulation, judged by
    the patch set's upstream-expectations.toml: `nox -s upstream-tests [-- --selection fast] [-- PATHS]`."""
    _install_test_requirements(session)
    _install_built_wheel(session)
    _upstream_conformance(
        session, "--summary", str(ROOT / ".work" / "upstream" / "summary.json"), *session.posargs
    )


@nox.session
def patches(session: nox.Session) -> None:
    """`check` (lint + freshness, default), `lint`, or `export` (work tree -> patches/)."""
    _builder(session, "patches", *(session.posargs or ["check"]))


@nox.session
def tree(session: nox.Session) -> None:
    """Prepare work/<patch-set> and install it editable into .venv-dev (--no-install to skip)."""
    args = [a for a in session.posargs if a != "--no-install"]
    _install_torch(session)
    session.install("-r", BUILD_REQUIREMENTS)
    _builder(session, "tree", *args)
    if "--no-install" in session.posargs:
        return
    chosen = next((args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--patch-set"), None)
    patch_set, version = _patch_set_version(chosen)
    venv = ROOT / ".venv-dev"
    python = str(venv / "bin" / "python")
    if not venv.exists():
        session.run("python", "-m", "venv", str(venv))
    _install_torch(session, python)
    session.run(python, "-m", "pip", "install", "-r", BUILD_REQUIREMENTS, external=True)
    env = {
        "VLLM_TARGET_DEVICE": "empty",
        "VLLM_VERSION_OVERRIDE": version,
        "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
    }
    session.run(
        python,
        "-m",
        "pip",
        "install",
        "--no-build-isolation",
        "-e",
        str(ROOT / "work" / patch_set),
        external=True,
        env=env,
    )
    session.log(f"editable install ready: {venv}/bin/python, {venv}/bin/vllm")


@nox.session(name="npu-smoke", venv_backend="none")
def npu_smoke(session: nox.Session) -> None:
    """On an Ascend host, first: the torch_npu and CANN behaviour this distribution takes from
    documents and hardware reports, checked on the device against the reference kernels
    (tests/npu/smoke.py). Runs in the current environment (install the wheel with its ``npu``
    extra first); says why and passes where there is no NPU. Args: names of checks."""
    session.run("python", "-m", "tests.npu.smoke", *session.posargs, external=True)


@nox.session
def rebase(session: nox.Session) -> None:
    """Try the series on another upstream version: `nox -s rebase -- 0.33.0`."""
    if not session.posargs:
        session.error("name the target upstream version: nox -s rebase -- 0.33.0")
    _builder(session, "rebase", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks, each side by side in one run: `nox -s bench -- NAME [ARGS]`; with no NAME,
    the list of them and what each measures (from build/ascend_builder/bench.py and the
    programs in benchmarks/)."""
    names = benchmarks()
    if not session.posargs or session.posargs[0] not in names:
        for name, summary in names.items():
            session.log(f"{name:<11} {summary}")
        session.error("name a benchmark (listed above): nox -s bench -- NAME [ARGS]")
    _install_torch(session)
    session.install("-r", BUILD_REQUIREMENTS)
    if session.posargs[0] == "build":
        _builder(session, "bench", *session.posargs)
        return
    _install_built_wheel(session)
    session.run(
        "python",
        str(benchmark_script(session.posargs[0])),
        *session.posargs[1:],
        env={"VLLM_ASCEND_EMULATE": "1"},
    )


if os.environ.get("CI"):
    nox.options.reuse_venv = "no"
