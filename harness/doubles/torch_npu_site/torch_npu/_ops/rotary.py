"""The contract double's CPU kernels for rotary: npu_rotary_mul, npu_apply_rotary_pos_emb."""

from __future__ import annotations

import torch

from .._rules import require, unmodelled
from .norm import FLOAT_TYPES


# -- npu_rotary_mul ------------------------------------------------------------------------------
def npu_rotary_mul(input, r1, r2, rotary_mode, rotate):
    """BSND input only (the layout this project passes; the op cannot tell BSND from BNSD,
    so the tables' shapes are read as BSND's)."""
    op = "npu_rotary_mul"
    if rotate is not None:
        raise unmodelled(op, "rotate")
    require(
        input.dtype in FLOAT_TYPES and input.dim() == 4, op, "ROPE.input", f"{input.dtype} rank {input.dim()}"
    )
    b, s, n, d = input.shape
    if rotary_mode == "half":
        require(
            d < 896 and d % 2 == 0 and b < 1000 and n < 1000, op, "ROPE.half", f"input {tuple(input.shape)}"
        )
        allowed, rule = {(1, s, 1, d), (b, s, 1, d), (b, s, n, d)}, "ROPE.half_tables"
    elif rotary_mode == "interleave":
        require(d < 896 and d % 2 == 0 and b * n < 1000, op, "ROPE.interleave", f"input {tuple(input.shape)}")
        allowed, rule = {(1, s, 1, d)}, "ROPE.interleave_tables"
    else:
        raise unmodelled(op, f"rotary_mode {rotary_mode!r}")
    for name, t in (("r1", r1), ("r2", r2)):
        require(
            tuple(t.shape) in allowed,
            op,
            rule,
            f"{name} {tuple(t.shape)} for BSND input {tuple(input.shape)}",
        )
        require(bool(t.float().abs().le(1.0).all()), op, "ROPE.range", f"{name} has values outside [-1, 1]")
    x = input.float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        turned = torch.cat((-x2, x1), dim=-1)
    else:
        turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return (r1.float() * x + r2.float() * turned).to(input.dtype)


# -- npu_apply_rotary_pos_emb (query and key in one launch, in place) -----------------------------
APPLY_ROPE = "npu_apply_rotary_pos_emb"


def npu_apply_rotary_pos_emb(query, key, cos, sin, layout, rotary_mode):
    """The Atlas A2/A3 branch of its docs: "half" mode, TND (3-D) or BSND (4-D), D 64 or 128,
    cos/sin with one head; query and key updated in place and returned ("原地更新")."""
    op = APPLY_ROPE
    tensors = {"query": query, "key": key, "cos": cos, "sin": sin}
    require(rotary_mode == "half", op, "ARPE.mode", f"rotary_mode {rotary_mode!r}")
    require(layout in ("TND", "BSND"), op, "ARPE.layout", f"layout {layout!r}")
    rank = 3 if layout == "TND" else 4
    for name, t in tensors.items():
        require(
            t.dim() == rank and t.numel() > 0 and t.shape[-1] in (64, 128),
            op,
            "ARPE.d",
            f"{name} {tuple(t.shape)} in {layout}",
        )
    require(
        len({t.dtype for t in tensors.values()}) == 1 and query.dtype in FLOAT_TYPES,
        op,
        "ARPE.dtype",
        ", ".join(f"{n} {t.dtype}" for n, t in tensors.items()),
    )
    lead = rank - 2  # T, or B and S
    require(
        query.shape[-1] == key.shape[-1]
        and cos.shape == sin.shape
        and cos.shape[-2] == 1
        and all(t.shape[:lead] == query.shape[:lead] for t in tensors.values()),
        op,
        "ARPE.shapes",
        ", ".join(f"{n} {tuple(t.shape)}" for n, t in tensors.items()),
    )
    require(
        query.is_contiguous() and key.is_contiguous(),
        op,
        "PROJECT.in_place_contiguous",
        f"query contiguous={query.is_contiguous()}, key contiguous={key.is_contiguous()}",
    )
    c, s = cos.float(), sin.float()
    for x in (query, key):
        h = x.float()
        first, second = h.chunk(2, dim=-1)
        x.copy_(h * c + torch.cat((-second, first), dim=-1) * s)
    return query, key
