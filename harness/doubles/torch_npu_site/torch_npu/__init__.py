"""torch_npu contract double (test code; never shipped in the wheel).

Stands in for torch_npu 2.14.0 on hosts without CANN so the distribution's NPU
code paths run end to end on the CPU: the exact op schemas the real wheel
registers, the documented preconditions (each citing its source), the documented
semantics in plain torch, and torch_npu's own meta functions checking every
result. Put ``harness/doubles/torch_npu_site`` first on ``PYTHONPATH`` and set
``TORCH_NPU_DOUBLE_WHEEL`` to the pinned wheel (``harness/doubles/torch_npu_wheel.py``).

Passing the double means "passes the torch_npu contract", not "works on an NPU":
kernel numerics, NZ formats, HCCL and performance are out of its reach.
"""

import sys

import torch as _torch

from . import (
    _contract,
    npu,  # noqa: F401  (device runtime stub)
)
from ._rules import ContractViolation  # noqa: F401

IS_CONTRACT_DOUBLE = True

# Non-native dtype codes torch_npu exposes as module constants (values as its meta functions use them).
int4, hifloat8, float8_e8m0fnu, float4_e2m1fn_x2, float4_e1m2fn_x2 = 285, 290, 293, 296, 297

_contract.install(sys.modules[__name__])

# The wheel's lazy NNAL guard on the ATB names (TORCH_NPU_DOUBLE_NNAL=0: a host without NNAL).
from .op_plugin.atb import _atb_ops  # noqa: E402

_atb_ops.guard_exports(sys.modules[__name__])

# As torch_npu does at import: the PrivateUse1 backend is called "npu" and torch.npu is
# the device module (no kernels are registered for it: tensors stay on the CPU). Only
# when the double pretends NPUs exist: with the backend named, torch takes "npu" for
# the current accelerator, and device-generic calls (torch.Event()) in host-emulation
# processes that run the NPU kernels on the CPU would fail.
if npu.device_count() > 0:
    _torch.utils.rename_privateuse1_backend("npu")
    _torch._register_device_module("npu", npu)
