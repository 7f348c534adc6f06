"""Stub of ``torch_npu.npu._backends``: the SoC the double pretends to be.

``TORCH_NPU_DOUBLE_SOC`` is ``A2`` (default, Atlas A2 / 910B) or ``A3`` (910_93).
The numbers are the SoC enumeration values torch_npu compares against (its meta
functions treat 260 and above as Ascend 950).
"""

import os

SOC_VERSIONS = {"A2": 220, "A3": 250}


def get_soc_version() -> int:
    name = os.environ.get("TORCH_NPU_DOUBLE_SOC", "A2")
    if name not in SOC_VERSIONS:
        raise ValueError(f"TORCH_NPU_DOUBLE_SOC must be one of {sorted(SOC_VERSIONS)}, got {name!r}")
    return SOC_VERSIONS[name]
