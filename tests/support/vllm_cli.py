"""The `vllm` CLI as a test starts it: its argv and environment, with or without host
emulation and with or without the contract double (a CPU host after the documented
install)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def vllm_command(
    *args: str,
    emulate: str | None = None,
    extra_env: dict | None = None,
    without_torch_npu: bool = False,
) -> tuple[list[str], dict]:
    """The `vllm` CLI's argv and environment."""
    exe = Path(sys.executable).with_name("vllm")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ASCEND_EMULATE"}
    if without_torch_npu:  # no contract double either: a CPU host after the documented install
        env.pop("PYTHONPATH", None)
    if emulate is not None:
        env["VLLM_ASCEND_EMULATE"] = emulate
    env.update(extra_env or {})
    return [str(exe) if exe.exists() else shutil.which("vllm"), *args], env
