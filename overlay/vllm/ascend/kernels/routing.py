"""MoE routing: router logits to the experts each token goes to, and their weights.

Contract: ``logits [T, E]`` (any float dtype), a ``Routing`` (the scoring options of
upstream's fused-MoE layer) and an optional ``bias [E]`` (``e_score_correction_bias``);
returns ``topk_weights [T, k]`` float32 and ``topk_ids [T, k]`` int32, in no particular
slot order (the experts' outputs are summed over the slots).

The formula is upstream vLLM 0.33's routers' (``FusedTopKRouter``, ``FusedTopKBiasRouter``,
``GroupedTopKRouter``):

1. ``scores = softmax(logits)`` or ``sigmoid(logits)`` (float32);
2. ``choice = scores + bias`` (the bias only chooses, it never weighs);
3. grouped: the experts fall into ``num_expert_group`` equal groups; a group scores the
   maximum of its ``choice`` values (the sum of its top two with a bias); only the
   ``topk_group`` best groups stay eligible;
4. ``ids = topk(choice, k)`` among the eligible experts; ``weights = scores[ids]``;
5. ``renormalize``: ``weights / sum(weights)``; then ``weights * routed_scaling_factor``.

``npu_route`` calls ``npu_moe_gating_top_k_softmax_v2`` for plain softmax top-k (``renorm=1``
when the layer renormalises: the softmax of the top k logits, which equals the renormalised
top-k softmax) and ``npu_moe_gating_top_k`` for the rest (sigmoid, bias, groups); where the
expert count or grouping is outside what the fused op documents, it computes the same formula
with plain torch ops. The gating op renormalises sigmoid weights itself and never softmax ones
(CANN's aclnnMoeGatingTopK, Step 5: only "normType = 1 or (normType = 0 and renorm = 1)", and
renorm must be 0): a renormalised sigmoid layer takes its weights as they come (``y / (sum(y) +
eps) * routed_scaling_factor``, eps 1e-20: below float32's resolution next to a sum of top-k
scores), a softmax layer divides by their sum itself, and a sigmoid layer without
renormalisation gathers its weights from the op's scores.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vllm.ascend.kernels import pick, torch_npu

SCORING = ("softmax", "sigmoid")
# npu_moe_gating_top_k_softmax_v2: "k<=1024"; npu_moe_gating_top_k: experts "不大于2048", a
# group's size "大于2" and "按照32个数对齐后乘group_count的结果不大于2048".
SOFTMAX_OP_MAX_K = 1024
GATING_OP_MAX_EXPERTS = 2048


@dataclass(frozen=True)
class Routing:
    """The scoring options of one MoE layer (upstream's FusedMoE arguments, resolved)."""

    top_k: int
    scoring_func: str = "softmax"
    renormalize: bool = False
    num_expert_group: int = 1  # 1: not grouped
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def check(self, num_experts: int) -> None:
        """Refuse what the Ascend routing does not compute, with the reason."""
        if self.scoring_func not in SCORING:
            raise ValueError(
                f"Ascend MoE routing supports scoring_func {' or '.join(SCORING)}, not {self.scoring_func!r}"
            )
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"MoE top_k {self.top_k} must be between 1 and the {num_experts} experts")
        groups = self.num_expert_group
        if groups < 1 or num_experts % groups:
            raise ValueError(f"{num_experts} experts cannot form {groups} equal expert groups")
        if not 1 <= self.topk_group <= groups:
            raise ValueError(f"topk_group {self.topk_group} must be between 1 and num_expert_group {groups}")
        if self.top_k > num_experts // groups * self.topk_group:
            raise ValueError(
                f"top_k {self.top_k} exceeds the {num_experts // groups * self.topk_group} experts "
                f"of the {self.topk_group} chosen group(s)"
            )


def split_zero_experts(
    weights: torch.Tensor, ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routes over ``num_experts`` real experts followed by zero-computation ones (LongCat's
    identity experts, ids ``>= num_experts``): the routes with each zero expert's slot
    turned into expert 0 at weight 0 (every strategy and expert kernel sees valid ids, as
    upstream's zero-expert router leaves them), and per token ``[T, 1]`` the summed weight of
    its zero experts, which an identity expert's output is that weight times the token."""
    zero = ids >= num_experts
    zero_weight = torch.where(zero, weights, 0.0).sum(dim=-1, keepdim=True)
    return torch.where(zero, 0.0, weights), torch.where(zero, 0, ids), zero_weight


def _scores(logits: torch.Tensor, routing: Routing) -> torch.Tensor:
    x = logits.to(torch.float32)
    return torch.softmax(x, dim=-1) if routing.scoring_func == "softmax" else torch.sigmoid(x)


def _finish(weights: torch.Tensor, ids: torch.Tensor, routing: Routing):
    weights = weights.to(torch.float32)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routing.routed_scaling_factor != 1.0:
        weights = weights * routing.routed_scaling_factor
    return weights, ids.to(torch.int32)


def reference_route(
    logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _scores(logits, routing)
    choice = scores if bias is None else scores + bias.to(torch.float32).unsqueeze(0)
    groups = routing.num_expert_group
    if groups > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, groups, experts // groups)
        if bias is None:
            group_score = grouped.amax(dim=-1)
        else:
            group_score = grouped.topk(min(2, experts // groups), dim=-1).values.sum(dim=-1)
        kept = group_score.topk(routing.topk_group, dim=-1).indices
        eligible = torch.zeros(tokens, groups, dtype=torch.bool, device=choice.device)
        eligible.scatter_(1, kept, True)
        choice = choice.masked_fill(~eligible.repeat_interleave(experts // groups, dim=1), float("-inf"))
    ids = choice.topk(routing.top_k, dim=-1).indices
    return _finish(scores.gather(1, ids), ids, routing)


def _gating_op_takes(num_experts: int, routing: Routing) -> bool:
    """npu_moe_gating_top_k's documented limits on the expert count and grouping (the
    grouping itself was checked when the layer loaded, ``Routing.check``)."""
    groups = routing.num_expert_group
    per_group = num_experts // groups
    aligned = -(-per_group // 32) * 32
    return (
        num_experts <= GATING_OP_MAX_EXPERTS and per_group > 2 and aligned * groups <= GATING_OP_MAX_EXPERTS
    )


def npu_route(
    logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    npu = torch_npu()
    x = logits.to(torch.float32)  # scores in float32, as the reference computes them
    num_experts = x.shape[-1]
    plain_softmax = routing.scoring_func == "softmax" and bias is None and routing.num_expert_group == 1
    if plain_softmax and routing.top_k <= SOFTMAX_OP_MAX_K:
        # the _v2 op (Atlas A2 and A3; the first one lists A2 only)
        y, ids, _ = npu.npu_moe_gating_top_k_softmax_v2(x, k=routing.top_k, renorm=int(routing.renormalize))
        return _finish(y, ids, dataclasses.replace(routing, renormalize=False))
    if _gating_op_takes(num_experts, routing):
        sigmoid = routing.scoring_func == "sigmoid"
        y, ids, norm = npu.npu_moe_gating_top_k(
            x,
            routing.top_k,
            bias=None if bias is None else bias.to(torch.float32),
            k_group=routing.topk_group,
            group_count=routing.num_expert_group,
            group_select_mode=0 if bias is None else 1,  # group max, or the sum of its top two
            renorm=0,
            norm_type=int(sigmoid),
            out_flag=sigmoid and not routing.renormalize,
            # softmax weights come out unnormalised: renormalised and scaled here instead
            routed_scaling_factor=routing.routed_scaling_factor if sigmoid else 1.0,
        )
        if not sigmoid:
            return _finish(y, ids, routing)
        if routing.renormalize:  # the op's own renormalised, scaled weights
            return y, ids
        return _finish(norm.gather(1, ids.to(torch.int64)), ids, routing)
    return reference_route(logits, routing, bias)


route = pick(reference_route, npu_route)
