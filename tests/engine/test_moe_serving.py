"""MoE serving end to end in host emulation: tiny DeepSeek-V3 models (MLA + MoE) with
TP + EP and with DP x TP + EP, the MoE strategies spread over the starts (see
QUANTIZED_TP2_STRATEGIES). The DP instances run under the collective recorder
(``tests/support/dp_collectives.py``).

The expert-parallel cases serve an msModelSlim W8A8 checkpoint (``--quantization
ascend``, chosen from its description) of a three-layer DeepSeek-V3: static W8A8
attention and dense / shared-expert MLPs, W8A8-dynamic routed experts in layer 1 and
float routed experts in layer 2, which vLLM serves with the unquantized Ascend MoE
method. So each start carries both MoE methods through its strategy. Their oracle is
the fake-quantized transformers model (``tests/support/quant_reference.py``), and the TP=1 engine of
the same checkpoint; a divergence at a near-tie of the oracle is reported, not hidden.

A tiny Qwen3-MoE (softmax top-k routing, renormalised: the routing of Mixtral and the
Qwen MoE models, which upstream computes with a CUDA kernel) is served with TP=2 + EP
and with DP=2 + EP, against transformers.

Every engine writes which strategies its MoE layers ran ("Ascend MoE: first step with
the <name> strategy"), so each test also proves the strategy it forced really ran.
"""

from __future__ import annotations

import concurrent.futures
import re

import pytest

from tests.support import dp_collectives
from tests.support.engines import (
    IN_PROCESS,
    RUNNER_LINE,
    clean_shutdown,
    greedy_completion,
    run_spec,
    vllm_server,
)
from tests.support.models import make_model, quantize_model
from tests.support.oracle import hf_greedy
from tests.support.prompts import LONG_PROMPTS, PROMPTS
from tests.support.quant_reference import compare, fake_quantized, greedy_with_gaps
from tests.support.selection import extended_params

MAX_TOKENS = 12
ENGINE = {"dtype": "float32", "max_model_len": 512, "seed": 0, "distributed_executor_backend": "mp"}
# Engine starts are CI's scarcest resource, so each strategy runs with each routing and
# each expert method at least once across the engine tests, not every pairing here:
# AllGather with the W8A8-dynamic experts runs in the DP x TP + EP server below (its decode
# steps), AllToAll with softmax routing in tests/engine/test_npu_path.py (TP=2 + EP on
# an A3), and every pairing of strategy, layout (DP x TP x EP included) and expert method in
# the multi-process strategy tests (tests/unit/moe/test_moe_strategies.py).
QUANTIZED_TP2_STRATEGIES = ["alltoall", "mc2"]
SOFTMAX_TP2_STRATEGIES = ["allgather", "mc2"]
USED = re.compile(r"Ascend MoE: first step with the (\w+) strategy")


def _strategies_used(log: str) -> set[str]:
    return set(USED.findall(log))


class Quantized:
    """The mixed W8A8 checkpoint and its fake-quantized oracle (greedy tokens with the
    top-2 logit gap of every step, computed once per prompt list)."""

    def __init__(self, base):
        self.float_model = make_model(base / "float", "--arch", "deepseek_v3", "--layers", "3")
        self.path = quantize_model(
            self.float_model, base / "w8a8", "w8a8", "--keep-float", r"^model\.layers\.2\.mlp\.experts\."
        )
        self._hf = None
        self._reference = {}

    def reference(self, prompts: list[str]):
        from transformers import AutoTokenizer

        key = tuple(prompts)
        if key not in self._reference:
            if self._hf is None:  # one fake-quantized model for every prompt list
                self._hf = (
                    fake_quantized(self.float_model, self.path),
                    AutoTokenizer.from_pretrained(self.path),
                )
            self._reference[key] = greedy_with_gaps(*self._hf, prompts, MAX_TOKENS)
        return self._reference[key]

    def check(self, label: str, prompts: list[str], got: list[list[int]]) -> set[int]:
        """Fails on a divergence that is not a near-tie; returns the prompts (indices)
        that diverged at a near-tie, after reporting them."""
        mismatches, near_ties = compare(got, self.reference(prompts))
        assert not mismatches, (label, mismatches)
        for tie in near_ties:
            print(f"{label}: near-tie divergence from the fake-quantized oracle: {tie}")
        assert len(near_ties) <= max(1, len(prompts) // 4), (
            label,
            near_ties,
        )  # the comparison meant something
        return {tie["prompt"] for tie in near_ties}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> Quantized:
    return Quantized(tmp_path_factory.mktemp("moe_w8a8"))


def test_tp2_expert_parallel_dispatching_strategies_equal_tp1_on_a_quantized_model(quantized):
    strategies = QUANTIZED_TP2_STRATEGIES
    runs = [
        {
            "model": str(quantized.path),
            "batches": [PROMPTS],
            "max_tokens": MAX_TOKENS,
            "engine": ENGINE,
            "env": IN_PROCESS,
        }
    ]
    runs += _tp2_ep_runs(quantized.path, strategies)
    result, output = run_spec({"runs": runs}, timeout=1500)
    clean_shutdown(output)
    assert output.count("quantization=ascend") >= len(runs)
    assert RUNNER_LINE in output
    tokens = [[r["token_ids"] for r in run["batches"][0]] for run in result["runs"]]
    tied = quantized.check("tp1", PROMPTS, tokens[0])
    for strategy, got in zip(strategies, tokens[1:]):
        tied |= quantized.check(f"tp2 ep {strategy}", PROMPTS, got)
        for i, (tp1, tp2) in enumerate(zip(tokens[0], got)):
            assert i in tied or tp1 == tp2, (strategy, PROMPTS[i], tp1, tp2)
    # the forced ones, and the TP=1 engine's (one rank: AllGather)
    assert _strategies_used(output) == {"allgather", *strategies}


def _tp2_ep_runs(model, strategies: list[str]) -> list[dict]:
    """One TP=2 + EP engine run of ``model`` per forced strategy."""
    engine = {**ENGINE, "tensor_parallel_size": 2, "enable_expert_parallel": True}
    return [
        {
            "model": str(model),
            "batches": [PROMPTS],
            "max_tokens": MAX_TOKENS,
            "engine": {**engine, "additional_config": {"moe_comm_method": s}},
            # the engine core in the runner process, its two workers processes (mp): one
            # Python start less per engine (separate engine cores: the DP servers below)
            "env": IN_PROCESS,
        }
        for s in strategies
    ]


def test_softmax_routed_moe_tp2_expert_parallel_strategies_equal_transformers(tiny_models):
    model = tiny_models["qwen3_moe"]
    strategies = SOFTMAX_TP2_STRATEGIES
    runs = _tp2_ep_runs(model, strategies)
    expected = hf_greedy(model, PROMPTS, MAX_TOKENS)
    result, output = run_spec({"runs": runs}, timeout=900)
    clean_shutdown(output)
    for strategy, run in zip(strategies, result["runs"]):
        assert [r["token_ids"] for r in run["batches"][0]] == expected, strategy
    assert _strategies_used(output) == set(strategies)


# name: (extra `vllm serve` arguments, prompts, strategies that must have run); the DeepSeek
# case serves the quantized checkpoint
DP_SERVERS = {
    # DP 2 x TP 2 with EP 4, the selector's choice: AllGather for decode steps, AllToAll for
    # the long prompts' prefill steps (host rule: EP >= 4 and >= 256 tokens on a DP rank).
    "dp2_tp2_ep_auto": (
        ["--tensor-parallel-size", "2", "--enable-expert-parallel"],
        LONG_PROMPTS[-3:],
        {"allgather", "alltoall"},
    ),
    # DP 2 with EP 2, the Qwen3-MoE (softmax routing) against transformers.
    "dp2_ep_qwen3_moe": (["--enable-expert-parallel"], PROMPTS, {"allgather"}),
}


# extended (out of CI's run): softmax routing under EP runs in the TP2 case above, DP with
# EP in the case before it and in test_dp_serving.py
EXTENDED_DP_SERVERS = ("dp2_ep_qwen3_moe",)


@pytest.mark.parametrize("name", extended_params(DP_SERVERS, EXTENDED_DP_SERVERS))
def test_data_parallel_moe_serves_and_matches_its_oracle(name, tiny_models, quantized, tmp_path):
    extra, prompts, must_run = DP_SERVERS[name]
    quantized_model = "qwen3_moe" not in name
    model = quantized.path if quantized_model else tiny_models["qwen3_moe"]
    tp = int(extra[extra.index("--tensor-parallel-size") + 1]) if "--tensor-parallel-size" in extra else 1
    log = tmp_path / "server.log"
    args = [
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--seed",
        "0",
        "--data-parallel-size",
        "2",
        *extra,
    ]
    if quantized_model:  # greedy tokens of the oracle; prompts diverging at its near-ties are checked below
        expected = dict(zip(prompts, (tokens for tokens, _ in quantized.reference(prompts))))
    else:
        expected = dict(zip(prompts, hf_greedy(model, prompts, MAX_TOKENS)))
    recorded = tmp_path / "collectives"
    env = dp_collectives.recorder_env(recorded)
    with vllm_server(model, args, log, timeout=420, env=env) as base:
        # One request alone: the other DP rank has nothing to do and runs dummy steps.
        first = greedy_completion(base, model, prompts[1], MAX_TOKENS, 300)
        # Then every prompt at once, spread over both ranks.
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = dict(
                zip(prompts, pool.map(lambda p: greedy_completion(base, model, p, MAX_TOKENS, 300), prompts))
            )
        if quantized_model:
            quantized.check(name, prompts, [got[p] for p in prompts])
            alone, _ = compare([first], quantized.reference(prompts)[1:2])
            assert not alone, alone
        else:
            assert first == expected[prompts[1]]
            assert got == expected
        # while the instance is up (a stop may cut the ranks' last step short): one DP metadata
        # collective per step, the same collectives on both DP ranks (docs/data_parallel.md)
        dp_collectives.settle(recorded)
        steps = dp_collectives.check(recorded, 2)
        assert len(steps) == 2 * tp, steps  # every worker of DP 2 x TP tp recorded
    text = log.read_text()
    assert RUNNER_LINE in text
    assert "Ascend model runner scheduling: async\n" in text
    assert must_run <= _strategies_used(text), (must_run, _strategies_used(text))
    if quantized_model:
        assert "quantization=ascend" in text
        assert "sequence-parallel MoE off" in text  # the platform's documented adjustment
    # up to the stop the test sends: a DP API server may log its engine's death while
    # both are being stopped (upstream's shutdown race, seen on a loaded machine)
    serving = text.split("[shutdown]", 1)[0]
    assert "Traceback" not in serving, serving[-4000:]
