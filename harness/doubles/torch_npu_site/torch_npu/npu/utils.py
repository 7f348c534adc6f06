"""Stub of ``torch_npu.npu.utils``: the CANN version the double pretends to run on, and the
``_dummy_type`` torch_npu's graph code imports.

``TORCH_NPU_DOUBLE_CANN_VERSION`` (default 8.5.0, the newest CANN torch_npu's own
README pairs with it) decides version-gated branches of torch_npu's meta functions.
"""

import os


def get_cann_version(module: str = "CANN") -> str:
    return os.environ.get("TORCH_NPU_DOUBLE_CANN_VERSION", "8.5.0")


def _is_gte_cann_version(version: str, module: str = "CANN") -> bool:
    def key(v):
        return [int(p) if p.isdigit() else p for p in v.replace("RC", ".RC").split(".")]

    return key(get_cann_version(module)) >= key(version)


def _dummy_type(name: str) -> type:
    def refuse(self, *args, **kwargs):
        raise RuntimeError(f"Tried to instantiate dummy base class {type(self).__name__}")

    return type(name, (object,), {"__init__": refuse})
