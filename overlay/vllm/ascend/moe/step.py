"""The MoE strategy of each forward: computed once per forward-context set (the
platform's ``set_additional_forward_context``), read by every MoE layer.

``additional_config`` key ``moe_comm_method`` (``auto`` | ``allgather`` | ``alltoall`` |
``mc2``) forces a strategy; ``validate_config`` turns a bad value, or one the layout
cannot use, into one start-up error.
"""

from __future__ import annotations

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


def forced(vllm_config) -> MoEComm | None:
    return selector.parse_override((vllm_config.additional_config or {}).get(CONFIG_KEY))


def _expert_parallel(vllm_config) -> tuple[bool, int]:
    pc = vllm_config.parallel_config
    ep = pc.data_parallel_size * pc.prefill_context_parallel_size * pc.tensor_parallel_size
    return bool(pc.enable_expert_parallel) and ep > 1, ep


def moe_layout(vllm_config, soc: str, choice: MoEComm | None) -> MoELayout:
    """The static inputs of the strategy choice for this config on SoC ``soc``."""
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
    return MoELayout(
        expert_parallel=expert_parallel,
        ep_size=ep if expert_parallel else 1,
        tp_size=tp,
        num_experts=mc.get_num_experts(),
        top_k=mc.get_num_experts_per_tok(),
        hidden_size=mc.get_hidden_size(),
        soc=soc,
        mc2_capacity=capacity,
        linear_placement=pc.expert_placement_strategy == "linear" and not pc.enable_eplb,
        quantized=vllm_config.quant_config is not None,
    )


def _check_forced(choice: MoEComm | None, layout: MoELayout) -> None:
    reason = None if choice is None else selector.unusable_reason(choice, layout)
    if reason is not None:
        raise ValueError(f"additional_config moe_comm_method={choice.value} cannot run here: {reason}")


def validate_config(vllm_config) -> None:
    """Start-up check of ``moe_comm_method`` (SoC limits are checked again in the worker)."""
    choice = forced(vllm_config)
    if choice is None or vllm_config.model_config is None:
        return
    if not vllm_config.model_config.is_moe:
        logger.warning(
            "additional_config moe_comm_method=%s has no effect: the model has no MoE layers", choice.value
        )
        return
    _check_forced(choice, moe_layout(vllm_config, "host", choice))


@dataclass(frozen=True)
class MoEPlan:
    """What a process's MoE layers choose their strategy from: the layout and the forced
    strategy, worked out once. The worker makes it before building the model
    (``install_plan``); the MoE layers and the forward-context hook read it."""

    layout: MoELayout
    forced: MoEComm | None

    @classmethod
    def from_config(cls, vllm_config, soc: str) -> MoEPlan:
        """Checks a forced strategy against the SoC's limits (ValueError naming them)."""
        choice = forced(vllm_config)
        layout = moe_layout(vllm_config, soc, choice)
        _check_forced(choice, layout)
        return cls(layout, choice)

    def step(self, max_tokens: int) -> MoEStep:
        comm = selector.choose(max_tokens, self.layout, self.forced)
        return MoEStep(comm, max_tokens, selector.mc2_padded_tokens(max_tokens, self.layout.tp_size))

    def step_for_forward(self, num_tokens, num_tokens_across_dp) -> MoEStep | None:
        """The step of a forward from its token counts (every DP rank's when known, so
        every rank agrees); None when no count is known (the layers then use their input's)."""
        if num_tokens_across_dp is not None:
            return self.step(int(num_tokens_across_dp.max()))
        if num_tokens is not None:
            return self.step(int(num_tokens))
        return None


_installed: MoEPlan | None = None


def install_plan(plan: MoEPlan | None) -> None:
    """The worker's plan for this process (set once, before the model is built)."""
    global _installed
    _installed = plan


def installed_plan() -> MoEPlan | None:
    return _installed
