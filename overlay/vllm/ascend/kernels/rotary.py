"""Rotary position embedding of query and key heads (neox "half" and GPT-J "interleave").

Contract:
- ``full_tables(cos_sin_cache, neox)``: upstream's cache ``[P, rot]`` (the ``rot / 2``
  cosines, then the sines, per position) -> a cosine and a sine table ``[P, rot]`` at
  full rotary width, laid out for the rotation style (neox: the half repeated; GPT-J:
  each value twice in a row). Built once per model.
- ``tables_at(tables, positions)``: ``(cos, sin)``, each ``[1, T, 1, rot]`` (two gathers
  per step, shared by every layer).
- ``rotate(x, cos, sin, neox)``: ``x [T, N, rot]`` -> ``x * cos + turn(x) * sin``, where
  ``turn`` maps each pair ``(a, b)`` to ``(-b, a)``: the halves of the head (neox) or
  neighbouring elements (GPT-J). The same products and sums as upstream's native form,
  computed in float32 and rounded once (upstream's native form rounds after each op in
  half precision); in float32 the two agree exactly.

``rotate_pair(q, k, cos, sin, neox)``: both heads of a layer with the same tables.
``npu_rotate_pair``: one ``torch_npu.npu_apply_rotary_pos_emb`` (TND, "half", in place) where
its Atlas A2/A3 docs take the heads (neox, head size 64 or 128, the tables in the heads' dtype)
and both are contiguous (an in-place op on a strided view, such as a QKV projection's split,
would write a temporary copy: two copies cost more than a second rotary launch); otherwise
``npu_rotate`` per tensor.

``npu_rotate``: ``torch_npu.npu_rotary_mul`` with BSND input ``[1, T, N, rot]`` and
``1S1D`` tables (the layout its docs allow for both modes), one launch per tensor. Its
tables must lie in [-1, 1]; a cache that carries a factor (YaRN's attention factor:
gpt-oss) is rotated by ``rotate_in_torch`` with either kernel set (the factor cannot
leave the tables without another rounding of every rotated value).
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import pick, torch_npu

# npu_rotary_mul: "D < 896，且为2的倍数; B, N < 1000"
# npu_apply_rotary_pos_emb on Atlas A2/A3: D "必须等于128或者64", "half" mode only
APPLY_ROTARY_DIMS = (64, 128)
ROTARY_MUL_MAX_DIM = 896
ROTARY_MUL_MAX_HEADS = 1000


def full_tables(cos_sin_cache: torch.Tensor, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache.chunk(2, dim=-1)
    if neox:
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


def tables_at(
    tables: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    index = positions.flatten()
    cos, sin = (t.index_select(0, index)[None, :, None] for t in tables)
    return cos, sin


def _turn(x: torch.Tensor, neox: bool) -> torch.Tensor:
    if neox:
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def reference_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    h = x.to(torch.float32)
    return (h * cos[0].to(torch.float32) + _turn(h, neox) * sin[0].to(torch.float32)).to(x.dtype)


def npu_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    out = torch_npu().npu_rotary_mul(x.unsqueeze(0), cos, sin, "half" if neox else "interleave")
    return out[0]


def reference_rotate_pair(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference_rotate(q, cos, sin, neox), reference_rotate(k, cos, sin, neox)


def npu_rotate_pair(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    fused = (
        neox
        and q.shape[-1] in APPLY_ROTARY_DIMS
        and q.dtype == k.dtype == cos.dtype
        and q.is_contiguous()
        and k.is_contiguous()
    )
    if not fused:
        return npu_rotate(q, cos, sin, neox), npu_rotate(k, cos, sin, neox)
    return torch_npu().npu_apply_rotary_pos_emb(q, k, cos[0], sin[0], layout="TND", rotary_mode="half")


def takes(x: torch.Tensor, rotary_dim: int, head_size: int) -> bool:
    """Both forms rotate whole heads; torch_npu's op documents the head-size and head-count
    limits above. Outside them the caller keeps upstream's native form."""
    return (
        x.numel() > 0
        and rotary_dim == head_size
        and head_size % 2 == 0
        and head_size < ROTARY_MUL_MAX_DIM
        and x[0].numel() // head_size < ROTARY_MUL_MAX_HEADS  # x: [T, N * D] or [T, N, D]
    )


rotate = pick(reference_rotate, npu_rotate)
rotate_pair = pick(reference_rotate_pair, npu_rotate_pair)
rotate_in_torch = reference_rotate
