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
os.environ.setdefault("VLLM_ASCEND_EMULATE", "1")
