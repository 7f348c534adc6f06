"""Model Runner V2 on Ascend (opt-in): what it refuses at start-up, in one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.ascend.errors import AscendConfigError
from vllm.ascend.platform.npu import _check_v2_supported


def _config(pcp=1, dcp=1, spec=None, kv=None, model=None):
    return SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp),
        speculative_config=spec,
        kv_transfer_config=kv,
        watermark_config=None,
        attention_config=SimpleNamespace(hisparse_config=None),
    )


def test_plain_configuration_runs_on_v2():
    _check_v2_supported(_config())


def test_mtp_runs_on_v2():
    # end to end: tests/engine/test_mtp.py (the v2_ runs)
    _check_v2_supported(_config(spec=SimpleNamespace(method="mtp")))


def test_kv_transfer_runs_on_v2():
    # end to end (V2 decode and V2 prefill beside V1 instances): tests/engine/test_pd_serving.py
    _check_v2_supported(_config(kv=object()))


@pytest.mark.parametrize(
    "config, named",
    [
        (_config(dcp=2), "context parallelism"),
        (_config(pcp=2), "context parallelism"),
        (_config(spec=SimpleNamespace(method="eagle3")), "speculative method 'eagle3'"),
        (_config(model=SimpleNamespace(enable_prompt_embeds=True, uses_mrope=False)), "prompt embeddings"),
        (_config(model=SimpleNamespace(enable_prompt_embeds=False, uses_mrope=True)), "M-RoPE"),
    ],
)
def test_what_v2_does_not_run_yet_is_refused_in_one_line(config, named):
    with pytest.raises(AscendConfigError) as err:
        _check_v2_supported(config)
    message = str(err.value)
    assert named in message and "VLLM_USE_V2_MODEL_RUNNER" in message and "\n" not in message


def test_v2_runs_with_the_npu_kernels(monkeypatch):
    # end to end through the contract double: tests/engine/test_npu_path.py
    monkeypatch.setenv("VLLM_ASCEND_KERNELS", "npu")
    _check_v2_supported(_config())
    with pytest.raises(AscendConfigError, match="context parallelism"):
        _check_v2_supported(_config(pcp=2))
