"""The MoE communication strategies on real processes over gloo, against a dense
single-process computation of the same batch (``harness/moe_ranks.py``).

Each layout is one set of processes running every strategy on several rounds of
per-DP-rank token counts, including ranks with no tokens, experts no token picks,
fewer tokens than TP ranks, and top-k 8.
"""

from __future__ import annotations

import pytest

from harness.doubles.torch_npu_wheel import double_env
from harness.moe_ranks import run

# float32 sums in another order than the dense reference: a few ulps of the output.
FLOAT32_TOLERANCE = 1e-5
# bfloat16 (NPU-path mode): the experts' output is rounded to bf16 (8 mantissa bits)
# once per expert and once in the sum; allow two ulps of the largest output.
BF16_RELATIVE = 2 * 2**-8

LAYOUTS = {
    # name: (tp, dp, expert parallel, experts, top-k, rounds of tokens per DP rank, skewed routing)
    # DP rank 1 with 1 token on 2 TP ranks: fewer tokens than TP ranks.
    "ep2_dp2": (1, 2, True, 8, 2, [[5, 0], [1, 1], [17, 3], [0, 9]], False),
    "ep4_tp2_dp2": (2, 2, True, 8, 2, [[7, 1], [3, 0], [33, 12]], False),
    # Routing uses only the first half of the experts: two EP ranks get no rows at all.
    "ep4_dp4_top8_idle_experts": (1, 4, True, 16, 8, [[5, 0, 2, 9], [0, 0, 1, 0], [40, 3, 0, 1]], True),
    # Without EP the experts are sharded over all 4 ranks (gather/reduce-scatter only).
    "dp2_tp2_no_ep": (2, 2, False, 8, 2, [[7, 3], [0, 4]], False),
}


def _check(results: list[dict], strategies: list[str], rounds: list[list[int]], tolerance) -> None:
    for rank in results:
        assert "error" not in rank, rank.get("error")
        got = [(r["strategy"], r["tokens"]) for r in rank["results"]]
        assert got == [(s, t) for t in rounds for s in strategies], got
        for r in rank["results"]:
            assert r["error"] <= tolerance(r["scale"]), (rank["rank"], r)
            # AllToAll and MC2 return the full sum; AllGather leaves it to the runner's all-reduce.
            assert r["reduced"] == (r["strategy"] != "allgather"), r
    busy = [r for rank in results for r in rank["results"] if r["scale"] > 0]
    assert busy, "no rank had tokens: nothing was compared"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strategies_equal_dense_reference(layout):
    tp, dp, ep, experts, top_k, rounds, skew = LAYOUTS[layout]
    strategies = ["allgather", "alltoall", "mc2"] if ep else ["allgather"]
    case = {
        "tp": tp,
        "dp": dp,
        "ep": ep,
        "strategies": strategies,
        "tokens_grid": rounds,
        "experts": experts,
        "top_k": top_k,
        "hidden": 32,
        "inter": 16,
        "seed": 3,
        "skew": skew,
    }
    results = run(case)
    assert len(results) == tp * dp
    _check(results, strategies, rounds, lambda scale: FLOAT32_TOLERANCE * max(1.0, scale))
    assert all(
        r["kernels"] == ["reference_moe_experts", "reference_mc2_dispatch", "reference_mc2_combine"]
        for r in results
    ), results


@pytest.mark.parametrize("quant", ["w8a8_dynamic", "w4a8_dynamic"])
@pytest.mark.parametrize("layout", ["ep4_tp2_dp2"])
def test_quantized_experts_through_every_strategy(layout, quant):
    """The quantized MoE layer (int8 or int4 experts, per-token activations) through
    AllGather, AllToAll and MC2 equals all experts computed in one process with the same
    integer math: each expert quantizes whole rows, wherever they were sent."""
    tp, dp, ep, experts, top_k, rounds, skew = LAYOUTS[layout]
    strategies = ["allgather", "alltoall", "mc2"]
    case = {
        "tp": tp,
        "dp": dp,
        "ep": ep,
        "strategies": strategies,
        "tokens_grid": rounds,
        "experts": experts,
        "top_k": top_k,
        "hidden": 32,
        "inter": 16,
        "seed": 4,
        "skew": skew,
        "quant": quant,
    }
    results = run(case)
    _check(results, strategies, rounds, lambda scale: FLOAT32_TOLERANCE * max(1.0, scale))


@pytest.mark.parametrize("quant", [None, "w8a8_dynamic"])
def test_redundant_experts_through_every_strategy(quant):
    """EPLB's layout: 8 logical experts as 12 physical ones (4 replicas, seeded placement
    over EP 4), routes mapped to replicas by ``moe/eplb.py``. Every strategy equals the
    dense computation on the logical experts, and the load each rank recorded, summed per
    logical expert, is its routes' count."""
    strategies = ["allgather", "alltoall", "mc2"]
    rounds = [[7, 1], [3, 0], [33, 12]]
    case = {
        "tp": 2,
        "dp": 2,
        "strategies": strategies,
        "tokens_grid": rounds,
        "experts": 8,
        "redundant": 4,
        "top_k": 2,
        "hidden": 32,
        "inter": 16,
        "seed": 6,
        **({"quant": quant} if quant else {}),
    }
    results = run(case)
    _check(results, strategies, rounds, lambda scale: FLOAT32_TOLERANCE * max(1.0, scale))
    assert all(r["eplb_load_ok"] is True for rank in results for r in rank["results"]), results


@pytest.mark.parametrize("soc", ["A2", "A3"])
def test_strategies_through_torch_npu_contract(soc, tmp_path):
    """NPU-path mode: MC2 through npu_moe_distribute_dispatch_v2/combine_v2 and the
    experts through npu_grouped_matmul/npu_swiglu, all checked by the contract double,
    on each SoC the double can report (TORCH_NPU_DOUBLE_SOC): the MC2 strategy takes
    the SoC and the communicator name from the NPU device class (A3: the TP-domain
    arguments as well). Hidden size 1024: inside both SoCs' documented H ranges."""
    strategies, rounds = ["alltoall", "mc2"], [[6, 0], [3, 11]]
    case = {
        "tp": 1,
        "dp": 2,
        "strategies": strategies,
        "tokens_grid": rounds,
        "experts": 8,
        "top_k": 2,
        "hidden": 1024,
        "inter": 32,
        "seed": 5,
        "dtype": "bfloat16",
        "env": {"VLLM_ASCEND_KERNELS": "npu", **double_env(), "TORCH_NPU_DOUBLE_SOC": soc},
    }
    results = run(case)
    _check(results, strategies, rounds, lambda scale: BF16_RELATIVE * max(1.0, scale))
    for rank in results:
        assert rank["device"] == ["NPUPathDevice", soc], rank["device"]
        assert rank["kernels"] == ["npu_moe_experts", "npu_mc2_dispatch", "npu_mc2_combine"], rank["kernels"]
        calls = rank["npu_calls"]
        for op in (
            "npu::npu_moe_distribute_dispatch_v2",
            "npu::npu_moe_distribute_combine_v2",
            "npu::npu_grouped_matmul",
            "npu::npu_swiglu",
        ):
            assert calls.get(op, 0) > 0, (op, calls)


def test_reference_mc2_rejects_what_the_op_rejects():
    """The reference MC2 kernel holds callers to the op's documented preconditions."""
    import torch

    from vllm.ascend.kernels.mc2 import Mc2Comm, reference_mc2_dispatch

    comm = Mc2Comm(group=None, name="unused", ep_size=2, ep_rank=0, soc="host")
    x = torch.zeros(3, 8)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    mask = torch.tensor([True, True, False])
    bad = [
        (ids.to(torch.int64), mask, 8, "int32"),
        (torch.tensor([[0, 0], [2, 3], [4, 5]], dtype=torch.int32), mask, 8, "same expert twice"),
        (ids, torch.tensor([True, False, True]), 8, "every True before every False"),
        (ids, mask, 7, "do not split"),
        (torch.tensor([[0, 1], [2, 9], [4, 5]], dtype=torch.int32), mask, 8, "outside"),
        (ids, mask[:2], 8, "active_mask must be bool"),
    ]
    for bad_ids, bad_mask, experts, message in bad:
        with pytest.raises(ValueError, match=message):
            reference_mc2_dispatch(x, bad_ids, bad_mask, comm, experts)
