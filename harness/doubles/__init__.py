"""The doubles and the recorder: directories a child process gets first on its
``PYTHONPATH`` (``torch_npu_wheel.double_env()`` for the torch_npu double). Each rule of
the torch_npu double cites its source; docs/contract_double.md describes it."""

from pathlib import Path

HERE = Path(__file__).resolve().parent
TORCH_NPU_SITE = HERE / "torch_npu_site"
LLM_DATADIST_SITE = HERE / "llm_datadist_site"
COLLECTIVE_RECORDER = HERE / "collective_recorder"
