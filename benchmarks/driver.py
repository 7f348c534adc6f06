"""The shared driver of the NPU-path benchmarks (``launches``, ``graph``): an engine in a
child process of its own in NPU-path mode (host emulation with the torch_npu kernels of
the contract double), its result read back as JSON, and the op counting both use (which
dispatched ops launch a kernel; vLLM's own custom-op wrappers seen through)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# -- op counting (in the engine's process) -----------------------------------------------------
VLLM_OPS: dict = {}  # vLLM's custom-op wrappers: name -> the Python function registered for it


def record_vllm_ops() -> None:
    """Before vLLM registers its wrappers: remember each one's Python function, so the
    counter can run it under the counting mode (the dispatcher would hide its insides)."""
    from torch.library import Library

    impl = Library.impl

    def recording_impl(self, op_name, fn, *args, **kwargs):
        if self.ns == "vllm" and callable(fn):
            VLLM_OPS[op_name if isinstance(op_name, str) else op_name.__name__] = fn
        return impl(self, op_name, fn, *args, **kwargs)

    Library.impl = recording_impl


_ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


def _storages(value) -> set[int]:
    import torch

    if isinstance(value, torch.Tensor):
        return {value.untyped_storage().data_ptr()}
    if isinstance(value, (list, tuple)):
        return set().union(*(_storages(v) for v in value)) if value else set()
    return set()


def launches_kernel(func, name, args, kwargs, out) -> bool:
    """A kernel runs: the op writes its inputs (in-place, out=) or makes a tensor whose
    memory is new (a view, a no-op cast, an allocation launch nothing)."""
    if name in _ALLOCATIONS:
        return False
    if func._schema.is_mutable:
        return True
    return bool(_storages(out) - _storages(list(args) + list(kwargs.values())))


def call_site(skip_file: str, with_line: bool = True) -> str:
    """The first caller outside torch, the double and ``skip_file`` (the benchmark's own
    counting code): ``module.function[:line]``."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and "/torch_npu_site/" not in path and path != skip_file:
            module = path.rsplit("/vllm/", 1)[-1].removesuffix(".py").replace("/", ".")
            site = f"{module}.{frame.f_code.co_name}"
            return f"{site}:{frame.f_lineno}" if with_line else site
        frame = frame.f_back
    return "?"


# -- the driver --------------------------------------------------------------------------------
def make_tiny_model(args: list[str], base: Path) -> Path:
    """examples/make_tiny_model.py with ``args``, under ``base`` (made once per argument list)."""
    out = base / "_".join(a.lstrip("-") for a in args)
    if not out.exists():
        script = str(ROOT / "examples" / "make_tiny_model.py")
        subprocess.run(
            [sys.executable, script, *args, "--out", str(out)], check=True, stdout=subprocess.DEVNULL
        )
    return out


def npu_path_env(**extra: str) -> dict:
    """The environment of an engine in NPU-path mode: host emulation with the torch_npu
    kernels of the contract double, the engine core in the benchmark's process."""
    sys.path.insert(0, str(ROOT))
    from harness.doubles.torch_npu_wheel import double_env

    return {
        **os.environ,
        **double_env(),
        "VLLM_ASCEND_EMULATE": "1",
        "VLLM_ASCEND_KERNELS": "npu",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        **extra,
    }


def run_child(script: str, spec: dict, env: dict, timeout: int, what: str) -> dict:
    """``script --child SPEC`` in a process of its own; the JSON of its ``RESULT`` line."""
    proc = subprocess.run(
        [sys.executable, script, "--child", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
