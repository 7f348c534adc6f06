"""Decode graphs (FULL_DECODE_ONLY ACL graphs) against eager execution, in NPU-path mode.

Every engine here runs the torch_npu kernels through the contract double (bfloat16), once
eager (``--enforce-eager``) and once with decode graphs, the platform's default with the
NPU kernels. The double's graphs replay like the device: a capture launches nothing, a
replay re-runs exactly the captured ops on the captured memory with every Python value as
it was at capture, a captured fused attention waits for the update that records its
external event, and a graph that reads memory freed after its capture fails. The graph
engine must give the eager engine's greedy tokens where vllm-ascend's graph mode broke
(padded batches, metadata sizes, MTP, DP, chunked prefill):

- a Qwen2 whose batches decode at sizes between the captured ones (padded) and beyond the
  largest (eager), contexts of 3 to 484 tokens in one batch, chunked prefill (64-token steps)
  interleaved with decodes and prefix-cache hits over 128-token blocks;
- the same Qwen2 under preemption (a KV cache of 12 blocks for 8 requests that each outgrow
  their first block), with every batch size up to 8 captured: a padded step's padding rows
  each count a block against the fused attention's documented ``blocknum`` rule, which a
  full cache leaves no room for (docs/model_runner.md);
- the MLA + MoE DeepSeek-V3 with MTP (k = 2: the drafter's graphs too; k = 1 extended),
  with asynchronous scheduling (upstream's default);
- seeded random sampling (temperature, top-p, top-k) in one batch of the Qwen2 pair and of
  the MTP k = 2 pair (verification by the random walk): graph and eager draw the same;
- a W8A8 (msModelSlim) DeepSeek-V3;
- TP=2 with expert parallelism under MC2 (forced, Atlas A2; AllGather forced is extended)
  and under the selector on an Atlas A3 (AllToAll in eager steps, AllGather in the graphs:
  AllToAll's split sizes are host values).

Two bf16 runs may pick different tokens only at a near-tie (test_npu_path's rule, reported
as a warning); graph and eager run the same kernels on the same values, so none is
expected. One more graph engine replays every graph with the host lengths of its capture
(harness/graph_sabotage.py): its tokens must change, which shows the update carries
what the graphs need and that the double does freeze host values.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tests.support.engines import IN_PROCESS, clean_shutdown, run_spec
from tests.support.models import MLA512, quantize_model
from tests.support.npu_compare import NEAR_TIE_CANDIDATES, NearTieDivergence, call_counts, compare_tokens
from tests.support.prompts import LONG_PREFIX_PROMPTS, LONG_PROMPTS, PROMPTS
from tests.support.selection import cases_to_start, extended_params

MAX_TOKENS = 10
NPU = {"VLLM_ASCEND_KERNELS": "npu"}
BASE = {
    "dtype": "bfloat16",
    "max_model_len": 1024,
    "seed": 0,
    "block_size": 128,
    "enable_prefix_caching": True,
}
CAPTURE_SIZES = [1, 2, 4, 8]
QWEN2 = {
    **BASE,
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 12,
    "disable_log_stats": False,
    "compilation_config": {"decode_cudagraph_capture_request_sizes": CAPTURE_SIZES},
}
PREEMPTED = {
    **QWEN2,
    "max_num_seqs": 8,
    "num_gpu_blocks_override": 12,
    "compilation_config": {"decode_cudagraph_capture_request_sizes": list(range(1, 9))},
}
# a short batch of 5 (padded to 8); 12 prompts of 3 to 484 tokens arriving together (chunked
# prefill beside decodes, batch sizes growing through 1..8 and past 8); prefix-cache hits
# (~320-token prompts sharing two blocks)
QWEN2_BATCHES = [PROMPTS[:5], LONG_PROMPTS + PROMPTS[:4], LONG_PREFIX_PROMPTS[:1], LONG_PREFIX_PROMPTS[1:]]
# 8 prompts of ~97 tokens decoding 40 each past their first block: 16 blocks wanted, 12 held
PREEMPTED_BATCHES = [[f"{LONG_PROMPTS[3]} {i}" for i in range(8)]]
PREEMPTED_SAMPLING = [{"max_tokens": 40}]
DEEPSEEK = {**BASE, "max_num_seqs": 8, "max_num_batched_tokens": 128}
# MLA with 16-token blocks and 32 requests decoding together: graphs of 8 tokens (the latent
# prolog inside the graph) and of 32 (more tokens than a block: upstream's forward), after
# eager prefills that wrote the rope plane through the prolog
MLA_BLOCK16 = {
    **BASE,
    "block_size": 16,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 256,
    "compilation_config": {"decode_cudagraph_capture_request_sizes": [8, 32]},
}
TP2_EP = {
    **DEEPSEEK,
    "tensor_parallel_size": 2,
    "distributed_executor_backend": "mp",
    "enable_expert_parallel": True,
}
# MTP k = 2 with 16 requests and the default token budget (8192 / 16 = 512 tokens per dummy
# request: the drafter's steps over the memory profile's batch reach a fifth block each)
MTP_START_UP = {
    "dtype": "bfloat16",
    "max_model_len": 1024,
    "seed": 0,
    "block_size": 128,
    "max_num_seqs": 16,
    "enforce_eager": True,
    "speculative_config": {"method": "mtp", "num_speculative_tokens": 2},
}
# name -> (model, engine, env): each runs eager and with graphs
PAIRS = {
    "qwen2": ("qwen2", QWEN2, {}),
    "qwen2_preempted": ("qwen2", PREEMPTED, {}),
    "mtp_k1": (
        MLA512,
        {**DEEPSEEK, "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}},
        {},
    ),
    "mtp_k2": (
        MLA512,
        {**DEEPSEEK, "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
        {},
    ),
    "w8a8": ("w8a8", DEEPSEEK, {}),
    "mla_block16": (MLA512, MLA_BLOCK16, {}),
    "tp2_ep_allgather": (MLA512, {**TP2_EP, "additional_config": {"moe_comm_method": "allgather"}}, {}),
    "tp2_ep_mc2": (MLA512, {**TP2_EP, "additional_config": {"moe_comm_method": "mc2"}}, {}),
    "tp2_ep_a3": (MLA512, TP2_EP, {"TORCH_NPU_DOUBLE_SOC": "A3"}),
}
DEEPSEEK_BATCHES = [PROMPTS[:5], LONG_PROMPTS[:4]]
# seeded random sampling in one batch of a pair: graph and eager draw the same tokens (the
# noise is a hash of seed, position and token; MTP k = 2 verifies through the random walk,
# from the decode-step graphs in the graph engine)
RANDOM = {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "seed": 11}
BATCH_SAMPLING = {"qwen2": [RANDOM, {}, {}, {}], "mtp_k2": [{}, RANDOM]}
MLA_BLOCK16_BATCHES = [[f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]]
# out of CI's run: k = 2 captures and replays the drafter's graphs as k = 1 does, and the A3
# selector's graphs take AllGather
EXTENDED_PAIRS = {"mtp_k1", "tp2_ep_allgather"}


def _spec(model: Path, engine: dict, env: dict, batches: list, log: Path, **extra) -> dict:
    log.mkdir(parents=True, exist_ok=True)
    in_process = engine.get("tensor_parallel_size", 1) == 1
    if batches is PREEMPTED_BATCHES:
        extra["batch_sampling"] = PREEMPTED_SAMPLING
    return {
        "model": str(model),
        "engine": engine,
        "batches": batches,
        "max_tokens": MAX_TOKENS,
        "logprobs": NEAR_TIE_CANDIDATES,
        # TP=2 workers write their own call logs; in-process engines report graph counts
        "env": {**env, **(IN_PROCESS if in_process else {"TORCH_NPU_DOUBLE_CALL_LOG": str(log)})},
        **extra,
    }


@pytest.fixture(scope="module")
def runs(request, tiny_models, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("graphs")
    models = {"qwen2": tiny_models["qwen2"], MLA512: tiny_models[MLA512]}
    models["w8a8"] = quantize_model(tiny_models[MLA512], root / "w8a8", "w8a8_dynamic")
    specs, names = [], []
    for name in cases_to_start(request, "name", PAIRS, EXTENDED_PAIRS):
        model, engine, env = PAIRS[name]
        batches = _batches(name)
        sampling = {"batch_sampling": BATCH_SAMPLING[name]} if name in BATCH_SAMPLING else {}
        for mode, change in (("eager", {"enforce_eager": True}), ("graph", {})):
            specs.append(
                _spec(models[model], {**engine, **change}, env, batches, root / f"{name}-{mode}", **sampling)
            )
            names.append((name, mode))
    specs.append(
        _spec(
            models["qwen2"],
            QWEN2,
            {},
            QWEN2_BATCHES,
            root / "frozen",
            freeze_graph_updates=True,
            batch_sampling=BATCH_SAMPLING["qwen2"],
        )
    )
    names.append(("qwen2", "frozen"))
    specs.append(_spec(models[MLA512], MTP_START_UP, {}, [PROMPTS[:1]], root / "mtp-start-up"))
    names.append(("mtp", "start-up"))
    result, output = run_spec({"runs": specs}, timeout=3000, env=NPU)
    clean_shutdown(output)
    out = {key: run for key, run in zip(names, result["runs"])}
    out["_output"], out["_root"] = output, root
    return out


def _flat(run: dict) -> list[dict]:
    return [r for batch in run["batches"] for r in batch]


def _batches(name: str) -> list[list[str]]:
    if name == "qwen2_preempted":
        return PREEMPTED_BATCHES
    if name == "mla_block16":
        return MLA_BLOCK16_BATCHES
    return QWEN2_BATCHES if PAIRS[name][0] == "qwen2" else DEEPSEEK_BATCHES


def _prompts(name: str) -> list[str]:
    return [p for batch in _batches(name) for p in batch]


def _replays(runs: dict, name: str, mode: str) -> int:
    if PAIRS[name][1].get("tensor_parallel_size", 1) > 1:
        return call_counts(runs["_root"] / f"{name}-{mode}").get("graph::replay", 0)
    return runs[(name, mode)]["graphs"].get("replays", 0)


@pytest.mark.parametrize("name", extended_params(PAIRS, EXTENDED_PAIRS))
def test_graphs_decode_like_eager(runs, name):
    eager, graph = runs[(name, "eager")], runs[(name, "graph")]
    assert _replays(runs, name, "graph") > 0, f"{name}: no decode graph replayed"
    assert _replays(runs, name, "eager") == 0, f"{name}: the eager engine replayed graphs"
    divergences = compare_tokens(f"{name} graph vs eager", _flat(eager), _flat(graph), _prompts(name))
    for line in divergences:
        warnings.warn(line, NearTieDivergence, stacklevel=2)
    for i, sampling in enumerate(BATCH_SAMPLING.get(name, [])):
        if sampling:  # a seeded draw has no near-tie excuse: the same noise on the same logits
            want = [r["token_ids"] for r in eager["batches"][i]]
            assert [r["token_ids"] for r in graph["batches"][i]] == want, f"{name} batch {i}"
            assert len({t for tokens in want for t in tokens}) > len(want), "random sampling drew little"


def test_the_qwen2_batches_took_the_paths_they_should(runs):
    """Preemption happened, prefix caches hit, and graph steps and eager steps both ran."""
    preempted = runs[("qwen2_preempted", "graph")]
    assert preempted["counters"].get("vllm:num_preemptions", 0) > 0, preempted["counters"]
    assert all(r["prompt_len"] + len(r["token_ids"]) > 128 > r["prompt_len"] for r in preempted["batches"][0])
    graph = runs[("qwen2", "graph")]
    assert all(r["num_cached_tokens"] >= 256 for r in graph["batches"][3])
    assert max(r["prompt_len"] for r in graph["batches"][1]) > 6 * QWEN2["max_num_batched_tokens"]
    # decode steps of batches beyond 8 requests and mixed prefill/decode steps ran eagerly:
    # fewer replays than steps that produced tokens
    steps = sum(len(r["token_ids"]) for r in _flat(graph))
    assert 0 < graph["graphs"]["replays"] < steps


def test_a_replay_with_capture_time_lengths_decodes_differently(runs):
    """Take the per-replay update's content away and the tokens change: the double replays
    the capture's host lengths, as the device would."""
    frozen, eager = runs[("qwen2", "frozen")], runs[("qwen2", "eager")]
    assert frozen["graphs"]["replays"] > 0
    changed = [a["token_ids"] != b["token_ids"] for a, b in zip(_flat(frozen), _flat(eager))]
    assert sum(changed) >= len(changed) // 2, changed


def test_mtp_with_sixteen_requests_starts(runs):
    """The memory profile's KV cache holds what the drafter's steps over its dummy batch read."""
    started = runs[("mtp", "start-up")]
    assert len(started["batches"][0][0]["token_ids"]) == MAX_TOKENS
    assert (
        "Memory profile with attention: 8192 tokens in 16 requests (2 draft tokens each), 81 KV blocks"
        in (runs["_output"])
    )


def test_start_up_reports_graphs(runs):
    output = runs["_output"]
    assert "Ascend platform: decode graphs (FULL_DECODE_ONLY)" in output
    assert "Ascend graphs: " in output and " captured in " in output
    # the random batch's sampler: one graph per decode request size (Qwen2: 1, 2, 4, 8)
    assert "Ascend sampler graphs: 4 captured (random batches of up to 8 requests)" in output
    assert "of graph memory estimated before the KV cache is sized" in output
    # the MTP k = 2 engine's decode-step graphs verify drafts, three tokens a request
    assert "greedy and random verification and state updates of up to 8 requests, 3 tokens each)" in output
    # the 16-token-block MLA engine captured a graph of more tokens than a block
    assert "Ascend MLA latent prolog not used in decode graphs of more than 16 tokens" in output
    # the A3 selector's AllToAll steps ran eagerly, its graphs took AllGather
    assert "first step with the alltoall strategy" in output
