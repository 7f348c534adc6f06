"""What the contract double's CPU kernels share: dtypes, sizes and the refusal of
unmodelled arguments."""

from __future__ import annotations

import torch

from .._rules import unmodelled

FIA = "npu_fused_infer_attention_score"
HALF_TYPES = (torch.float16, torch.bfloat16)
MASK_SIZE = 2048
INT_MAX = 2147483647  # pre_tokens/next_tokens when unset


def _refuse_unmodelled(op: str, a: dict, names: tuple[str, ...]) -> None:
    """Optional arguments the double has no semantics for must be left unset."""
    for name in names:
        if a[name] is not None:
            raise unmodelled(op, name)


def _contiguous(t: torch.Tensor | None) -> bool:
    return t is None or t.is_contiguous()
