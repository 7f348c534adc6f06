"""Stub of ``torch_npu.npu._backends``: the SoC the double pretends to be.

``TORCH_NPU_DOUBLE_SOC`` is ``A2`` (default, Atlas A2 / 910B) or ``A3`` (910_93).
The numbers are values of torch_npu's ``c10_npu::SocVersion`` enumeration
(``torch_npu/csrc/core/npu/NPUVariables.h``: ``Ascend910B1 = 220, Ascend910B2,
Ascend910B2C, Ascend910B3, Ascend910B4, Ascend910B4_1`` and ``Ascend910_9391 = 250,
Ascend910_9392, Ascend910_9381, ...``), which ``torch_npu.npu.get_soc_version()``
returns: A2 is an Ascend910B3 (223, the part ``get_device_name`` names), A3 an
Ascend910_9391 (250). vllm-ascend maps them the same way (``vllm_ascend/__init__.py``:
``ASCEND_A2_SOC_VERSION = range(220, 226)``, ``ASCEND_A3_SOC_VERSION = range(250, 256)``).
torch_npu's meta functions treat 260 and above as Ascend 950.
"""

import os

SOC_VERSIONS = {"A2": 223, "A3": 250}


def get_soc_version() -> int:
    name = os.environ.get("TORCH_NPU_DOUBLE_SOC", "A2")
    if name not in SOC_VERSIONS:
        raise ValueError(f"TORCH_NPU_DOUBLE_SOC must be one of {sorted(SOC_VERSIONS)}, got {name!r}")
    return SOC_VERSIONS[name]
