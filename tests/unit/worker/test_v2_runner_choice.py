"""Model Runner V2 on Ascend (opt-in): what it refuses at start-up, and the per-request
refusal of sampling options whose V2 kernels have no Ascend form yet (a clear error for
that request instead of a failed engine step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.sampling_params import SamplingParams

from vllm.ascend.errors import AscendConfigError
from vllm.ascend.platform.npu import NPUPlatform, _check_v2_supported


def _config(pcp=1, dcp=1, spec=None, kv=None):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp),
        speculative_config=spec,
        kv_transfer_config=kv,
        watermark_config=None,
        attention_config=SimpleNamespace(hisparse_config=None),
    )


def test_plain_configuration_runs_on_v2():
    _check_v2_supported(_config())


@pytest.mark.parametrize(
    "config, named",
    [
        (_config(dcp=2), "context parallelism"),
        (_config(pcp=2), "context parallelism"),
        (_config(spec=object()), "speculative decoding"),
        (_config(kv=object()), "KV transfer"),
    ],
)
def test_what_v2_does_not_run_yet_is_refused_in_one_line(config, named):
    with pytest.raises(AscendConfigError) as err:
        _check_v2_supported(config)
    message = str(err.value)
    assert named in message and "VLLM_USE_V2_MODEL_RUNNER" in message and "\n" not in message


def test_v2_with_the_npu_kernels_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_KERNELS", "npu")
    with pytest.raises(AscendConfigError, match="the NPU kernels"):
        _check_v2_supported(_config())


@pytest.mark.parametrize(
    "params, named",
    [
        (dict(presence_penalty=0.5), "penalties"),
        (dict(repetition_penalty=1.2), "penalties"),
        (dict(logit_bias={1: 2.0}), "logit_bias"),
        (dict(min_tokens=3), "min_tokens"),
        (dict(min_p=0.1), "min_p"),
        (dict(logprobs=2), "logprobs"),
        (dict(prompt_logprobs=1), "logprobs"),
        (dict(bad_words=["x"]), "bad_words"),
    ],
)
def test_requests_v2_cannot_sample_yet_get_an_error(monkeypatch, params, named):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match=named):
        NPUPlatform.validate_request(None, SamplingParams(**params))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    NPUPlatform.validate_request(None, SamplingParams(**params))  # the V1 runner takes them


def test_plain_requests_pass_on_v2(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    for params in (dict(), dict(temperature=0.7, top_p=0.9, top_k=5, seed=3), dict(temperature=0.0)):
        NPUPlatform.validate_request(None, SamplingParams(**params))
