"""Sleep mode (worker/sleep.py) as RL frameworks drive it through the LLM API, in one
runner process with two engines:

- the tiny Qwen2 in host emulation (float32), whose greedy tokens equal transformers':
  level 1 and wake-up; level 2 woken without a reload (the weights must be gone: the
  tokens change); level 2, wake the weights, reload them from the checkpoint, wake the
  KV cache (the tokens are back); an invalid level (the engine must not stay paused);
- the tiny DeepSeek-V3 with the NPU MLA kernel's latent size (MLA, MoE, weights
  derived at load time) in NPU-path mode, bfloat16, through the torch_npu contract
  double, its engine core a process of its own (as behind ``vllm serve``): level 1,
  then level 2 with a reload.

The oracle of every wake-up is the engine's own tokens before its first sleep. The
released memory is what the device layer measures (in host emulation: the process's
resident memory), printed with the figures of each sleep."""

from __future__ import annotations

import pytest

from tests.support.engines import IN_PROCESS, clean_shutdown, run_spec
from tests.support.models import MLA512
from tests.support.oracle import hf_greedy
from tests.support.prompts import PROMPTS

MAX_TOKENS = 12
KV_CACHE_MB = 64  # the KV cache each engine allocates (VLLM_ASCEND_HOST_KV_CACHE_MB)


def _call(method: str, *args, **kwargs) -> dict:
    return {"method": method, "args": list(args), "kwargs": kwargs}


REPORT = _call("collective_rpc", "sleep_report")
SLEEPING = _call("llm_engine.is_sleeping")
RELOAD = [
    _call("wake_up", tags=["weights"]),
    SLEEPING,
    _call("collective_rpc", "reload_weights"),
    _call("wake_up", tags=["kv_cache"]),
]

# batch name -> the calls made before it (the batch itself: PROMPTS, greedy)
QWEN2_STEPS = {
    "before": [],
    "level1": [_call("sleep", level=1), SLEEPING, REPORT, _call("wake_up"), SLEEPING],
    "level2_no_reload": [_call("sleep", level=2), REPORT, _call("wake_up")],
    "level2_reload": [_call("sleep", level=2), *RELOAD, SLEEPING],
    "bad_level": [_call("sleep", level=3), SLEEPING],
}
DEEPSEEK_STEPS = {
    "before": [],
    "level1": [_call("sleep", level=1), SLEEPING, REPORT, _call("wake_up"), SLEEPING],
    "level2_reload": [_call("sleep", level=2), REPORT, *RELOAD],
}


def _run(model, steps: dict, engine: dict, env: dict) -> dict:
    # env: IN_PROCESS keeps the engine core in the runner process; without it, the engine
    # core is a process of its own, which binds the kernels its VLLM_ASCEND_KERNELS names
    return {
        "model": str(model),
        "engine": {"max_model_len": 256, "seed": 0, "enable_sleep_mode": True, **engine},
        "batches": [PROMPTS] * len(steps),
        "calls": list(steps.values()),
        "max_tokens": MAX_TOKENS,
        "env": {"VLLM_ASCEND_HOST_KV_CACHE_MB": str(KV_CACHE_MB), **env},
    }


@pytest.fixture(scope="module")
def engines(tiny_models):
    spec = {
        "runs": [
            _run(tiny_models["qwen2"], QWEN2_STEPS, {"dtype": "float32"}, IN_PROCESS),
            _run(tiny_models[MLA512], DEEPSEEK_STEPS, {"dtype": "bfloat16"}, {"VLLM_ASCEND_KERNELS": "npu"}),
        ]
    }
    result, output = run_spec(spec)
    qwen2, deepseek = result["runs"]
    named = {
        "qwen2": (dict(zip(QWEN2_STEPS, qwen2["batches"])), dict(zip(QWEN2_STEPS, qwen2["call_results"]))),
        "deepseek_v3": (
            dict(zip(DEEPSEEK_STEPS, deepseek["batches"])),
            dict(zip(DEEPSEEK_STEPS, deepseek["call_results"])),
        ),
    }
    for name, (_, calls) in named.items():
        for step, results in calls.items():
            for r in results:
                if isinstance(r["result"], list) and r["result"] and isinstance(r["result"][0], dict):
                    print(f"{name} {step}: {r['result'][0]}")  # the sleep figures
    return named, output


def _tokens(batch) -> list[list[int]]:
    return [c["token_ids"] for c in batch]


def _errors(calls: list[dict]) -> list[str]:
    return [c["error"] for c in calls if c["error"] is not None]


def test_tokens_before_sleep_equal_transformers(engines, tiny_models):
    named, _ = engines
    batches, _ = named["qwen2"]
    assert _tokens(batches["before"]) == hf_greedy(tiny_models["qwen2"], PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize(
    "model,step",
    [
        ("qwen2", "level1"),
        ("qwen2", "level2_reload"),
        ("deepseek_v3", "level1"),
        ("deepseek_v3", "level2_reload"),
    ],
)
def test_wake_up_gives_the_tokens_of_before_sleep(engines, model, step):
    named, _ = engines
    batches, calls = named[model]
    assert _errors(calls[step]) == []
    assert _tokens(batches[step]) == _tokens(batches["before"])


def test_level1_keeps_weights_on_host_and_releases_the_kv_cache(engines):
    named, _ = engines
    for model in ("qwen2", "deepseek_v3"):
        _, calls = named[model]
        sleeping, report, awake = calls["level1"][1], calls["level1"][2], calls["level1"][4]
        assert sleeping["result"] is True and awake["result"] is False
        [figures] = report["result"]
        assert figures["level"] == 1 and figures["asleep"] == ["kv_cache", "weights"]
        # the whole KV cache: the configured budget, rounded down to whole blocks
        assert 0.95 * (KV_CACHE_MB << 20) <= figures["released"]["kv_cache"] <= KV_CACHE_MB << 20, figures
        assert figures["released"]["weights"] > 0
        # level 1 keeps every byte of the weights on the host
        assert figures["copied_to_host"] == figures["released"]["weights"], figures
        # the device layer saw the KV cache go (the weights moved to host memory, which in
        # host emulation is the same memory)
        drop = figures["device_in_use_before"] - figures["device_in_use_after"]
        assert drop >= 0.9 * figures["released"]["kv_cache"], figures


def test_level2_discards_the_weights_until_they_are_reloaded(engines):
    named, _ = engines
    batches, calls = named["qwen2"]
    [figures] = calls["level2_no_reload"][1]["result"]
    assert figures["level"] == 2
    # only buffers (rotary tables) go to the host: the parameters are discarded
    assert 0 < figures["copied_to_host"] < figures["released"]["weights"] / 4, figures
    # woken without a reload, the parameters are zeros: the tokens must change
    assert _tokens(batches["level2_no_reload"]) != _tokens(batches["before"])
    # after the weights woke, the engine still sleeps (its KV cache does) until all is back
    sleeping_after_weights = calls["level2_reload"][2]
    assert sleeping_after_weights["result"] is True
    assert calls["level2_reload"][-1]["result"] is False


def test_a_refused_sleep_leaves_the_engine_running(engines):
    named, _ = engines
    batches, calls = named["qwen2"]
    refused, sleeping = calls["bad_level"]
    assert refused["error"] is not None and "sleep level must be 1 or 2" in refused["error"]
    assert sleeping["result"] is False
    assert _tokens(batches["bad_level"]) == _tokens(batches["before"])


def test_engines_shut_down_cleanly(engines):
    _, output = engines
    clean_shutdown(output)
