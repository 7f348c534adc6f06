"""Engine tests: host emulation of the Ascend platform, real vLLM processes (``LLM`` by
harness/vllm_runner.py, ``vllm serve``), minutes each.

Needs the built wheel installed (``nox -s tests`` does that). Tiny models are made by
examples/make_tiny_model.py into a session temp dir (the ``tiny_models`` fixture of
tests/conftest.py); Hugging Face transformers' greedy ``generate`` is the oracle
(tests/support/oracle.py). Helpers: tests/support/.
"""

from __future__ import annotations

import pytest

try:
    import vllm  # noqa: F401  (first: its bootstrap hides a CANN-less torch_npu)
except ImportError:  # pragma: no cover - the builder-only environment
    pytest.skip("vllm (the built wheel) is not installed in this environment", allow_module_level=True)
