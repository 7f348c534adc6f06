"""Model Runner V2 on Ascend (opt-in): what it refuses at start-up, and the per-request
refusal of sampling options whose V2 kernels have no Ascend form yet (a clear error for
that request instead of a failed engine step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.sampling_params import SamplingParams

from vllm.ascend.errors import AscendConfigError
from vllm.ascend.platform.npu import NPUPlatform, _check_v2_supported


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


def test_requests_v2_cannot_sample_yet_get_an_error(monkeypatch):
    params = SamplingParams(thinking_token_budget=8)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="thinking_token_budget"):
        NPUPlatform.validate_request(None, params)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    NPUPlatform.validate_request(None, params)  # the V1 runner takes it


def test_plain_requests_pass_on_v2(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    for params in (
        dict(),
        dict(temperature=0.7, top_p=0.9, top_k=5, seed=3),
        dict(presence_penalty=0.5, repetition_penalty=1.2, logit_bias={1: 2.0}, min_tokens=3, min_p=0.1),
        dict(logprobs=2, prompt_logprobs=1, bad_words=["x"]),
    ):
        NPUPlatform.validate_request(None, SamplingParams(**params))
