"""The Ascend worker builds Model Runner V2 only: what it runs passes the start-up check,
and everything upstream would move to its V1 runner is refused in one line that names
why (upstream's own list of V2 gaps is asked for real)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import vllm.envs as vllm_envs
from vllm.config import VllmConfig

from vllm.ascend.errors import AscendConfigError
from vllm.ascend.platform.npu import _check_runner, v2_unsupported_features

PROMPT_EMBEDS = SimpleNamespace(enable_prompt_embeds=True, uses_mrope=False)
MROPE = SimpleNamespace(enable_prompt_embeds=False, uses_mrope=True)


def _spec(method, parallel_drafting=False):
    return SimpleNamespace(method=method, parallel_drafting=parallel_drafting, use_heterogeneous_vocab=False)


class _Config(SimpleNamespace):
    def _get_v2_model_runner_unsupported_features(self):
        return VllmConfig._get_v2_model_runner_unsupported_features(self)


def _config(pcp=1, dcp=1, spec=None, kv=None, model=None, watermark=None, backend="mp", pp=1):
    return _Config(
        model_config=model,
        parallel_config=SimpleNamespace(
            prefill_context_parallel_size=pcp,
            decode_context_parallel_size=dcp,
            distributed_executor_backend=backend,
            pipeline_parallel_size=pp,
            use_ubatching=False,
        ),
        speculative_config=spec,
        kv_transfer_config=kv,
        watermark_config=watermark,
        attention_config=SimpleNamespace(hisparse_config=None),
    )


@pytest.fixture(autouse=True)
def _runner_env_unset(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    if hasattr(vllm_envs.__getattr__, "cache_clear"):
        vllm_envs.__getattr__.cache_clear()


@pytest.mark.parametrize(
    "config",
    [
        _config(),
        _config(spec=_spec("mtp")),  # end to end: tests/engine/test_mtp.py
        _config(spec=_spec("ngram")),  # end to end: tests/engine/test_model_runner_v2.py
        _config(spec=_spec("draft_model")),  # (the same)
        _config(spec=_spec("eagle")),  # (the same)
        _config(model=PROMPT_EMBEDS),  # (the same)
        _config(model=MROPE),  # the torch form of its positions kernel: tests/unit/kernels
        _config(kv=object()),  # tests/engine/test_pd_serving.py
        _config(pcp=2),  # KV sharded over PCP x DCP: tests/engine/test_context_parallel.py
        _config(dcp=2),
        _config(pcp=2, dcp=2),
    ],
)
def test_what_runs(config):
    assert v2_unsupported_features(config) == []
    _check_runner(config)


@pytest.mark.parametrize(
    "config, named",
    [
        (_config(spec=_spec("eagle3")), "speculative method 'eagle3'"),
        (_config(spec=_spec("medusa")), "speculative method 'medusa'"),
        # upstream names this one too: said once
        (_config(spec=_spec("suffix")), "speculative method 'suffix'"),
        # upstream's own gaps
        (_config(spec=_spec("eagle", parallel_drafting=True)), "parallel drafting"),
        (_config(backend="external_launcher", pp=2), "pipeline parallelism with external_launcher"),
    ],
)
def test_what_does_not_run_is_refused_in_one_line(config, named):
    with pytest.raises(AscendConfigError) as err:
        _check_runner(config)
    message = str(err.value)
    assert named in message and "\n" not in message, message
    assert message.count(named) == 1, message
    if "speculative method" in named:  # says which methods do run
        assert "mtp" in message and "eagle" in message, message


def test_asking_for_the_v1_runner_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    if hasattr(vllm_envs.__getattr__, "cache_clear"):
        vllm_envs.__getattr__.cache_clear()
    with pytest.raises(AscendConfigError, match="VLLM_USE_V2_MODEL_RUNNER") as err:
        _check_runner(_config())
    assert "\n" not in str(err.value)


def test_watermarking_and_hisparse_are_refused():
    with pytest.raises(AscendConfigError, match="watermarking"):
        _check_runner(_config(watermark=object()))
    hisparse = _config()
    hisparse.attention_config.hisparse_config = object()
    with pytest.raises(AscendConfigError, match="HiSparse"):
        _check_runner(hisparse)
