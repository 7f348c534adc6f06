"""The contract double's CPU kernels for the MLA prolog: npu_kv_rmsnorm_rope_cache,
npu_interleave_rope."""

from __future__ import annotations

import torch

from .._rules import require, unmodelled
from ._common import HALF_TYPES, _refuse_unmodelled
from .norm import _rms

# -- npu_kv_rmsnorm_rope_cache / npu_interleave_rope (MLA prolog) ----------------------------------
# Both rotate a GPT-J (interleaved) input and return it in the half layout: the docs' formula
# reshapes the rope part to [..., D/2, 2] and transposes before a rotate-half rotation.
KRRC = "npu_kv_rmsnorm_rope_cache"
IROPE = "npu_interleave_rope"


def _deinterleave_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h.reshape(*h.shape[:-1], h.shape[-1] // 2, 2).transpose(-1, -2).reshape(h.shape)
    first, second = h.chunk(2, dim=-1)
    return h * cos.float() + torch.cat((-second, first), dim=-1) * sin.float()


def npu_kv_rmsnorm_rope_cache(**a):
    kv, gamma, cos, sin, index = a["kv"], a["gamma"], a["cos"], a["sin"], a["index"]
    k_cache, ckv_cache = a["k_cache"], a["ckv_cache"]
    _refuse_unmodelled(KRRC, a, ("k_rope_scale", "c_kv_scale", "k_rope_offset", "c_kv_offset", "v"))
    if a["cache_mode"] not in ("PA", "PA_BNSD"):
        raise unmodelled(KRRC, f"cache_mode {a['cache_mode']!r}")
    require(
        kv.dim() == 4 and kv.shape[1] == 1 and kv.dtype in HALF_TYPES,
        KRRC,
        "KRRC.kv",
        f"kv {kv.dtype} {tuple(kv.shape)}",
    )
    batch, _, seq, hidden = kv.shape
    rms_size, rope_size = gamma.shape[-1], hidden - gamma.shape[-1]
    require((hidden, rms_size, rope_size) == (576, 512, 64), KRRC, "KRRC.sizes", f"kv {tuple(kv.shape)}")
    require(
        gamma.dim() == 1 and gamma.dtype in HALF_TYPES,
        KRRC,
        "KRRC.gamma",
        f"gamma {gamma.dtype} {tuple(gamma.shape)}",
    )
    for name, t in (("cos", cos), ("sin", sin)):
        require(
            tuple(t.shape) == (batch, 1, seq, rope_size) and t.dtype in HALF_TYPES,
            KRRC,
            "KRRC.cos_sin",
            f"{name} {t.dtype} {tuple(t.shape)} for kv {tuple(kv.shape)}",
        )
    require(
        index.dtype == torch.int64 and tuple(index.shape) == (batch * seq,),
        KRRC,
        "KRRC.index",
        f"index {index.dtype} {tuple(index.shape)} for kv {tuple(kv.shape)}",
    )
    require(
        k_cache.dim() == 4
        and ckv_cache.dim() == 4
        and tuple(k_cache.shape[2:]) == (1, rope_size)
        and tuple(ckv_cache.shape) == (*k_cache.shape[:2], 1, rms_size)
        and k_cache.dtype in HALF_TYPES
        and ckv_cache.dtype in HALF_TYPES,
        KRRC,
        "KRRC.cache",
        f"k_cache {k_cache.dtype} {tuple(k_cache.shape)}, ckv_cache {ckv_cache.dtype} {tuple(ckv_cache.shape)}",
    )
    require(
        k_cache.is_contiguous() and ckv_cache.is_contiguous(),
        KRRC,
        "PROJECT.no_hidden_cache_copy",
        "k_cache/ckv_cache must be contiguous",
    )
    slots = index.tolist()
    capacity = k_cache.shape[0] * k_cache.shape[1]
    require(
        all(0 <= i < capacity for i in slots), KRRC, "PROJECT.valid_slots", f"index outside [0, {capacity})"
    )
    require(len(set(slots)) == len(slots), KRRC, "KRRC.index_unique", "index has repeated values")
    rows = kv.reshape(batch * seq, hidden)
    y, _ = _rms(rows[:, :rms_size], gamma, a["epsilon"])
    k_embed = _deinterleave_rotate(rows[:, rms_size:], cos.reshape(-1, rope_size), sin.reshape(-1, rope_size))
    k_embed = k_embed.to(kv.dtype)
    k_cache.view(-1, rope_size)[index] = k_embed.to(k_cache.dtype)
    ckv_cache.view(-1, rms_size)[index] = y.to(ckv_cache.dtype)
    if not a["is_output_kv"]:  # the docs give no value for the outputs then: NaN here
        k_embed, y = torch.full_like(k_embed, float("nan")), torch.full_like(y, float("nan"))
    return k_cache, ckv_cache, k_embed.view(batch, 1, seq, rope_size), y.view(batch, 1, seq, rms_size)


def npu_interleave_rope(x, cos, sin):
    require(
        x.dim() == 4 and x.dtype in HALF_TYPES and x.is_contiguous(),
        IROPE,
        "IROPE.x",
        f"x {x.dtype} {tuple(x.shape)}, contiguous={x.is_contiguous()}",
    )
    b, _, s, d = x.shape
    require(
        cos.dim() == 4
        and cos.shape[0] == b
        and cos.shape[2] in (1, s)
        and cos.dtype == x.dtype
        and cos.is_contiguous()
        and sin.shape == cos.shape
        and sin.dtype == cos.dtype
        and sin.is_contiguous(),
        IROPE,
        "IROPE.cos_sin",
        f"cos {cos.dtype} {tuple(cos.shape)}, sin {sin.dtype} {tuple(sin.shape)} for x {x.dtype} {tuple(x.shape)}",
    )
    require(
        d == 64 and cos.shape[3] == 64 and cos.shape[1] == 1,
        IROPE,
        "IROPE.dims",
        f"x {tuple(x.shape)}, cos {tuple(cos.shape)}",
    )
    return _deinterleave_rotate(x, cos, sin).to(x.dtype)
