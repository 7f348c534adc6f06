"""First code to run on ``import vllm`` (hook: patch 0003), before anything imports torch.

Two problems with torch_npu on a host that has it installed but has no CANN (any
development or CI machine, and every host-emulation run):

* torch imports installed device backends during ``import torch``; torch_npu's
  import raises there and takes ``import torch`` -- and every ``vllm`` command,
  even ``vllm --version`` -- down with it. So the auto-load is switched off unless
  the user set ``TORCH_DEVICE_BACKEND_AUTOLOAD`` themselves.
* libraries such as transformers see torch_npu installed and import it without
  catching the error. So torch_npu is imported once, here, through the device
  layer; if that fails it is marked absent for the rest of the process.
"""

import os
import sys

AUTOLOAD_VARIABLE = "TORCH_DEVICE_BACKEND_AUTOLOAD"

if "torch" not in sys.modules:
    os.environ.setdefault(AUTOLOAD_VARIABLE, "0")

from vllm.ascend.device import npu_runtime  # noqa: E402

npu_runtime.load_torch_npu()
