"""The only module that imports torch_npu.

``load_torch_npu()`` imports it at most once per process. When the import fails
(typically: torch_npu installed, CANN missing, ``libhccl.so`` not found), the
reason is kept for error messages and ``collect-env``, and the package is marked
absent (``sys.modules["torch_npu"] = None``) so that later probes by other
libraries see "not installed" instead of crashing.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

_loaded = False
_module: ModuleType | None = None
_failure: str | None = None


def load_torch_npu() -> ModuleType | None:
    """torch_npu if it imports on this host, else None (see ``failure_reason()``)."""
    global _loaded, _module, _failure
    if _loaded:
        return _module
    _loaded = True
    if sys.modules.get("torch_npu", ...) is None:
        _failure = "torch_npu was marked absent before vllm.ascend loaded it"
        return None
    try:
        spec = importlib.util.find_spec("torch_npu")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        _failure = "torch_npu is not installed"
        return None
    try:
        import torch_npu  # noqa: F401  (the one import of torch_npu in this distribution)

        _module = torch_npu
    except Exception as exc:  # ImportError without CANN; RuntimeError from a broken driver
        _failure = f"torch_npu is installed but cannot be imported: {exc}"
        for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
            del sys.modules[name]
        sys.modules["torch_npu"] = None  # type: ignore[assignment]
    return _module


def leave_torch_npu_unloaded(reason: str) -> None:
    """Mark torch_npu absent for this process without importing it."""
    global _loaded, _failure
    if _loaded or "torch_npu" in sys.modules:
        return
    _loaded, _failure = True, f"torch_npu not loaded: {reason}"
    sys.modules["torch_npu"] = None  # type: ignore[assignment]


def failure_reason() -> str | None:
    load_torch_npu()
    return _failure


# NNAL's default install path (vllm-ascend's install docs and examples source this file).
NNAL_SET_ENV = "/usr/local/Ascend/nnal/atb/set_env.sh"


def atb_failure() -> str | None:
    """Why torch_npu's ATB ops cannot run on this host (one line), or None.

    torch_npu 2.14.0 loads its ATB library (which links NNAL's ``libatb.so``) at
    import and keeps a failure for later (``torch_npu/op_plugin/atb/_atb_ops.py``:
    ``NNAL_EX``, raised ``from GLOBAL_E`` by the first ATB call). Reading that record
    touches no device runtime. A torch_npu without the record is not judged here, nor
    a process where torch_npu is absent (that is reported where torch_npu is needed)."""
    if load_torch_npu() is None:
        return None
    guard = sys.modules.get("torch_npu.op_plugin.atb._atb_ops")
    if guard is None:
        try:
            guard = importlib.import_module("torch_npu.op_plugin.atb._atb_ops")
        except ImportError:
            return None
    error = getattr(guard, "NNAL_EX", None)
    if error is None:
        return None
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    cause = getattr(guard, "GLOBAL_E", None)
    return f"{reason} ({cause})" if cause is not None else reason
