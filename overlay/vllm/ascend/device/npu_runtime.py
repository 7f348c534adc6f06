"""The only module that imports torch_npu.

``load_torch_npu()`` imports it at most once per process. When the import fails
(typically: torch_npu installed, CANN missing, ``libhccl.so`` not found), the
reason is kept for error messages and ``collect-env``, and the package is marked
absent (``sys.modules["torch_npu"] = None``) so that later probes by other
libraries see "not installed" instead of crashing.
"""

from __future__ import annotations

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
