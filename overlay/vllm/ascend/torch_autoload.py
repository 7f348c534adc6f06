"""Keep ``import torch`` from auto-loading torch_npu; vllm.ascend loads it explicitly.

torch imports every installed device-backend extension on ``import torch``. When
torch_npu is installed but CANN is not (any CPU host: development, CI, host
emulation), that import raises and takes ``import torch`` -- and with it every
``vllm`` command, even ``vllm --version`` -- down with it. vllm imports this
module before torch (hook in ``vllm/__init__.py``), so it can switch the
auto-load off unless the user decided otherwise; the Ascend device layer then
imports torch_npu itself and reports a missing CANN as one clear message.
"""

import os
import sys

AUTOLOAD_VARIABLE = "TORCH_DEVICE_BACKEND_AUTOLOAD"

if "torch" not in sys.modules:
    os.environ.setdefault(AUTOLOAD_VARIABLE, "0")
