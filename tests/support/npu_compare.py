"""Comparing an NPU-path engine's tokens with the reference kernels' (tests/engine/): where
a different pick is a near-tie the rounding of another correct op order explains, and the
torch_npu calls the contract double logged."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.oracle import router_margins

# Reference top-1 minus top-2 logprob up to which a different pick is tolerated: two bf16
# ulps of a logit in [4, 8) (0.0625 each; logits are bf16, so a gap of exactly two ulps is
# one rounding step on each side). TP=2 all-reduces row-parallel partial sums in
# bf16 in another order than TP=1, which moves logits by about an ulp.
NEAR_TIE = 0.125
# Reference candidates per step the NPU's pick may come from (each within NEAR_TIE of the
# best): the Ascend norm, rotary and SwiGLU forms round once in float32 where the reference
# rounds after each op, so a three-way near-tie can resolve to the third.
NEAR_TIE_CANDIDATES = 5
# A Qwen-style MoE router picks its top k of softmax scores. Where the k-th and (k+1)-th
# router logits are closer (transformers, float32) than bf16 rounding moves such a gap
# (tests.support.oracle.router_margins: 1 = that layer's 90th percentile on the same
# sequence), another correct rounding order can route the token to another expert, and
# its logits then move by far more than NEAR_TIE (the fused norm and rotary forms round
# once in float32). A divergence at step s is tolerated where a token had such a router
# near-tie at step s (any layer) or earlier (a layer before the last: only those reach
# later steps, through the KV cache).
ROUTER_NEAR_TIE = 1.0


class NearTieDivergence(UserWarning):
    pass


def call_counts(directory: Path) -> dict[str, int]:
    """Per torch_npu op, the calls the contract double logged under ``directory`` (every
    process of an engine writes its own file there)."""
    counts: dict[str, int] = {}
    for path in directory.glob("*.json"):
        for op, n in json.loads(path.read_text()).items():
            counts[op] = counts.get(op, 0) + n
    return counts


def compare_tokens(
    label: str,
    reference: list[dict],
    got: list[dict],
    prompts: list[str],
    router_model: Path | None = None,
    near_tie: float = NEAR_TIE,
) -> list[str]:
    """Token-for-token comparison; returns the near-tie divergences (a token near-tie, or
    with ``router_model`` a router near-tie at or before the step), fails on anything else."""
    divergences = []
    for prompt, ref, out in zip(prompts, reference, got):
        if out["token_ids"] == ref["token_ids"]:
            continue
        step = next(i for i, (a, b) in enumerate(zip(ref["token_ids"], out["token_ids"])) if a != b)
        (top1, lp1), *others = ref["logprobs"][step]
        picked = out["token_ids"][step]
        gap = next((lp1 - lp for token, lp in others if token == picked), float("inf"))
        where = f"{label}: prompt {prompt[:40]!r} step {step}: {top1} vs {picked}"
        if gap <= near_tie:
            divergences.append(f"{where}, logprob gap {gap:.4f}")
            continue
        router = ""
        if router_model is not None:
            prompt_len, margins = router_margins(router_model, prompt, ref["token_ids"][:step])
            assert prompt_len == ref["prompt_len"], (prompt_len, ref["prompt_len"])
            # (gap, step, layer) of every router choice that can reach this step's logits
            reach = [(g, j, layer) for j, row in enumerate(margins) for layer, g in enumerate(row)]
            reach = [c for c in reach if c[1] == step or c[2] < len(margins[0]) - 1]
            closest, j, layer = min(reach)
            if closest < ROUTER_NEAR_TIE:
                divergences.append(
                    f"{where}, router near-tie at step {j} layer {layer}: gap {closest:.2f} x noise"
                )
                continue
            router = (
                f"; its closest router choice is {closest:.1f} x the bf16 noise (step {j}, layer {layer})"
            )
        raise AssertionError(
            f"{label}: prompt {prompt[:40]!r} diverges at step {step}: reference {ref['token_ids']}, "
            f"NPU path {out['token_ids']} (the NPU's pick {picked} is not within {near_tie} of the "
            f"reference's best logprob among its top {len(others) + 1}: {ref['logprobs'][step]}{router})"
        )
    return divergences
