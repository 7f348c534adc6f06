"""The MoE strategy of each forward: computed once per forward-context set (the
platform's ``set_additional_forward_context``), read by every MoE layer.

``additional_config`` key ``moe_comm_method`` (``auto`` | ``allgather`` | ``alltoall`` |
``mc2``) forces a strategy; ``validate_config`` turns a bad value, or one the layout
cannot use, into one start-up error.

MC2's HCCL buffer (``HCCL_BUFFSIZE``, MB; 200 when unset) must hold the dispatch of the
largest per-rank batch MC2 may carry (the formula in ``selector.mc2_buffer_bytes``). On an
A2/A3 NPU the worker checks it before the model is built: a forced ``mc2`` that does not
fit stops with the value to set; the automatic choice lowers MC2's capacity to what the
buffer holds (larger steps take the fallback strategy) and logs one line naming the
HCCL_BUFFSIZE that lets MC2 carry its full batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm.logger import init_logger

from vllm.ascend.moe import selector
from vllm.ascend.moe.selector import MoEComm, MoELayout

logger = init_logger(__name__)
CONFIG_KEY = "moe_comm_method"


@dataclass(frozen=True)
class MoEStep:
    comm: MoEComm
    max_tokens: int  # the largest token count of any DP rank in this forward
    mc2_padded_tokens: int  # rows each TP group pads to when the step runs MC2


def forced_strategy(vllm_config) -> MoEComm | None:
    """The strategy ``--additional-config '{"moe_comm_method": ...}'`` forces, or None (auto)."""
    return selector.parse_override((vllm_config.additional_config or {}).get(CONFIG_KEY))


def _expert_parallel(vllm_config) -> tuple[bool, int]:
    pc = vllm_config.parallel_config
    ep = pc.data_parallel_size * pc.prefill_context_parallel_size * pc.tensor_parallel_size
    return bool(pc.enable_expert_parallel) and ep > 1, ep


def redundant_experts(parallel_config) -> int:
    """EPLB's redundant replicas: the layers hold that many physical experts more than the
    model's, placed over the EP ranks like the others (``moe/eplb.py``)."""
    if not parallel_config.enable_eplb:
        return 0
    return parallel_config.eplb_config.num_redundant_experts or 0


def moe_layout(
    vllm_config, soc: str, choice: MoEComm | None, hccl_buffsize_mb: int | None = None
) -> MoELayout:
    """The static inputs of the strategy choice for this config on SoC ``soc``; with
    ``hccl_buffsize_mb`` (an NPU), MC2's capacity is fitted to that HCCL buffer."""
    pc, sc, mc = vllm_config.parallel_config, vllm_config.scheduler_config, vllm_config.model_config
    expert_parallel, ep = _expert_parallel(vllm_config)
    spec = vllm_config.speculative_config
    num_spec = (spec.num_speculative_tokens or 0) if spec is not None else 0
    tp = pc.tensor_parallel_size
    if choice is MoEComm.MC2:
        # Forced MC2 carries as much as the op allows, prefill included.
        capacity = selector.mc2_capacity(sc.max_num_batched_tokens, 0, tp, soc)
    else:
        capacity = selector.mc2_capacity(sc.max_num_seqs, num_spec, tp, soc)
    layout = MoELayout(
        expert_parallel=expert_parallel,
        ep_size=ep if expert_parallel else 1,
        tp_size=tp,
        num_experts=mc.get_num_experts() + redundant_experts(pc),
        top_k=mc.get_num_experts_per_tok(),
        hidden_size=mc.get_hidden_size(),
        soc=soc,
        mc2_capacity=capacity,
        linear_placement=pc.expert_placement_strategy == "linear",
        quantized=vllm_config.quant_config is not None,
    )
    if hccl_buffsize_mb is None or selector.unusable_reason(MoEComm.MC2, layout) is not None:
        return layout
    return fit_mc2_buffer(layout, choice, hccl_buffsize_mb)


def fit_mc2_buffer(layout: MoELayout, choice: MoEComm | None, buffsize_mb: int) -> MoELayout:
    """``layout`` with MC2's capacity within an HCCL buffer of ``buffsize_mb``. A forced
    MC2 that does not fit raises ValueError naming the HCCL_BUFFSIZE to set."""
    tp = layout.tp_size
    per_rank = layout.mc2_capacity // tp
    need = selector.mc2_buffsize_mb(layout, per_rank)
    if need <= buffsize_mb:
        return layout
    what = (
        f"an MC2 dispatch of {per_rank} tokens per rank (EP {layout.ep_size}, {layout.num_experts} "
        f"experts, top-k {layout.top_k}, hidden {layout.hidden_size}, Atlas {layout.soc}) needs an "
        f"HCCL buffer of {need} MB but HCCL_BUFFSIZE is {buffsize_mb}"
    )
    if choice is MoEComm.MC2:
        raise ForcedStrategyRefused(
            choice, f"{what}; set HCCL_BUFFSIZE={need} (or lower --max-num-batched-tokens)"
        )
    fit = selector.mc2_tokens_within(layout, buffsize_mb, per_rank)
    if selector.mc2_selectable(layout):
        fallback = selector.select(layout.mc2_capacity + 1, layout).value
        logger.warning(
            "MoE: %s, so MC2 carries at most %d tokens per rank and larger steps use %s; "
            "set HCCL_BUFFSIZE=%d to let MC2 carry them",
            what,
            fit,
            fallback,
            need,
        )
    return dataclasses.replace(layout, mc2_capacity=fit * tp)


class ForcedStrategyRefused(ValueError):
    """A forced ``moe_comm_method`` this configuration cannot run, and why."""

    def __init__(self, choice: MoEComm, reason: str) -> None:
        super().__init__(f"additional_config moe_comm_method={choice.value} cannot run here: {reason}")
        self.reason = reason


def _check_forced(choice: MoEComm | None, layout: MoELayout) -> None:
    if choice is None:
        return
    reason = selector.unusable_reason(choice, layout)
    if reason is not None:
        raise ForcedStrategyRefused(choice, reason)


def _check_forced_on_ascend(vllm_config, choice: MoEComm) -> None:
    """A forced strategy must run on at least one Atlas SoC, HCCL_BUFFSIZE included (the
    SoC itself is known in the worker only: asking for it starts the NPU runtime)."""
    from vllm.ascend import envs

    reasons = []
    for soc in ("A2", "A3"):
        try:
            _check_forced(choice, moe_layout(vllm_config, soc, choice, envs.hccl_buffsize_mb()))
            return
        except ForcedStrategyRefused as exc:
            reasons.append(f"on Atlas {soc}: {exc.reason}")
    raise ForcedStrategyRefused(choice, "; ".join(reasons))


def validate_config(vllm_config) -> None:
    """Start-up check of ``moe_comm_method`` (SoC limits are checked again in the worker)."""
    choice = forced_strategy(vllm_config)
    if choice is None or vllm_config.model_config is None:
        return
    if not vllm_config.model_config.is_moe:
        logger.warning(
            "additional_config moe_comm_method=%s has no effect: the model has no MoE layers", choice.value
        )
        return
    _check_forced(choice, moe_layout(vllm_config, "host", choice))
    from vllm.ascend import envs

    if choice is MoEComm.MC2 and not envs.emulate():
        _check_forced_on_ascend(vllm_config, choice)


@dataclass(frozen=True)
class MoEPlan:
    """What a process's MoE layers choose their strategy from: the layout and the forced
    strategy, worked out once. The worker makes it before building the model
    (``install_plan``); the MoE layers and the forward-context hook read it."""

    layout: MoELayout
    forced: MoEComm | None

    @classmethod
    def from_config(cls, vllm_config, soc: str, hccl_buffsize_mb: int | None = None) -> MoEPlan:
        """Checks a forced strategy against the SoC's limits and, given the MC2 group's
        HCCL buffer (MB; on an NPU), MC2's need of it (ValueError naming them)."""
        choice = forced_strategy(vllm_config)
        layout = moe_layout(vllm_config, soc, choice, hccl_buffsize_mb)
        _check_forced(choice, layout)
        return cls(layout, choice)

    @property
    def may_use_mc2(self) -> bool:
        """Can any step of this plan run MC2 (then its group and communicator are made)?"""
        if self.forced is not None:
            return self.forced is MoEComm.MC2 and self.layout.mc2_capacity > 0
        return self.layout.mc2_capacity > 0 and selector.mc2_selectable(self.layout)

    def step(self, max_tokens: int, in_graph: bool = False) -> MoEStep:
        comm = selector.choose(max_tokens, self.layout, self.forced, in_graph)
        return MoEStep(comm, max_tokens, selector.mc2_padded_tokens(max_tokens, self.layout.tp_size))

    def step_for_forward(self, num_tokens, num_tokens_across_dp, in_graph: bool = False) -> MoEStep | None:
        """The step of a forward from its token counts (every DP rank's when known, so
        every rank agrees); None when no count is known (the layers then use their input's).
        ``in_graph``: the forward is being captured in a decode graph (every rank captures
        the same sizes, so they agree on that too)."""
        if num_tokens_across_dp is not None:
            return self.step(int(num_tokens_across_dp.max()), in_graph)
        if num_tokens is not None:
            return self.step(int(num_tokens), in_graph)
        return None


_installed: MoEPlan | None = None


def install_plan(plan: MoEPlan | None) -> None:
    """The worker's plan for this process (set once, before the model is built)."""
    global _installed
    _installed = plan


def installed_plan() -> MoEPlan | None:
    return _installed
