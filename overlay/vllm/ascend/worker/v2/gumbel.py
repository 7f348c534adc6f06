"""Torch forms of upstream's ``sample/gumbel.py`` kernels: temperature, and the
Gumbel-max sampler whose noise is a counter-based hash of (seed, position, token), so a
seed draws the same tokens whatever the batch and whether or not a graph runs the step.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# gumbel.py: the draft's noise stream is offset by 2**30 positions
_DRAFT_NOISE_SALT = 1 << 30


def apply_temperature(
    logits_ptr: torch.Tensor,
    logits_stride: int,
    expanded_idx_mapping_ptr: torch.Tensor,
    temperature_ptr: torch.Tensor,
    vocab_size: int,
    BLOCK_SIZE: int | None = None,
    **launch: object,
) -> None:
    num_tokens = logits_ptr.shape[0]
    if num_tokens == 0:
        return
    temp = temperature_ptr[expanded_idx_mapping_ptr[:num_tokens].long()].to(torch.float32)
    scale = (temp != 0.0) & (temp != 1.0)
    view = logits_ptr[:, : int(vocab_size)]
    divided = (view.to(torch.float32) / torch.where(scale, temp, 1.0)[:, None]).to(view.dtype)
    view.copy_(torch.where(scale[:, None], divided, view))


def _rotl32(value: torch.Tensor, shift: int) -> torch.Tensor:
    return ((value << shift) | (value >> (32 - shift))) & MASK32


def _mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    # int64 products wrap modulo 2**64; their low 32 bits are the uint32 product's
    key = (key * 0xCC9E2D51) & MASK32
    key = _rotl32(key, 15)
    key = (key * 0x1B873593) & MASK32
    h = _rotl32(h ^ key, 13)
    return (h * 5 + 0xE6546B64) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def murmur3_hash32(
    seed: torch.Tensor, pos: torch.Tensor, offset: torch.Tensor, domain: int = 0
) -> torch.Tensor:
    """Upstream's counter-based noise hash (MurmurHash3's mixing over seed, position and
    token id), as uint32 values held in int64."""
    h = torch.full_like(seed, domain & MASK32)
    h = _mix(h, seed & MASK32)
    h = _mix(h, (seed >> 32) & MASK32)
    h = _mix(h, pos & MASK32)
    h = _mix(h, offset & MASK32)
    return _fmix32(h ^ 16)


def _uniform32(seed, pos, keys) -> torch.Tensor:
    random32 = murmur3_hash32(seed, pos, keys)
    hi16 = (random32 >> 16).to(torch.float32)
    lo16 = (random32 & 0xFFFF).to(torch.float32)
    return hi16 * 1.52587890625e-05 + (lo16 + 0.5) * 2.3283064365386963e-10


def _uniform64(seed, pos, keys) -> torch.Tensor:
    lo = murmur3_hash32(seed, pos, keys)
    hi = murmur3_hash32(seed, pos, keys, domain=0x9E3779B9)
    random53 = (hi << 21) | (lo >> 11)  # the top 53 of hi:lo, without a signed 64-bit shift
    uniform = (random53.to(torch.float64) + 0.5) * 1.1102230246251565e-16
    return torch.where(uniform == 1.0, uniform - 1.1102230246251565e-16, uniform)


def _log1p_neg_stable(value: torch.Tensor) -> torch.Tensor:
    polynomial = torch.full_like(value, 1.0 / 8.0)
    for c in (1.0 / 7.0, 1.0 / 6.0, 1.0 / 5.0, 1.0 / 4.0, 1.0 / 3.0, 1.0 / 2.0, 1.0):
        polynomial = c + value * polynomial
    series = -value * polynomial
    direct = torch.log(torch.clamp(1.0 - value, min=5.960464477539063e-08))
    return torch.where(value < 0.25, series, direct)


def gumbel_noised(
    logits: torch.Tensor,
    temp: torch.Tensor,
    seed: torch.Tensor,
    pos: torch.Tensor,
    is_drafting: bool,
    use_fp64: bool,
    apply_temperature: bool,
) -> torch.Tensor:
    """Upstream's Gumbel-max scores of ``logits`` [tokens, vocab] (float32): divided by
    the temperature, plus the token's noise; rows at temperature 0 stay plain logits."""
    hot = temp != 0.0
    if apply_temperature:
        logits = logits / torch.where(hot, temp, 1.0)[:, None]
    if use_fp64:
        logits = logits.to(torch.float64)
    if is_drafting:
        pos = pos + _DRAFT_NOISE_SALT
    keys = torch.arange(logits.shape[1], device=logits.device, dtype=torch.int64)[None, :]
    if use_fp64:
        noise = -torch.log(-torch.log(_uniform64(seed[:, None], pos[:, None], keys)))
    else:
        noise = -torch.log(-_log1p_neg_stable(_uniform32(seed[:, None], pos[:, None], keys)))
    return torch.where(hot[:, None], logits + noise.to(logits.dtype), logits)


def draft_logits_row(req_state_idx: torch.Tensor, row_mapping: torch.Tensor | None) -> torch.Tensor:
    """spec_decode/draft_logits.py's ``draft_logits_row``: each request's row in this
    rank's draft logits cache (int64), -1 for none. Without a row mapping (a replicated
    cache) the row is the request slot itself; negative slots (padding) map to -1."""
    req = req_state_idx.to(torch.int64)
    if row_mapping is None:
        return req
    row = row_mapping[req.clamp(min=0)].to(torch.int64)
    return torch.where(req >= 0, row, -1)


_GUMBEL_ROWS = 64  # rows at a time: the noise holds several int64 copies of the logits


def gumbel_sample(
    local_argmax_ptr: torch.Tensor,
    local_argmax_stride: int,
    local_max_ptr: torch.Tensor,
    local_max_stride: int,
    logits_cache_ptr: torch.Tensor,
    logits_cache_stride_0: int,
    logits_cache_stride_1: int,
    logits_cache_col_ptr: torch.Tensor,
    logits_cache_source_ptr: torch.Tensor,
    logits_cache_source_stride: int,
    logits_cache_row_mapping_ptr: torch.Tensor,
    logits_ptr: torch.Tensor,
    logits_stride: int,
    bias_ptr: torch.Tensor,
    bias_stride: int,
    expanded_idx_mapping_ptr: torch.Tensor,
    seeds_ptr: torch.Tensor,
    pos_ptr: torch.Tensor,
    temp_ptr: torch.Tensor,
    vocab_size: int,
    BLOCK_SIZE: int,
    IS_DRAFTING: int,
    APPLY_TEMPERATURE: int,
    USE_FP64: int,
    PER_TOKEN_COL: int,
    HAS_BIAS: bool = False,
    **launch: object,
) -> None:
    num_tokens = logits_ptr.shape[0]
    vocab_size = int(vocab_size)
    if num_tokens == 0:
        return
    req_raw = expanded_idx_mapping_ptr[:num_tokens].long()
    real = req_raw >= 0
    req = req_raw.clamp(min=0)
    temp = torch.where(real, temp_ptr[req].to(torch.float32), 0.0)
    seed = torch.where(real, seeds_ptr[req].to(torch.int64), 0)
    pos = pos_ptr[:num_tokens].to(torch.int64)
    logits = logits_ptr[:, :vocab_size]
    if HAS_BIAS:
        # added in float32 and rounded to the logits dtype, as ``logits + bias`` would be
        bias = bias_ptr[:num_tokens, :vocab_size].to(torch.float32)
        logits = (logits.to(torch.float32) + bias).to(logits.dtype)
    if logits_cache_ptr is not None:
        # the logits before temperature (the source's, else the ones sampled, bias
        # included), for the rejection sampler to divide again
        if PER_TOKEN_COL:
            col = logits_cache_col_ptr[:num_tokens].to(torch.int64)
        else:
            col = logits_cache_col_ptr.reshape(1).to(torch.int64).expand(num_tokens)
        if logits_cache_source_ptr is not None:
            source = logits_cache_source_ptr[:num_tokens, :vocab_size]
        else:
            source = logits
        row = draft_logits_row(req_raw, logits_cache_row_mapping_ptr)
        cached = row >= 0  # -1: no row of this rank's cache (or a padded token)
        cache = logits_cache_ptr[:, :, :vocab_size]
        # tokens without a row repeat one cached token's write (the same entry, the same
        # values), so no two writes to one entry differ; with none cached, that entry
        # gets its own values back
        first = cached.to(torch.int32).argmax()
        first_row, first_col = row[first].clamp(min=0), col[first]
        first_values = torch.where(cached[first], source[first].to(cache.dtype), cache[first_row, first_col])
        at = (torch.where(cached, row, first_row), torch.where(cached, col, first_col))
        cache[at] = torch.where(cached[:, None], source.to(cache.dtype), first_values)
        seed = seed ^ (col << 32)  # each speculative step draws its own noise

    num_blocks = local_argmax_ptr.shape[1]
    padded = num_blocks * int(BLOCK_SIZE)
    for start in range(0, num_tokens, _GUMBEL_ROWS):
        rows = slice(start, start + _GUMBEL_ROWS)
        scores = gumbel_noised(
            logits[rows].to(torch.float32),
            temp[rows],
            seed[rows],
            pos[rows],
            bool(IS_DRAFTING),
            bool(USE_FP64),
            bool(APPLY_TEMPERATURE),
        )
        scores = torch.nn.functional.pad(scores, (0, padded - vocab_size), value=float("-inf"))
        best, where = scores.view(scores.shape[0], num_blocks, -1).max(dim=-1)
        first = torch.arange(num_blocks, device=where.device) * int(BLOCK_SIZE)
        local_argmax_ptr[rows, :num_blocks] = (where + first).to(local_argmax_ptr.dtype)
        local_max_ptr[rows, :num_blocks] = best.to(local_max_ptr.dtype)


def first_max_or_nan(values: torch.Tensor) -> torch.Tensor:
    """Per row of ``values`` [rows, n]: the first NaN's column if any, else the first
    column holding the maximum (the Gumbel sampler's pick, made explicit so the device's
    argmax tie and NaN rules do not matter)."""
    n = values.shape[1]
    column = torch.arange(n, device=values.device)
    nan = torch.isnan(values)
    first_nan = torch.where(nan, column, n).amin(dim=1)
    clean = torch.where(nan, float("-inf"), values)
    top = clean.amax(dim=1, keepdim=True)
    first_top = torch.where(clean == top, column, n).amin(dim=1)
    return torch.where(first_nan < n, first_nan, first_top)


def gumbel_combine(
    local_argmax_ptr: torch.Tensor,
    local_argmax_stride: int,
    local_max_ptr: torch.Tensor,
    local_max_stride: int,
    sampled_ptr: torch.Tensor,
    num_blocks: int,
    PADDED_NUM_BLOCKS: int | None = None,
    **launch: object,
) -> None:
    """Each row's sampled token: the local argmax of its winning block
    (``first_max_or_nan`` over the blocks' maxima)."""
    rows, blocks = sampled_ptr.shape[0], int(num_blocks)
    if rows == 0:
        return
    winner = first_max_or_nan(local_max_ptr[:rows, :blocks])
    sampled = local_argmax_ptr[:rows, :blocks].gather(1, winner[:, None])[:, 0]
    sampled_ptr.copy_(sampled.to(sampled_ptr.dtype))
