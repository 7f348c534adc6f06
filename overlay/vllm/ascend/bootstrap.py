"""First code to run on ``import vllm`` (hook: patch
``vllm-run-the-ascend-bootstrap-before-anything-imports-torch``), before anything imports torch.

Two problems with torch_npu on a host that has it installed but has no CANN:

* torch imports installed device backends during ``import torch``; torch_npu's
  import raises there and takes ``import torch`` -- and every ``vllm`` command,
  even ``vllm --version`` -- down with it. So the auto-load is switched off unless
  the user set ``TORCH_DEVICE_BACKEND_AUTOLOAD`` themselves.
* libraries such as transformers see torch_npu installed and import it without
  catching the error. So torch_npu is imported once, here, through the device
  layer; if that fails it is marked absent for the rest of the process.

(The wheel installs torch_npu only with its ``npu`` extra, so a CPU host normally has
none; these guards are for hosts that have one that cannot load.)

Host emulation with the reference kernels does not use torch_npu at all, so there it
is marked absent without being imported: importing it names torch's PrivateUse1
backend "npu", after which torch takes "npu" for the current accelerator and
device-generic calls such as ``torch.Event()`` fail on a host without NPUs.

In host emulation, Triton is marked absent as well (unless something imported it
already): vLLM disables Triton on this platform anyway (no Triton driver for the
host), but importing it leaves nanobind objects that complain at interpreter exit,
where host emulation skips the final collection (``device/host.py``).
"""

import logging
import os
import sys

AUTOLOAD_VARIABLE = "TORCH_DEVICE_BACKEND_AUTOLOAD"

if "torch" not in sys.modules:
    os.environ.setdefault(AUTOLOAD_VARIABLE, "0")

from vllm.ascend import envs  # noqa: E402
from vllm.ascend.device import npu_runtime  # noqa: E402

if envs.emulate() and "triton" not in sys.modules:
    sys.modules["triton"] = None  # type: ignore[assignment]
    # torch's CUDA build warns on import that flop counting misses Triton kernels when
    # Triton is absent; here it is absent on purpose, and the line would open every
    # command's output (one-line start-up errors among them)
    logging.getLogger("torch.utils.flop_counter").setLevel(logging.ERROR)

if envs.emulate() and envs.kernels() == "reference":
    npu_runtime.leave_torch_npu_unloaded("host emulation with the reference kernels does not use torch_npu")
else:
    npu_runtime.load_torch_npu()
