"""The model call of a step whose tokens prefill context parallel (PCP) splits.

The attention metadata builders plan the step from the whole batch (``attention/cp_step.py``); the
runner then runs only this rank's rows of it: the inputs are cut to ``local_index``, the
slot mappings are put in the gathered-row order the attention layers write from, and after
the model the PCP ranks' hidden states are all-gathered and put back into the step's
order, so sampling sees the batch it scheduled. Without a split step it is the plain call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm.forward_context import get_forward_context

from vllm.ascend.attention.cp_step import CPStep


def split_step() -> CPStep | None:
    """The plan of this forward when PCP splits its tokens (None otherwise: no context
    parallelism, PCP off, or a dummy forward without attention metadata)."""
    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, dict):
        return None
    for m in metadata.values():
        step = getattr(m, "cp_step", None)
        if step is not None and step.split:
            return step
    return None


def run_model(forward: Callable[..., torch.Tensor], inputs: dict, device: torch.device) -> torch.Tensor:
    """``forward(**inputs)`` on this PCP rank's rows, returning every row of the step."""
    step = split_step()
    if step is None:
        return forward(**inputs)
    from vllm.distributed.parallel_state import get_pcp_group

    local, order, restore = (step.tensor(n, device) for n in ("local_index", "gather_order", "restore"))
    ctx = get_forward_context()
    permuted: dict[int, torch.Tensor] = {}
    for name, slots in ctx.slot_mapping.items():
        if id(slots) not in permuted:  # layers of one KV-cache group share one tensor
            ordered = slots[order.clamp(min=0)]
            permuted[id(slots)] = torch.where(order >= 0, ordered, torch.full_like(ordered, -1))
        ctx.slot_mapping[name] = permuted[id(slots)]
    local_inputs = dict(inputs)
    for key in ("input_ids", "inputs_embeds"):
        if inputs.get(key) is not None:
            local_inputs[key] = inputs[key][local]
    positions = inputs.get("positions")
    if positions is not None:
        local_inputs["positions"] = positions[..., local]
    num_rows = positions.shape[-1] if positions is not None else inputs["input_ids"].shape[0]
    # MoE routers skip the rows marked as padding: here the rows past this rank's tokens
    step_padding = ctx.is_padding
    ctx.is_padding = torch.arange(step.local_rows, device=device) >= step.num_local_tokens
    try:
        hidden = forward(**local_inputs)
    finally:
        ctx.is_padding = step_padding
    gathered = get_pcp_group().all_gather(hidden.contiguous(), dim=0)
    rows = torch.zeros(num_rows, dtype=torch.int64, device=restore.device)  # padding rows: any row
    rows[: restore.shape[0]] = restore
    return gathered[rows]
