"""Expert-parallel load balancing (EPLB) end to end in host emulation: a tiny DeepSeek-V3
whose routers prefer a few experts (their correction bias raised), served with
``--enable-eplb`` and redundant experts, rearranging several times while it serves. Its
tokens equal transformers' before and after the rearrangements, upstream's EPLB says it
rearranged and how balanced the load was, and the expert map read back from the workers
has moved replicas off their start-up places.

TP=2 + EP runs MC2 and AllToAll (forced) with float experts; DP=2 + EP (AllGather, the
selector's choice for these decode steps) serves the same model with W4A8 experts, whose
scales and offset terms move with their weights, against the fake-quantized oracle. The
NPU path (torch_npu kernels through the contract double, decode graphs replaying across
rearrangements) is in tests/engine/test_npu_path.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import pytest

from tests.support.engines import IN_PROCESS, clean_shutdown, greedy_completion, run_spec, vllm_server
from tests.support.models import quantize_model, skew_router
from tests.support.oracle import hf_greedy
from tests.support.prompts import PROMPTS
from tests.support.quant_reference import compare, fake_quantized, greedy_with_gaps

MAX_TOKENS = 12
REDUNDANT = 2
# Rearrange every 6 steps from the load of the last 4: each batch below spans several.
EPLB = {"num_redundant_experts": REDUNDANT, "window_size": 4, "step_interval": 6, "log_balancedness": True}
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "seed": 0,
    "distributed_executor_backend": "mp",
    "enable_expert_parallel": True,
    "enable_eplb": True,
    "eplb_config": EPLB,
}
# workers are other processes: the placement read-back is a function sent to them
READ_BACK = {**IN_PROCESS, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
BALANCE = re.compile(r"EPLB step: \d+ for model .*?balancedness=([0-9.]+)")


@pytest.fixture(scope="module")
def skewed(tiny_models, tmp_path_factory):
    """The tiny DeepSeek-V3 (8 experts in 2 groups, top-2) with experts 0-2 preferred: most
    routes go to EP rank 0 under the start-up placement."""
    return skew_router(tiny_models["deepseek_v3"], tmp_path_factory.mktemp("eplb") / "skewed", 3, 0.6)


def _check_rearranged(output: str, placements: list, logical: int) -> None:
    assert "Rearranging experts sync mode" in output, output[-3000:]
    assert "Rearranged experts" in output
    balance = [float(b) for b in BALANCE.findall(output)]
    # (an idle step's balancedness is 0: no load on any rank)
    assert balance and all(0.0 <= b <= 1.0 for b in balance) and max(balance) > 0, balance
    from vllm.distributed.eplb.eplb_state import EplbState

    initial = list(EplbState.build_initial_global_physical_to_logical_map(logical, REDUNDANT))
    for worker in placements:
        [layers] = worker  # one EPLB model (no drafter)
        for layer in layers:
            assert sorted(set(layer)) == list(range(logical)), layer  # every expert still held
            assert len(layer) == logical + REDUNDANT
        assert any(layer != initial for layer in layers), layers  # the rearrangement moved some
    assert all(worker == placements[0] for worker in placements)  # every rank agrees


def test_tp2_eplb_rearranges_while_serving_with_transformers_tokens(skewed):
    """TP=2 + EP 2, MC2 then AllToAll forced (one runner process, an engine each)."""
    strategies = ["mc2", "alltoall"]
    expected = hf_greedy(skewed, PROMPTS, MAX_TOKENS)
    runs = [
        {
            "model": str(skewed),
            "batches": [PROMPTS, PROMPTS[::-1]],
            "max_tokens": MAX_TOKENS,
            "engine": {**ENGINE, "tensor_parallel_size": 2, "additional_config": {"moe_comm_method": s}},
            "env": READ_BACK,
            "eplb_placement": True,
        }
        for s in strategies
    ]
    result, output = run_spec({"runs": runs}, timeout=900)
    clean_shutdown(output)
    for strategy, run in zip(strategies, result["runs"]):
        first, second = ([r["token_ids"] for r in batch] for batch in run["batches"])
        assert first == expected, strategy
        assert second == expected[::-1], strategy
        assert f"first step with the {strategy} strategy" in output
        _check_rearranged(output, run["eplb_placement"], logical=8)
    assert "EPLB rearranges synchronously" in output  # the platform's adjustment


def test_dp2_eplb_moves_w4a8_experts_with_their_scales(skewed, tmp_path):
    """DP=2 + EP 2 in ``vllm serve`` (two engine cores that step EPLB together, the idle one
    through dummy steps), W4A8 experts: rearranged while serving, tokens of the fake-quantized
    transformers model."""
    checkpoint = quantize_model(skewed, tmp_path / "w4a8", "w4a8_dynamic")
    hf = (fake_quantized(skewed, checkpoint), _tokenizer(checkpoint))
    reference = greedy_with_gaps(*hf, PROMPTS, MAX_TOKENS)
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
        "--enable-expert-parallel",
        "--enable-eplb",
        "--eplb-config",
        json.dumps(EPLB),
    ]
    with vllm_server(checkpoint, args, log, timeout=420) as base:
        for _ in range(2):  # the second round after the first round's rearrangements
            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                got = list(
                    pool.map(lambda p: greedy_completion(base, checkpoint, p, MAX_TOKENS, 300), PROMPTS)
                )
            mismatches, near_ties = compare(got, reference)
            assert not mismatches, mismatches
            assert len(near_ties) <= 1, near_ties
    text = log.read_text()
    assert "quantization=ascend" in text
    assert "first step with the allgather strategy" in text
    assert text.count("Rearranging experts sync mode") >= 2, text[-3000:]
    balance = [float(b) for b in BALANCE.findall(text)]
    # (an idle step's balancedness is 0: no load on any rank)
    assert balance and all(0.0 <= b <= 1.0 for b in balance) and max(balance) > 0, balance


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
