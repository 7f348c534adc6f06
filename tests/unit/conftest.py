"""Unit tests of the runtime code (overlay/vllm/ascend/<room>/ -> tests/unit/<room>/):
no vLLM engine is started; seconds to a few minutes per module. They run against the
built wheel (``nox -s tests``) or against the maintainer work tree installed editable
(``nox -s unit``, no wheel build).
"""

from __future__ import annotations

import os

import pytest

try:
    import vllm  # noqa: F401  (first: its bootstrap hides a CANN-less torch_npu)
except ImportError:  # pragma: no cover - the builder-only environment
    pytest.skip("vllm is not installed in this environment", allow_module_level=True)

# Some unit tests build vLLM configs in this process: vLLM's current platform must be host
# emulation, set before anything (a test module's imports included) resolves it. Set after
# the bootstrap above: with it set there, the bootstrap would leave torch_npu (the contract
# double) unloaded, and the NPU kernel tests need it.
_EMULATE_SET_HERE = "VLLM_ASCEND_EMULATE" not in os.environ
os.environ.setdefault("VLLM_ASCEND_EMULATE", "1")


def pytest_configure(config):
    # A pytest-xdist controller that loaded this file for its arguments (`pytest tests/unit
    # -n 2`) runs no test; its workers must not inherit the variable, or their first vLLM
    # import would leave the contract double unloaded and skip every NPU-kernel test.
    distributed = getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")
    if distributed and _EMULATE_SET_HERE:
        os.environ.pop("VLLM_ASCEND_EMULATE", None)
