"""The wheel's lazy NNAL guard for ATB ops (``torch_npu/op_plugin/atb/_atb_ops.py``).

torch_npu 2.14.0 loads ``lib/libop_plugin_atb.so`` at import inside ``try``; that
library links NNAL's ``libatb.so``, which the loader finds only after NNAL's
``set_env.sh`` ran. A failure is not raised at import: the wheel keeps

    NNAL_EX = OSError(e.errno, nnal_strerror)   # the message below
    GLOBAL_E = e                                 # the loader's error

and exports every ATB name (``torch_npu._npu_reshape_and_cache``, ``torch_npu.atb.*``)
as a lazy function that first calls ``_register_atb_extensions()``, which does
``raise NNAL_EX from GLOBAL_E``. So a host without NNAL imports torch_npu fine and
dies at the first ATB call -- for an MLA model, the first KV-cache write.

``TORCH_NPU_DOUBLE_NNAL=0`` makes the double a host without NNAL: the same module
attributes, the same lazy wrappers, the same exception (type, errno, message, cause).
Default ``1``: NNAL present. Unlike the wheel, ``torch.ops.atb`` keeps its schemas
either way (the double registers them from ``schemas.json``); the project calls ATB
ops only through the exported names. ``tests/npu_contract/test_nnal.py`` checks the
messages against the pinned wheel's file.
"""

from __future__ import annotations

import os
import sys
import types
from functools import lru_cache, wraps

NNAL_VARIABLE = "TORCH_NPU_DOUBLE_NNAL"
# The wheel's messages (its _atb_ops.py builds them from two string pieces each).
MISSING = (
    "Please check that the nnal package is installed. "
    "Please run 'source set_env.sh' in the NNAL installation path."
)
LOADER_ERROR = "libatb.so: cannot open shared object file: No such file or directory"

NNAL_EX: OSError | None = None
GLOBAL_E: OSError | None = None

if os.environ.get(NNAL_VARIABLE, "1").strip() == "0":
    GLOBAL_E = OSError(LOADER_ERROR)  # what ctypes raises for a missing dependency (errno None)
    if "libatb.so" in str(GLOBAL_E):
        NNAL_EX = OSError(GLOBAL_E.errno, MISSING)


@lru_cache(None)
def _register_atb_extensions() -> None:
    if NNAL_EX is not None:
        raise NNAL_EX from GLOBAL_E


def _lazy(fn):
    @wraps(fn)
    def wrapper(*args, **kwargs):
        _register_atb_extensions()
        return fn(*args, **kwargs)

    return wrapper


def guard_exports(module: types.ModuleType) -> None:
    """Without NNAL, wrap the exported ATB names as the wheel does (``torch_npu.<name>``
    for its ``API_LIST``, ``torch_npu.atb.<name>`` for its ``ATB_API_LIST``)."""
    if NNAL_EX is None:
        return
    import torch

    atb = sys.modules["torch_npu.atb"]
    for target in (module, atb):
        for name, value in list(vars(target).items()):
            if isinstance(value, torch._ops.OpOverloadPacket) and value._qualified_op_name.startswith(
                "atb::"
            ):
                setattr(target, name, _lazy(value))
