"""The MoE strategy selector: the documented table, the override, and agreement across
ranks whatever their local token counts."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.ascend.moe import selector
from vllm.ascend.moe.selector import MoEComm, MoELayout

# The config tests build vLLM configs in this process: the platform must be host emulation
# (set before anything resolves vLLM's current platform; every other test uses subprocesses).
os.environ.setdefault("VLLM_ASCEND_EMULATE", "1")


def layout(**kw) -> MoELayout:
    base = dict(
        expert_parallel=True,
        ep_size=16,
        tp_size=1,
        num_experts=256,
        top_k=8,
        hidden_size=7168,
        soc="A3",
        mc2_capacity=512,
    )
    base.update(kw)
    return MoELayout(**base)


HOST4 = {"soc": "host", "ep_size": 4, "num_experts": 16}
# (layout overrides, max tokens across DP, expected) -- the table in docs/moe.md
TABLE = [
    ({"expert_parallel": False}, 1, MoEComm.ALLGATHER),
    ({"expert_parallel": False}, 100_000, MoEComm.ALLGATHER),
    ({"ep_size": 1}, 8, MoEComm.ALLGATHER),
    # A3: MC2 within capacity, AllToAll above.
    ({}, 1, MoEComm.MC2),
    ({}, 512, MoEComm.MC2),
    ({}, 513, MoEComm.ALLTOALL),
    ({"num_experts": 250}, 8, MoEComm.ALLTOALL),  # experts do not split evenly: no MC2
    ({"hidden_size": 512}, 8, MoEComm.ALLTOALL),  # A3 MC2 needs hidden in [1024, 8192]
    ({"linear_placement": False}, 8, MoEComm.ALLTOALL),
    # A2: MC2 only for EP >= 16 with <= 24 experts per device, within capacity; else AllGather.
    ({"soc": "A2", "mc2_capacity": 256}, 256, MoEComm.MC2),
    ({"soc": "A2", "mc2_capacity": 256}, 257, MoEComm.ALLGATHER),
    ({"soc": "A2", "ep_size": 8, "num_experts": 64}, 8, MoEComm.ALLGATHER),
    ({"soc": "A2", "ep_size": 8, "num_experts": 256}, 8, MoEComm.ALLGATHER),
    ({"soc": "A2", "ep_size": 16, "num_experts": 512}, 8, MoEComm.ALLGATHER),  # 32 experts per device
    # Other SoCs: AllGather. Host: by the measured threshold.
    ({"soc": "other"}, 8, MoEComm.ALLGATHER),
    (HOST4, selector.HOST_ALLTOALL_MIN_TOKENS - 1, MoEComm.ALLGATHER),
    (HOST4, selector.HOST_ALLTOALL_MIN_TOKENS, MoEComm.ALLTOALL),
    ({**HOST4, "ep_size": 2}, 100_000, MoEComm.ALLGATHER),
]


@pytest.mark.parametrize("overrides, tokens, expected", TABLE)
def test_selector_table(overrides, tokens, expected):
    assert selector.select(tokens, layout(**overrides)) is expected


def test_mc2_capacity_and_padding():
    # A decode batch of 256 requests with 1 draft token each, TP 4: 128 per TP rank.
    assert selector.mc2_capacity(256, 1, 4, "A3") == 512
    assert selector.mc2_capacity(4096, 0, 2, "A3") == 1024  # capped at 512 per TP rank
    assert selector.mc2_capacity(4096, 0, 2, "A2") == 512  # A2: 256 per TP rank
    assert selector.mc2_capacity(3, 0, 2, "A3") == 4  # rounded up to whole TP ranks
    assert [selector.mc2_padded_tokens(n, 4) for n in (0, 1, 4, 5, 9)] == [4, 4, 4, 8, 12]


def test_forced_strategy():
    lay = layout(soc="host")
    assert selector.choose(1, lay, MoEComm.ALLTOALL) is MoEComm.ALLTOALL
    assert selector.choose(100_000, lay, MoEComm.ALLGATHER) is MoEComm.ALLGATHER
    assert selector.choose(512, lay, MoEComm.MC2) is MoEComm.MC2
    assert selector.choose(513, lay, MoEComm.MC2) is MoEComm.ALLTOALL  # beyond what the op can carry
    assert selector.parse_override(None) is None and selector.parse_override("AUTO") is None
    assert selector.parse_override(" mc2 ") is MoEComm.MC2
    for bad in ("all2all", "", 3):
        with pytest.raises(ValueError, match="moe_comm_method must be one of auto, allgather, alltoall, mc2"):
            selector.parse_override(bad)


def test_unusable_layouts_are_named():
    assert "expert parallelism" in selector.unusable_reason(MoEComm.ALLTOALL, layout(expert_parallel=False))
    assert "expert parallelism" in selector.unusable_reason(MoEComm.MC2, layout(ep_size=1))
    assert "split evenly" in selector.unusable_reason(MoEComm.MC2, layout(num_experts=250))
    assert "top-k" in selector.unusable_reason(MoEComm.MC2, layout(top_k=17))
    assert "Atlas A2" in selector.unusable_reason(MoEComm.MC2, layout(soc="A2", ep_size=12, num_experts=48))
    assert selector.unusable_reason(MoEComm.ALLGATHER, layout(expert_parallel=False)) is None
    host = layout(soc="host", hidden_size=64, num_experts=8, ep_size=2)
    assert selector.unusable_reason(MoEComm.MC2, host) is None


@pytest.fixture(scope="module")
def moe_config(tiny_models):
    from vllm.config import ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

    made: dict = {}

    def make(dp: int, tp: int, ep: bool, forced: str | None = None) -> VllmConfig:
        if (dp, tp, ep, forced) in made:
            return made[(dp, tp, ep, forced)]
        model = ModelConfig(model=str(tiny_models["deepseek_v3"]), dtype="float32", max_model_len=512)
        made[(dp, tp, ep, forced)] = cfg = VllmConfig(
            model_config=model,
            parallel_config=ParallelConfig(
                data_parallel_size=dp, tensor_parallel_size=tp, enable_expert_parallel=ep
            ),
            scheduler_config=SchedulerConfig(max_model_len=512, is_encoder_decoder=False),
            additional_config={"moe_comm_method": forced} if forced else {},
        )
        return cfg

    return make


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(min_value=0, max_value=5000), min_size=1, max_size=8), data=st.data())
def test_ranks_with_different_token_counts_agree(moe_config, counts, data):
    """Every DP rank computes the step from its own count and the shared counts: all agree,
    idle ranks (a one-token dummy batch, or nothing) included."""
    from vllm.ascend.moe.step import MoEPlan

    if max(counts) == 0:
        counts[0] = 1  # an engine step has at least one rank with a token (the dummy batch)
    tp = data.draw(st.sampled_from([1, 2]))
    cfg = moe_config(dp=len(counts), tp=tp, ep=True)
    across = torch.tensor(counts, dtype=torch.int32)
    plan = MoEPlan.from_config(cfg, "host")
    steps = {plan.step_for_forward(n, across) for n in counts}
    assert len(steps) == 1, steps
    [step] = steps
    assert step.max_tokens == max(counts)
    assert step.mc2_padded_tokens % tp == 0 and step.mc2_padded_tokens >= max(counts)


def test_config_override_is_checked_at_start_up(moe_config):
    from vllm.ascend.errors import AscendConfigError
    from vllm.ascend.moe.step import MoEPlan

    # The platform checks the override while vLLM builds its config (engine start-up).
    with pytest.raises(AscendConfigError, match="moe_comm_method=alltoall cannot run here: alltoall needs"):
        moe_config(dp=2, tp=1, ep=False, forced="alltoall")
    with pytest.raises(AscendConfigError, match="one of auto, allgather, alltoall, mc2; got 'deepep'"):
        moe_config(dp=2, tp=1, ep=True, forced="deepep")
    forced = moe_config(dp=2, tp=2, ep=True, forced="mc2")
    plan = MoEPlan.from_config(forced, "host")
    lay, choice = plan.layout, plan.forced
    assert lay.ep_size == 4 and lay.soc == "host" and dataclasses.asdict(lay)["num_experts"] == 8
    assert choice is MoEComm.MC2 and lay.mc2_capacity == 2 * 512  # forced: up to the op's limit per TP rank
    assert plan.step_for_forward(3, torch.tensor([3, 1])).comm is MoEComm.MC2


# -- MC2's HCCL buffer (HCCL_BUFFSIZE) -------------------------------------------------------
def test_mc2_buffer_formula_numbers():
    """The dispatch_v2 doc's formulas, evaluated by hand for DeepSeek-V3 shapes (E 256, K 8,
    H 7168): A3 EP16 ``2*(16*BS*16*Align512(Align32(14336)+64) + 9*BS*Align512(14336))``,
    A2 EP16 ``2*(BS*16*min(16, 8)*7168*2 + 2 MB)``."""
    per_token_a3 = 2 * (16 * 16 * 14848 + 9 * 14336)
    assert selector.mc2_buffer_bytes("A3", 1, 16, 256, 8, 7168) == per_token_a3 == 7_860_224
    assert selector.mc2_buffer_bytes("A3", 256, 16, 256, 8, 7168) == 256 * per_token_a3
    assert selector.mc2_buffer_bytes("A2", 256, 16, 256, 8, 7168) == 2 * (256 * 16 * 8 * 7168 * 2 + (2 << 20))
    assert selector.mc2_buffer_bytes("host", 256, 16, 256, 8, 7168) == 0
    assert selector.mc2_buffsize_mb(layout(), 256) == 1919
    assert selector.mc2_buffsize_mb(layout(soc="A2"), 256) == 900
    # the largest batch within a buffer: its need fits, one more token's does not
    fit = selector.mc2_tokens_within(layout(), 200, 512)
    assert selector.mc2_buffsize_mb(layout(), fit) <= 200 < selector.mc2_buffsize_mb(layout(), fit + 1)
    assert fit == 26


def test_auto_mc2_is_capped_to_the_buffer_with_one_line(caplog):
    from vllm.ascend.moe.step import fit_mc2_buffer

    full = layout(mc2_capacity=256)
    assert fit_mc2_buffer(full, None, 1919) is full  # enough: unchanged
    with caplog.at_level("WARNING"):
        capped = fit_mc2_buffer(full, None, 200)
    assert capped.mc2_capacity == 26
    assert selector.select(26, capped) is MoEComm.MC2 and selector.select(27, capped) is MoEComm.ALLTOALL
    lines = [r.getMessage() for r in caplog.records if "HCCL_BUFFSIZE" in r.getMessage()]
    assert len(lines) == 1 and "set HCCL_BUFFSIZE=1919" in lines[0] and "use alltoall" in lines[0], lines
    # a buffer too small for one token: MC2 never runs
    assert fit_mc2_buffer(full, None, 4).mc2_capacity == 0
    assert selector.select(1, fit_mc2_buffer(full, None, 4)) is MoEComm.ALLTOALL
    # TP: the capacity stays a whole number of tokens per TP rank
    assert fit_mc2_buffer(layout(tp_size=2, mc2_capacity=512), None, 200).mc2_capacity == 52


def test_forced_mc2_beyond_the_buffer_stops_naming_the_value():
    from vllm.ascend.moe.step import fit_mc2_buffer

    with pytest.raises(
        ValueError, match=r"moe_comm_method=mc2 cannot run here: .* needs an HCCL buffer of 3838 MB"
    ):
        fit_mc2_buffer(layout(), MoEComm.MC2, 200)
    with pytest.raises(ValueError, match="set HCCL_BUFFSIZE=3838"):
        fit_mc2_buffer(layout(), MoEComm.MC2, 3837)
    assert fit_mc2_buffer(layout(), MoEComm.MC2, 3838).mc2_capacity == 512


def test_worker_plan_fits_the_buffer_and_makes_mc2_only_when_usable(moe_config):
    from vllm.ascend.moe.step import MoEPlan

    cfg = moe_config(dp=2, tp=2, ep=True, forced="mc2")  # tiny DeepSeek-V3: EP 4, 8 experts
    hidden = cfg.model_config.get_hidden_size()
    need = selector.mc2_buffsize_mb(MoEPlan.from_config(cfg, "A2").layout, 256)
    assert MoEPlan.from_config(cfg, "A2", need).may_use_mc2
    with pytest.raises(ValueError, match=f"set HCCL_BUFFSIZE={need}"):
        MoEPlan.from_config(cfg, "A2", need - 1)
    if not 1024 <= hidden <= 8192:  # the A3 hidden-size cap, at start-up for a forced MC2
        with pytest.raises(ValueError, match="Atlas A3 needs EP <= 768 and hidden size in"):
            MoEPlan.from_config(cfg, "A3", 10_000)
    auto = MoEPlan.from_config(moe_config(dp=2, tp=2, ep=True), "A2", 10_000)
    assert not auto.may_use_mc2  # A2 auto: MC2 only from EP 16: no MC2 group or buffer is made
    assert not MoEPlan.from_config(moe_config(dp=2, tp=2, ep=True), "host").may_use_mc2


def test_forced_mc2_is_checked_at_config_time_on_an_npu(moe_config, monkeypatch):
    """Without host emulation the API process checks a forced MC2 against every Atlas SoC
    (it may not ask the NPU which one it is): one error when none can run it."""
    from vllm.ascend.moe.step import validate_config

    cfg = moe_config(dp=2, tp=2, ep=True, forced="mc2")
    monkeypatch.setenv("VLLM_ASCEND_EMULATE", "0")
    monkeypatch.setenv("HCCL_BUFFSIZE", "100000")
    validate_config(cfg)  # fits on A2 (the tiny model's hidden size is below A3's range)
    monkeypatch.setenv("HCCL_BUFFSIZE", "1")
    with pytest.raises(
        ValueError, match=r"mc2 cannot run here: on Atlas A2: .*set HCCL_BUFFSIZE=\d+.*; on Atlas A3"
    ):
        validate_config(cfg)
    monkeypatch.setenv("VLLM_ASCEND_EMULATE", "1")
    validate_config(cfg)  # host emulation: no SoC limits, no HCCL


def test_eplb_layout_counts_the_redundant_experts_for_mc2(moe_config):
    """With EPLB the layers hold E + R physical experts, placed linearly: MC2 dispatches over
    all of them, so its limits see E + R (8 + 2 do not split over EP 4; 8 + 4 do)."""
    import copy

    from vllm.ascend.moe import selector
    from vllm.ascend.moe.step import MoEPlan

    cfg = copy.deepcopy(moe_config(dp=2, tp=2, ep=True))
    cfg.parallel_config.enable_eplb = True
    for redundant, reason in ((4, None), (2, "the 10 routed experts to split evenly over the 4 EP ranks")):
        cfg.parallel_config.eplb_config.num_redundant_experts = redundant
        layout = MoEPlan.from_config(cfg, "host").layout
        assert layout.num_experts == 8 + redundant and layout.linear_placement
        unusable = selector.unusable_reason(MoEComm.MC2, layout)
        assert unusable is None if reason is None else reason in unusable, unusable
