"""The runner choice on Ascend: Model Runner V2 by default, V1 (named by upstream's
fallback warning) for what the Ascend V2 runner does not run yet, and an explicit V2
that cannot run refused in one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.ascend.errors import AscendConfigError
from vllm.ascend.platform.npu import NPUPlatform, _check_runner, v2_unsupported_features

PROMPT_EMBEDS = SimpleNamespace(enable_prompt_embeds=True, uses_mrope=False)
MROPE = SimpleNamespace(enable_prompt_embeds=False, uses_mrope=True)
NGRAM = SimpleNamespace(method="ngram")


def _config(v2=True, pcp=1, dcp=1, spec=None, kv=None, model=None, watermark=None):
    return SimpleNamespace(
        use_v2_model_runner=v2,
        model_config=model,
        parallel_config=SimpleNamespace(prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp),
        speculative_config=spec,
        kv_transfer_config=kv,
        watermark_config=watermark,
        attention_config=SimpleNamespace(hisparse_config=None),
    )


@pytest.mark.parametrize(
    "config",
    [
        _config(),
        _config(spec=SimpleNamespace(method="mtp")),  # end to end: tests/engine/test_mtp.py
        _config(spec=NGRAM),  # end to end: tests/engine/test_model_runner_v2.py
        _config(spec=SimpleNamespace(method="draft_model")),  # (the same)
        _config(spec=SimpleNamespace(method="eagle")),  # (the same)
        _config(model=PROMPT_EMBEDS),  # (the same)
        _config(model=MROPE),  # the torch form of its positions kernel: tests/unit/kernels
        _config(kv=object()),  # tests/engine/test_pd_serving.py
        _config(pcp=2),  # KV sharded over PCP x DCP: tests/engine/test_context_parallel.py
        _config(dcp=2),
        _config(pcp=2, dcp=2),
    ],
)
def test_what_runs_on_v2(config):
    assert v2_unsupported_features(config) == []
    _check_runner(config)


@pytest.mark.parametrize(
    "config, named",
    [
        (_config(spec=SimpleNamespace(method="eagle3")), "speculative method 'eagle3'"),
        (_config(spec=SimpleNamespace(method="medusa")), "speculative method 'medusa'"),
    ],
)
def test_what_v2_does_not_run_yet(config, named):
    # the default choice falls back to V1 naming it (upstream's warning lists the platform's)
    [feature] = NPUPlatform.model_runner_v2_unsupported_features(config)
    assert named in feature
    _check_runner(SimpleNamespace(**{**vars(config), "use_v2_model_runner": False}))
    # asked for explicitly: refused in one line that says how to get V1
    with pytest.raises(AscendConfigError) as err:
        _check_runner(config)
    message = str(err.value)
    assert named in message and "VLLM_USE_V2_MODEL_RUNNER" in message and "\n" not in message


def test_watermarking_is_refused_on_either_runner():
    # upstream runs it on V2 only (its choice overrides VLLM_USE_V2_MODEL_RUNNER=0)
    with pytest.raises(AscendConfigError, match="watermarking"):
        _check_runner(_config(watermark=object()))


def test_runner_choice_error_from_upstream_is_one_line():
    class Refusing(SimpleNamespace):
        @property
        def use_v2_model_runner(self):
            raise ValueError("HiSparse requires Model Runner V2; remove VLLM_USE_V2_MODEL_RUNNER=0.")

    with pytest.raises(AscendConfigError, match="HiSparse"):
        _check_runner(Refusing())
