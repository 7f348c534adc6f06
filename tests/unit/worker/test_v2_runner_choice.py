"""The Ascend model runner is upstream's Model Runner V2 (the only runner since 0.34): what
it runs passes the start-up check, what it does not is refused in one line that names why,
and asking for the removed V1 runner is refused as upstream refuses it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import vllm.envs as vllm_envs

from vllm.ascend.errors import AscendConfigError
from vllm.ascend.platform.checks import check_runner, v2_unsupported_features
from vllm.ascend.platform.npu import NPUPlatform

PROMPT_EMBEDS = SimpleNamespace(enable_prompt_embeds=True, uses_mrope=False)
MROPE = SimpleNamespace(enable_prompt_embeds=False, uses_mrope=True)


def _spec(method, parallel_drafting=False, adaptive=False):
    return SimpleNamespace(
        method=method,
        parallel_drafting=parallel_drafting,
        use_heterogeneous_vocab=False,
        enable_adaptive_verification=adaptive,
    )


def _config(
    pcp=1, dcp=1, spec=None, kv=None, model=None, watermark=None, backend="mp", pp=1, sharded_sampling=None
):
    return SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(
            prefill_context_parallel_size=pcp,
            decode_context_parallel_size=dcp,
            distributed_executor_backend=backend,
            pipeline_parallel_size=pp,
            use_ubatching=False,
            enable_batch_sharded_sampling=sharded_sampling,
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
        _config(model=MROPE),  # the torch form of its positions kernel: tests/unit/worker
        _config(kv=object()),  # tests/engine/test_pd_serving.py
        _config(pcp=2),  # KV sharded over PCP x DCP: tests/engine/test_context_parallel.py
        _config(dcp=2),
        _config(pcp=2, dcp=2),
    ],
)
def test_what_runs(config):
    assert v2_unsupported_features(config) == []
    check_runner(config)


@pytest.mark.parametrize(
    "config, named",
    [
        (_config(spec=_spec("eagle3")), "speculative method 'eagle3'"),
        (_config(spec=_spec("medusa")), "speculative method 'medusa'"),
        (_config(spec=_spec("suffix")), "speculative method 'suffix'"),
        # opt-in upstream paths whose Triton kernels have no torch form here
        (_config(spec=_spec("mtp", adaptive=True)), "adaptive verification"),
        (_config(sharded_sampling=True), "batch-sharded sampling"),
        (_config(model=SimpleNamespace(enable_trace_replay=True)), "trace replay"),
    ],
)
def test_what_does_not_run_is_refused_in_one_line(config, named):
    with pytest.raises(AscendConfigError) as err:
        check_runner(config)
    message = str(err.value)
    assert named in message and "\n" not in message, message
    assert message.count(named) == 1, message
    if "speculative method" in named:  # says which methods do run
        assert "mtp" in message and "eagle" in message, message


@pytest.mark.parametrize("value", ["0", "false"])
def test_asking_for_the_v1_runner_is_refused(monkeypatch, value):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    with pytest.raises(
        AscendConfigError, match=f"VLLM_USE_V2_MODEL_RUNNER={value} is no longer supported"
    ) as err:
        NPUPlatform.validate_environ(hard_fail=True)
    assert "\n" not in str(err.value)


def test_the_redundant_v2_switch_is_not_an_unknown_variable(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("VLLM_ASCEND_TEST")]:  # the suite's own
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    NPUPlatform.validate_environ(hard_fail=True)


def test_watermarking_and_hisparse_are_refused():
    with pytest.raises(AscendConfigError, match="watermarking"):
        check_runner(_config(watermark=object()))
    hisparse = _config()
    hisparse.attention_config.hisparse_config = object()
    with pytest.raises(AscendConfigError, match="HiSparse"):
        check_runner(hisparse)
