"""DeepSeek MTP speculative decoding in host emulation (float32), on the tiny DeepSeek-V3
with its one MTP layer: greedy output with k = 1 and k = 2 draft tokens must equal plain
greedy decoding token for token (Hugging Face transformers, which test_oracle holds
vLLM's plain decoding to) at batch 8 and batch 1, with chunked prefill and prefix
caching, under preemption, and with TP = 2 + expert parallelism (DP = 2 with MTP is in
test_dp_serving.py), every run with asynchronous scheduling (upstream's default); seeded
random sampling draws the same tokens with synchronous scheduling. DeepSeek-V3.2, whose
MTP layer has an indexer and sparse MLA of its own, runs k = 2 greedy and all-accepted;
Qwen3.5 (Gated DeltaNet layers verifying drafts) k = 2 greedy, all-accepted and
first-draft-accepted.

The tiny model's MTP layer is random, so its drafts are mostly rejected. A run that
accepts every draft (upstream's synthetic rejection mode) covers multi-token acceptance:
each verification step's bonus token must be the target's greedy choice after the
accepted drafts (a teacher-forced transformers oracle).

One process runs the single-rank engines one after another (module fixture); the TP and
DP cases start their own ranks.
"""

from __future__ import annotations

import pytest

from tests.support.engines import IN_PROCESS, RUNNER_LINE, clean_shutdown, run_spec
from tests.support.oracle import hf_greedy
from tests.support.prompts import PREFIX_PROMPTS, PROMPTS

MAX_TOKENS = 16
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "seed": 0,
    "disable_log_stats": False,
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 8,
    "enable_prefix_caching": True,
}
SINGLES = PROMPTS[:3]  # batch 1: one request at a time
# every attention build compares the host lengths it gives the kernels with the device's: a
# drafter step's host lengths must not count the rejected drafts (patch
# speculators-let-the-platform-take-rejected-drafts-off-host)
CHECKED = {"VLLM_ASCEND_CHECK_HOST_SEQ_LENS": "1"}
RANDOM_PROMPT = PROMPTS[4]


def mtp(k: int, **extra) -> dict:
    return {"method": "deepseek_mtp", "num_speculative_tokens": k, **extra}


def _tokens(batch: list[dict]) -> list[list[int]]:
    return [r["token_ids"] for r in batch]


# The single-rank engines run IN_PROCESS; the TP=2 test below keeps the engine core apart.
RUNS = {
    # Also returns the drafter's parameters (a function sent to the worker needs the
    # insecure-serialization switch, for this test engine only).
    "k1": {
        "engine": {**ENGINE, "speculative_config": mtp(1)},
        "drafter_parameters": True,
        "env": {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
    },
    "k2": {"engine": {**ENGINE, "speculative_config": mtp(2)}},
    # 12 blocks of 16 tokens for 8 requests of up to ~80 tokens: the scheduler must preempt.
    "k2_preempted": {
        "engine": {
            **ENGINE,
            "speculative_config": mtp(2),
            "block_size": 16,
            "num_gpu_blocks_override": 12,
            "max_model_len": 160,
        }
    },
    "k2_all_accepted": {
        "engine": {
            **ENGINE,
            "speculative_config": mtp(
                2, rejection_sample_method="synthetic", synthetic_acceptance_rates=[1.0, 1.0]
            ),
        }
    },
}
# DeepSeek-V3.2 (its MTP layer has an indexer and sparse MLA of its own; every draft step
# computes its own selection, as upstream's V3.2 config does not share it across steps)
# (upstream raises V3.2's default block size to 64, past the shared prefix of the prompts)
RUNS.update(
    {
        f"v32_{name}": {
            **RUNS[name],
            "engine": {**RUNS[name]["engine"], "block_size": 16},
            "arch": "deepseek_v32",
        }
        for name in ("k2", "k2_all_accepted")
    }
)
# Qwen3.5 (Gated DeltaNet layers under verification: each position's state kept, the next
# step starting from the last accepted one's; its MTP layer is a full-attention layer).
# Prefix caching is refused with these layers. Accepting the first draft only puts the
# next step's start in the middle of the kept states.
NO_PREFIX_CACHING = {"enable_prefix_caching": False}
RUNS.update(
    {
        f"q35_{name}": {"engine": {**RUNS[name]["engine"], **NO_PREFIX_CACHING}, "arch": "qwen3_5"}
        for name in ("k2", "k2_all_accepted")
    }
)
RUNS["q35_k2_first_accepted"] = {
    "engine": {
        **ENGINE,
        **NO_PREFIX_CACHING,
        "speculative_config": mtp(
            2, rejection_sample_method="synthetic", synthetic_acceptance_rates=[1.0, 0.0]
        ),
    },
    "arch": "qwen3_5",
}


def _model_of(tiny_models, run: str):
    return tiny_models[RUNS[run].get("arch", "deepseek_v3")]


@pytest.fixture(scope="module")
def single_rank(tiny_models):
    model = tiny_models["deepseek_v3"]
    runs = []
    for name, spec in RUNS.items():
        run = {key: value for key, value in spec.items() if key != "arch"}
        preempted = name.endswith("k2_preempted")
        batches = [PROMPTS] if preempted else [PROMPTS, *([p] for p in SINGLES), PREFIX_PROMPTS]
        runs.append(
            {
                "model": str(tiny_models[spec.get("arch", "deepseek_v3")]),
                "batches": batches,
                "max_tokens": MAX_TOKENS,
                "report_runner": True,
                **run,
                "env": {**IN_PROCESS, **CHECKED, **run.get("env", {})},
            }
        )
    # Random sampling with a fixed seed: the same request twice in one batch, then again;
    # then the same with synchronous scheduling (every run above schedules asynchronously).
    random = {
        "model": str(model),
        "batches": [[RANDOM_PROMPT] * 2, [RANDOM_PROMPT]],
        "max_tokens": MAX_TOKENS,
        "sampling": {"temperature": 0.8, "top_p": 0.95, "seed": 7},
        "engine": {**ENGINE, "speculative_config": mtp(2)},
        "report_runner": True,
        "env": {**IN_PROCESS, **CHECKED},
    }
    runs += [random, {**random, "engine": {**random["engine"], "async_scheduling": False}}]
    result, output = run_spec({"runs": runs}, timeout=1800)
    clean_shutdown(output)
    names = [*RUNS, "random", "random_sync"]
    return model, dict(zip(names, result["runs"])), output


def _acceptance(counters: dict) -> tuple[float, float]:
    drafts = counters.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    steps = counters.get("vllm:spec_decode_num_drafts", 0)
    return (accepted / drafts if drafts else 0.0), (accepted / steps if steps else 0.0)


def test_each_run_used_the_ascend_runner_in_step(single_rank):
    _, runs, _ = single_rank
    for name, run in runs.items():
        assert run["runner"] == "NPUModelRunner", name
        # upstream's default, with drafts too (worker/v2/seq_lens.py makes the host lengths exact)
        assert run["async_scheduling"] == (name != "random_sync"), name


@pytest.mark.parametrize("run", ["k1", "k2", "v32_k2", "q35_k2"])
def test_greedy_mtp_equals_plain_decoding(single_rank, tiny_models, run):
    _, runs, _ = single_rank
    model = _model_of(tiny_models, run)
    batches = runs[run]["batches"]
    assert _tokens(batches[0]) == hf_greedy(model, PROMPTS, MAX_TOKENS)  # batch 8 (9 requests, 8 at once)
    assert max(r["prompt_len"] for r in batches[0]) > ENGINE["max_num_batched_tokens"]  # chunked prefill
    singles = [t for b in batches[1 : 1 + len(SINGLES)] for t in _tokens(b)]
    assert singles == hf_greedy(model, SINGLES, MAX_TOKENS)
    prefix = batches[-1]
    assert _tokens(prefix) == hf_greedy(model, PREFIX_PROMPTS, MAX_TOKENS)
    if RUNS[run]["engine"]["enable_prefix_caching"]:
        assert all(r["num_cached_tokens"] > 0 for r in prefix[1:]), prefix  # prefix-cache hits
    counters = runs[run]["counters"]
    assert counters["vllm:spec_decode_num_draft_tokens"] > 0  # speculation really ran
    rate, per_step = _acceptance(counters)
    print(f"MTP {run}: acceptance rate {rate:.3f}, accepted tokens per verification step {per_step:.3f}")


def test_mtp_layer_weights_load_from_the_checkpoint(single_rank):
    """The drafter's MTP layer holds the checkpoint's layer ``num_hidden_layers`` tensors
    (its decoder block under ``mtp_block``; experts fused as upstream's FusedMoE stores
    them), compared by float64 sums."""
    import json

    from safetensors.torch import load_file

    model, runs, _ = single_rank
    got = runs["k1"]["drafter_parameters"]
    n = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    saved = {}
    for path in model.glob("*.safetensors"):
        saved.update(load_file(str(path)))
    layer = f"model.layers.{n}."

    def total(*names):
        return sum(float(saved[name].double().sum()) for name in names)

    experts = sorted({k.split(".")[5] for k in saved if k.startswith(layer + "mlp.experts.")}, key=int)
    assert experts, "the checkpoint has no MTP experts"
    expected = {
        layer + name: total(layer + name)
        for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")
    }
    for name in (
        "self_attn.q_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias",
        "mlp.shared_experts.down_proj.weight",
        "input_layernorm.weight",
    ):
        expected[layer + "mtp_block." + name] = total(layer + name)
    expected[layer + "mtp_block.mlp.shared_experts.gate_up_proj.weight"] = total(
        layer + "mlp.shared_experts.gate_proj.weight", layer + "mlp.shared_experts.up_proj.weight"
    )
    expected[layer + "mtp_block.mlp.experts.routed_experts.w13_weight"] = total(
        *(f"{layer}mlp.experts.{e}.{p}_proj.weight" for e in experts for p in ("gate", "up"))
    )
    expected[layer + "mtp_block.mlp.experts.routed_experts.w2_weight"] = total(
        *(f"{layer}mlp.experts.{e}.down_proj.weight" for e in experts)
    )
    for name, value in expected.items():
        assert name in got, (name, sorted(got))
        assert abs(got[name][0] - value) <= 1e-6 * max(1.0, abs(value)), (name, got[name][0], value)


def test_greedy_mtp_under_preemption(single_rank):
    model, runs, _ = single_rank
    run = runs["k2_preempted"]
    assert run["counters"].get("vllm:num_preemptions", 0) > 0, run["counters"]
    assert _tokens(run["batches"][0]) == hf_greedy(model, PROMPTS, MAX_TOKENS)


def _hf_next_tokens(model, prompt: str, generated: list[int]) -> list[int]:
    """Transformers' greedy next token after each prefix ``prompt + generated[:j]``."""
    from tests.support.oracle import hf_teacher_forced_logprobs

    return hf_teacher_forced_logprobs(model, prompt, generated).argmax(-1).tolist()


# name: tokens a verification step emits (the accepted drafts and the target's own pick)
SYNTHETIC = {
    "k2_all_accepted": 3,
    "v32_k2_all_accepted": 3,
    "q35_k2_all_accepted": 3,
    "q35_k2_first_accepted": 2,
}


@pytest.mark.parametrize("name", SYNTHETIC)
def test_accepted_drafts_keep_the_target_exact(single_rank, tiny_models, name):
    """Synthetic acceptance (k = 2): every draft, or the first only. A request emits its
    first token, then per step the accepted drafts and the target's pick, so every
    ``period``-th token is the target's own and must equal transformers' greedy token
    after everything emitted before it (V3.2: the verification step's three query rows per
    request each select their own keys; Qwen3.5: the next step starts from the state after
    the last accepted token)."""
    _, runs, _ = single_rank
    model = _model_of(tiny_models, name)
    run = runs[name]
    period = SYNTHETIC[name]
    rate, per_step = _acceptance(run["counters"])
    assert per_step == period - 1 and rate == (period - 1) / 2, run["counters"]
    outputs = [r for batch in run["batches"] for r in batch]
    prompts = PROMPTS + SINGLES + PREFIX_PROMPTS
    assert len(outputs) == len(prompts)
    drafts_unlike_target = 0
    for prompt, out in zip(prompts, outputs):
        tokens = out["token_ids"]
        expected = _hf_next_tokens(model, prompt, tokens)
        for j in range(MAX_TOKENS):
            if j % period == 0:
                assert tokens[j] == expected[j], (prompt, j, tokens, expected)
            else:
                drafts_unlike_target += tokens[j] != expected[j]
    # Accepted drafts the target would not have picked: acceptance really was exercised.
    assert drafts_unlike_target > 0


def test_random_sampling_with_seed_is_reproducible(single_rank):
    _, runs, _ = single_rank
    first, second = runs["random"]["batches"]
    assert first[0]["token_ids"] == first[1]["token_ids"] == second[0]["token_ids"]
    assert len(set(first[0]["token_ids"])) > 1
    # asynchronous scheduling draws what synchronous scheduling draws
    assert [r["token_ids"] for b in runs["random_sync"]["batches"] for r in b] == [
        r["token_ids"] for b in runs["random"]["batches"] for r in b
    ]
    rate, per_step = _acceptance(runs["random"]["counters"])
    print(f"MTP k2 random sampling: acceptance rate {rate:.3f}, per step {per_step:.3f}")


def test_mtp_tp2_expert_parallel(tiny_models):
    """TP = 2 with expert parallelism and MC2 forced: the drafter's MoE layer runs through
    the same strategy and groups as the target's (no second group initialisation). The
    same through the NPU kernels: test_npu_path.py's quantized test."""
    model = tiny_models["deepseek_v3"]
    spec = {
        "model": str(model),
        "batches": [PROMPTS],
        "max_tokens": MAX_TOKENS,
        "engine": {
            **ENGINE,
            "tensor_parallel_size": 2,
            "distributed_executor_backend": "mp",
            "enable_expert_parallel": True,
            "additional_config": {"moe_comm_method": "mc2"},
            "speculative_config": mtp(2),
        },
    }
    result, output = run_spec(spec, timeout=1200, env=CHECKED)
    clean_shutdown(output)
    assert "first step with the mc2 strategy" in output
    assert RUNNER_LINE in output
    assert _tokens(result["batches"][0]) == hf_greedy(model, PROMPTS, MAX_TOKENS)
    assert result["counters"]["vllm:spec_decode_num_draft_tokens"] > 0
