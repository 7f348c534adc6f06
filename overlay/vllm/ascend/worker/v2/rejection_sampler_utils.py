"""Torch forms of the kernels of upstream's speculative-decoding verification
(``spec_decode/rejection_sampler.py`` and ``rejection_sampler_utils.py``): the gather of
each logits row's draft token, the per-vocabulary-block statistics, the accept/reject
walk over the drafts, the resampling of the rejected or bonus token and its insertion.

Only the standard method is here (greedy and random requests, one-hot drafts or the
draft's own logits, upstream's synthetic acceptance rates): block verification, FLy and
watermarked resampling are refused at start-up (``spec_decode/config.py``), and these
forms raise if they are reached anyway. The all-greedy path that skips them is
``rejection_sampler.py``.
"""

from __future__ import annotations

import torch

from vllm.ascend.worker.v2.gumbel import MASK32, draft_logits_row, gumbel_noised
from vllm.ascend.worker.v2.input_batch import masked_set

_NEG_INF = float("-inf")
# the smallest uniform tl_rand32 returns without zero (Triton's 4.6566127342e-10 in
# float32: 2**-31 exactly). A Python number, not a host tensor a step would copy to the
# device (a wait on every call).
_RAND_MIN = float(torch.tensor(4.6566127342e-10, dtype=torch.float32))

# Triton's Philox 4x32-10 (triton/language/random.py)
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85


def _mul32(value: torch.Tensor, factor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``value * factor`` (both uint32, held in int64) without
    an int64 overflow: the factor is split into 16-bit halves."""
    high_part = value * (factor >> 16)  # < 2**48
    low_part = value * (factor & 0xFFFF)
    high = (high_part + (low_part >> 16)) >> 16
    low = (((high_part & 0xFFFF) << 16) + low_part) & MASK32
    return high, low


def philox_uniform(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``tl.rand(seed, offset)`` (Philox 4x32 with 10 rounds, first word, as a float32
    in [0, 1)) for int64 ``seed`` and ``offset`` tensors of one shape."""
    offset = offset.to(torch.int64)
    c0, c1 = offset & MASK32, (offset >> 32) & MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & MASK32, (seed >> 32) & MASK32
    for _ in range(10):
        high_b, low_b = _mul32(c2, _PHILOX_ROUND_B)
        high_a, low_a = _mul32(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0 = (k0 + _PHILOX_KEY_A) & MASK32
        k1 = (k1 + _PHILOX_KEY_B) & MASK32
    # uint_to_uniform_float: the word as int32, negatives folded with ~x, times 2**-31
    folded = torch.where(c0 >= 1 << 31, MASK32 - c0, c0)
    return folded.to(torch.float32) * _RAND_MIN


def _rand32(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """gumbel.py's ``tl_rand32(seed, offset, includes_zero=False)``."""
    return philox_uniform(seed, offset).clamp(min=_RAND_MIN)


def _refuse(what: str) -> None:
    raise NotImplementedError(
        f"speculative decoding with {what} has no Ascend form on Model Runner V2: use "
        "rejection_sample_method 'standard' or 'synthetic' without watermarking"
    )


def _blocks(logits: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """[rows, vocab] -> [rows, num_blocks, block_size], padded with -inf."""
    pad = num_blocks * block_size - logits.shape[1]
    return torch.nn.functional.pad(logits, (0, pad), value=_NEG_INF).view(
        logits.shape[0], num_blocks, block_size
    )


def _sumexp(blocks: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Each block's sum of exp(logit - its maximum ``top``); 0 for an all -inf block."""
    sumexp = torch.exp(blocks - top[..., None]).sum(dim=-1)
    return torch.where(top > _NEG_INF, sumexp, torch.zeros_like(sumexp))


def _global_lse(local_max: torch.Tensor, local_sumexp: torch.Tensor) -> torch.Tensor:
    top = local_max.max(dim=-1).values
    return top + torch.log((local_sumexp * torch.exp(local_max - top[..., None])).sum(dim=-1))


def _draft_rows(req: torch.Tensor, row_mapping: torch.Tensor | None) -> torch.Tensor:
    """The rows the verification kernels read the draft logits from: each request's row
    in this rank's cache, a missing row (-1) read as row 0 as upstream's
    ``tl.maximum(draft_logits_row(...), 0)`` does (its drafts are marked stale)."""
    return draft_logits_row(req, row_mapping).clamp(min=0)


def _argmax_of_blocks(local_max: torch.Tensor, local_argmax: torch.Tensor) -> torch.Tensor:
    """The token of the block with the largest maximum (NaN blocks never win)."""
    clean = torch.where(torch.isnan(local_max), _NEG_INF, local_max)
    best = clean.argmax(dim=-1, keepdim=True)
    return local_argmax.gather(-1, best).squeeze(-1).to(torch.int64)


def greedy_pick(logits: torch.Tensor, block_size: int) -> torch.Tensor:
    """A greedy row's token as the rejection sampler's kernels pick it: the first maximum
    of each ``block_size``-wide block, then the block with the largest maximum (a block
    holding a NaN never wins). Verified rows use 8192-wide blocks, the resampled (bonus or
    rejected) row 1024-wide ones; they differ only where a row holds a NaN."""
    num_blocks = -(-logits.shape[1] // block_size)
    top, where = _blocks(logits.to(torch.float32), num_blocks, block_size).max(dim=-1)
    first = torch.arange(num_blocks, device=where.device) * block_size
    return _argmax_of_blocks(top, where + first)


# -- rejection_sampler.py ---------------------------------------------------------------
def gather_draft_sampled(
    draft_sampled_ptr: torch.Tensor,
    pos_ptr: torch.Tensor,
    input_ids_ptr: torch.Tensor,
    positions_ptr: torch.Tensor,
    logits_indices_ptr: torch.Tensor,
    expanded_idx_mapping_ptr: torch.Tensor,
    expanded_local_pos_ptr: torch.Tensor,
    prefill_len_ptr: torch.Tensor,
    num_logits: int,
    BLOCK_SIZE: int | None = None,
    **launch: object,
) -> None:
    n = draft_sampled_ptr.shape[0]
    token = logits_indices_ptr[:n].long()
    token_id = input_ids_ptr[token]
    pos = positions_ptr[token]
    local_pos = expanded_local_pos_ptr[:n]
    prefill_len = prefill_len_ptr[expanded_idx_mapping_ptr[:n].long()]
    # draft slots of a step that starts inside the prompt are placeholders: rejected
    placeholder = (local_pos > 0) & (pos - local_pos < prefill_len)
    draft_sampled_ptr.copy_(torch.where(placeholder, -1, token_id).to(draft_sampled_ptr.dtype))
    pos_ptr.copy_(pos.to(pos_ptr.dtype))


def flatten_sampled(
    flat_sampled_ptr: torch.Tensor,
    sampled_ptr: torch.Tensor,
    sampled_stride: int,
    num_sampled_ptr: torch.Tensor,
    cu_num_logits_ptr: torch.Tensor,
    **launch: object,
) -> None:
    num_reqs = cu_num_logits_ptr.shape[0] - 1
    width = sampled_ptr.shape[1]
    step = torch.arange(width, device=sampled_ptr.device)
    where = (cu_num_logits_ptr[:num_reqs].long()[:, None] + step).clamp(max=flat_sampled_ptr.shape[0] - 1)
    live = step < num_sampled_ptr[:num_reqs].long()[:, None]
    masked_set(flat_sampled_ptr, (where,), sampled_ptr[:num_reqs], live)


# -- rejection_sampler_utils.py ---------------------------------------------------------
def compute_local_logits_stats(
    target_local_argmax_ptr: torch.Tensor,
    target_local_argmax_stride: int,
    target_local_max_ptr: torch.Tensor,
    target_local_max_stride: int,
    target_local_sumexp_ptr: torch.Tensor,
    target_local_sumexp_stride: int,
    draft_local_max_ptr: torch.Tensor,
    draft_local_max_stride: int,
    draft_local_sumexp_ptr: torch.Tensor,
    draft_local_sumexp_stride: int,
    target_logits_ptr: torch.Tensor,
    target_logits_stride: int,
    draft_logits_ptr: torch.Tensor,
    draft_logits_stride_0: int,
    draft_logits_stride_1: int,
    draft_logits_row_mapping_ptr: torch.Tensor,
    expanded_idx_mapping_ptr: torch.Tensor,
    expanded_local_pos_ptr: torch.Tensor,
    temp_ptr: torch.Tensor,
    vocab_size: int,
    num_logits: int,
    BLOCK_SIZE: int,
    HAS_DRAFT_LOGITS: int,
    **launch: object,
) -> None:
    n, num_blocks = target_local_max_ptr.shape
    if n == 0:
        return
    size = int(BLOCK_SIZE)
    local_pos = expanded_local_pos_ptr[:n].long()
    # a bonus row (the next row starts another request, or there is none) needs nothing
    following = torch.cat([local_pos[1:], local_pos.new_zeros(1)])
    draft_row = following != 0
    req = expanded_idx_mapping_ptr[:n].long()
    temp = temp_ptr[req].to(torch.float32)
    greedy = temp == 0.0

    blocks = _blocks(target_logits_ptr[:n, : int(vocab_size)].to(torch.float32), num_blocks, size)
    top, where = blocks.max(dim=-1)
    sumexp = _sumexp(blocks, top)
    first = torch.arange(num_blocks, device=where.device) * size
    rows = draft_row[:, None]
    _set_rows(target_local_argmax_ptr, where + first, rows & greedy[:, None])
    _set_rows(target_local_max_ptr, top, rows)
    _set_rows(target_local_sumexp_ptr, sumexp, rows & ~greedy[:, None])
    if HAS_DRAFT_LOGITS:
        step = local_pos.clamp(max=draft_logits_ptr.shape[1] - 1)
        rows_of = _draft_rows(req, draft_logits_row_mapping_ptr)
        draft = draft_logits_ptr[rows_of, step, : int(vocab_size)].to(torch.float32)
        draft = draft / torch.where(greedy, 1.0, temp)[:, None]  # stored before temperature
        draft_blocks = _blocks(draft, num_blocks, size)
        draft_top = draft_blocks.max(dim=-1).values
        draft_sumexp = _sumexp(draft_blocks, draft_top)
        _set_rows(draft_local_max_ptr, draft_top, rows & ~greedy[:, None])
        _set_rows(draft_local_sumexp_ptr, draft_sumexp, rows & ~greedy[:, None])


def _set_rows(target: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
    view = target[: values.shape[0], : values.shape[1]]
    view.copy_(torch.where(mask, values.to(target.dtype), view))


def rejection(
    sampled_ptr: torch.Tensor,
    sampled_stride: int,
    rejected_steps_ptr: torch.Tensor,
    target_rejected_logsumexp_ptr: torch.Tensor,
    draft_rejected_logsumexp_ptr: torch.Tensor,
    target_logits_ptr: torch.Tensor,
    target_logits_stride: int,
    target_local_argmax_ptr: torch.Tensor,
    target_local_argmax_stride: int,
    target_local_max_ptr: torch.Tensor,
    target_local_max_stride: int,
    target_local_sumexp_ptr: torch.Tensor,
    target_local_sumexp_stride: int,
    draft_sampled_ptr: torch.Tensor,
    draft_logits_ptr: torch.Tensor,
    draft_logits_stride_0: int,
    draft_logits_stride_1: int,
    draft_logits_row_mapping_ptr: torch.Tensor,
    draft_local_max_ptr: torch.Tensor,
    draft_local_max_stride: int,
    draft_local_sumexp_ptr: torch.Tensor,
    draft_local_sumexp_stride: int,
    cu_num_logits_ptr: torch.Tensor,
    idx_mapping_ptr: torch.Tensor,
    temp_ptr: torch.Tensor,
    seed_ptr: torch.Tensor,
    pos_ptr: torch.Tensor,
    synthetic_conditional_rates_ptr: torch.Tensor,
    cumulative_log_p_ptr: torch.Tensor,
    local_residual_mass_ptr: torch.Tensor,
    local_residual_mass_stride: int,
    fly_entropy_ptr: torch.Tensor,
    fly_entropy_threshold: float,
    vocab_num_blocks: int,
    PADDED_VOCAB_NUM_BLOCKS: int | None = None,
    HAS_DRAFT_LOGITS: bool = False,
    SYNTHETIC_MODE: bool = False,
    USE_BLOCK_VERIFICATION: bool = False,
    FLY_WINDOW_SIZE: int = 0,
    **launch: object,
) -> None:
    if USE_BLOCK_VERIFICATION:
        _refuse("block verification")
    if FLY_WINDOW_SIZE:
        _refuse("FLy")
    num_reqs = cu_num_logits_ptr.shape[0] - 1
    steps = sampled_ptr.shape[1] - 1
    if num_reqs == 0:
        return
    device = sampled_ptr.device
    num_rows = target_logits_ptr.shape[0]
    cu = cu_num_logits_ptr[: num_reqs + 1].long()
    start = cu[:-1]
    num_drafts = cu[1:] - start - 1
    req = idx_mapping_ptr[:num_reqs].long()
    temp = temp_ptr[req].to(torch.float32)
    greedy = (temp == 0.0)[:, None]
    step = torch.arange(steps, device=device)
    live = step < num_drafts[:, None]  # [reqs, steps]
    row = (start[:, None] + step).clamp(max=num_rows - 1)
    draft = draft_sampled_ptr[(row + 1).clamp(max=draft_sampled_ptr.shape[0] - 1)].long()
    valid = draft >= 0
    draft = draft.clamp(min=0)
    u = _rand32(seed_ptr[req][:, None].expand_as(row), pos_ptr[row])

    blocks = int(vocab_num_blocks)
    target_argmax = _argmax_of_blocks(
        target_local_max_ptr[row, :blocks], target_local_argmax_ptr[row, :blocks]
    )
    target_lse = _global_lse(target_local_max_ptr[row, :blocks], target_local_sumexp_ptr[row, :blocks])
    target_logit = target_logits_ptr[row, draft].to(torch.float32)
    target_logprob = torch.where(valid, target_logit, _NEG_INF) - target_lse
    if HAS_DRAFT_LOGITS:
        draft_step = step.clamp(max=draft_logits_ptr.shape[1] - 1)
        draft_row = _draft_rows(req, draft_logits_row_mapping_ptr)[:, None]
        draft_logit = draft_logits_ptr[draft_row, draft_step, draft].to(torch.float32)
        draft_logit = torch.where(valid, draft_logit, _NEG_INF) / torch.where(greedy, 1.0, temp[:, None])
        draft_lse = _global_lse(draft_local_max_ptr[row, :blocks], draft_local_sumexp_ptr[row, :blocks])
        draft_logprob = draft_logit - draft_lse
    else:  # one-hot drafts: q(draft) = 1
        draft_lse = torch.zeros_like(target_lse)
        draft_logprob = torch.zeros_like(target_lse)

    if SYNTHETIC_MODE:
        rates = synthetic_conditional_rates_ptr[:steps].to(torch.float32)
        accepted = u < rates
    else:
        accepted = torch.where(greedy, target_argmax == draft, target_logprob > torch.log(u) + draft_logprob)
    accepted = accepted & valid & live  # an invalid draft ends a random walk before its test
    kept = torch.cumprod(accepted.to(torch.int64), dim=1)  # 1 while every draft so far was accepted
    before = torch.cat([torch.ones_like(kept[:, :1]), kept[:, :-1]], dim=1).bool()
    verified = before & live & (greedy | valid)
    accepted_length = kept.sum(dim=1)

    token = torch.where(greedy & ~accepted, target_argmax, draft)
    lanes = torch.arange(num_reqs, device=device)[:, None].expand_as(row)
    masked_set(sampled_ptr, (lanes, step.expand_as(row)), token, verified)
    rejected_steps_ptr[:num_reqs] = accepted_length.to(rejected_steps_ptr.dtype)
    # a random walk's last verified step keeps its log-sum-exps for the resampling
    num_verified = verified.sum(dim=1)
    last = (num_verified - 1).clamp(min=0)[:, None]
    keep = (num_verified > 0) & ~greedy[:, 0]
    zero = torch.zeros(num_reqs, device=device)
    target_rejected_logsumexp_ptr[:num_reqs] = torch.where(keep, target_lse.gather(1, last)[:, 0], zero)
    draft_rejected_logsumexp_ptr[:num_reqs] = torch.where(keep, draft_lse.gather(1, last)[:, 0], zero)


def resample(
    resampled_local_argmax_ptr: torch.Tensor,
    resampled_local_argmax_stride: int,
    resampled_local_max_ptr: torch.Tensor,
    resampled_local_max_stride: int,
    target_logits_ptr: torch.Tensor,
    target_logits_stride: int,
    target_rejected_logsumexp_ptr: torch.Tensor,
    draft_logits_ptr: torch.Tensor,
    draft_logits_stride_0: int,
    draft_logits_stride_1: int,
    draft_logits_row_mapping_ptr: torch.Tensor,
    draft_rejected_logsumexp_ptr: torch.Tensor,
    rejected_step_ptr: torch.Tensor,
    cu_num_logits_ptr: torch.Tensor,
    expanded_idx_mapping_ptr: torch.Tensor,
    draft_sampled_ptr: torch.Tensor,
    temp_ptr: torch.Tensor,
    seed_ptr: torch.Tensor,
    pos_ptr: torch.Tensor,
    cumulative_log_p_ptr: torch.Tensor,
    contexts_ptr: torch.Tensor,
    contexts_stride: int,
    watermarking_ptr: torch.Tensor,
    watermarking_skip_mask_ptr: torch.Tensor,
    watermark_key_0: int,
    watermark_key_1: int,
    vocab_size: int,
    BLOCK_SIZE: int,
    HAS_DRAFT_LOGITS: bool = False,
    USE_FP64: bool = False,
    USE_BLOCK_VERIFICATION: bool = False,
    CONTEXT_WIDTH: int = 1,
    WATERMARK: bool = False,
    DEDUPLICATE_CONTEXTS: bool = False,
    SKIP_MASKED_BLOCKS: bool = False,
    **launch: object,
) -> None:
    if USE_BLOCK_VERIFICATION:
        _refuse("block verification")
    if WATERMARK:
        _refuse("watermarking")
    num_reqs, num_blocks = resampled_local_max_ptr.shape
    if num_reqs == 0:
        return
    vocab = int(vocab_size)
    cu = cu_num_logits_ptr[: num_reqs + 1].long()
    resample_step = rejected_step_ptr[:num_reqs].long()
    row = cu[:-1] + resample_step
    is_bonus = row == cu[1:] - 1
    req = expanded_idx_mapping_ptr[row].long()
    temp = temp_ptr[req].to(torch.float32)
    greedy = temp == 0.0
    rejected = draft_sampled_ptr[(row + 1).clamp(max=draft_sampled_ptr.shape[0] - 1)].long()
    rejected = torch.where(is_bonus, 0, rejected)
    from_target = is_bonus | (rejected < 0)  # bonus token or a placeholder draft

    logits = target_logits_ptr[row, :vocab].to(torch.float32)
    if HAS_DRAFT_LOGITS:
        # r(x) = max(p(x) - q(x), 0), in log space
        step = resample_step.clamp(max=draft_logits_ptr.shape[1] - 1)
        draft = (
            draft_logits_ptr[_draft_rows(req, draft_logits_row_mapping_ptr), step, :vocab].to(torch.float32)
            / torch.where(greedy, 1.0, temp)[:, None]
        )
        target_log_probs = logits - target_rejected_logsumexp_ptr[:num_reqs, None]
        draft_log_probs = draft - draft_rejected_logsumexp_ptr[:num_reqs, None]
        ratio = torch.exp(draft_log_probs - target_log_probs)
        residual = torch.where(ratio < 1.0, target_log_probs + torch.log1p(-ratio), _NEG_INF)
    else:  # one-hot drafts: the target without the rejected token
        token = torch.arange(vocab, device=logits.device)
        residual = torch.where(token[None, :] != rejected[:, None], logits, _NEG_INF)
    residual = torch.where(from_target[:, None], logits, residual)

    scores = gumbel_noised(residual, temp, seed_ptr[req], pos_ptr[row], False, bool(USE_FP64), False)
    size = int(BLOCK_SIZE)
    best, where = _blocks(scores, num_blocks, size).max(dim=-1)
    first = torch.arange(num_blocks, device=where.device) * size
    if SKIP_MASKED_BLOCKS:
        # a block where no target logit survives (top-k/top-p) is skipped: its first
        # token with -inf, whatever the residual or the noise would give
        masked = _blocks(logits, num_blocks, size).amax(dim=-1) == _NEG_INF
        where = torch.where(masked, 0, where)
        best = torch.where(masked, _NEG_INF, best)
    run = (~(greedy & ~is_bonus))[:, None]  # greedy rejections keep the target argmax already written
    _set_rows(resampled_local_argmax_ptr, where + first, run)
    _set_rows(resampled_local_max_ptr, best, run)


def insert_resampled(
    sampled_ptr: torch.Tensor,
    sampled_stride: int,
    num_sampled_ptr: torch.Tensor,
    resampled_local_argmax_ptr: torch.Tensor,
    resampled_local_argmax_stride: int,
    resampled_local_max_ptr: torch.Tensor,
    resampled_local_max_stride: int,
    resample_num_blocks: int,
    cu_num_logits_ptr: torch.Tensor,
    expanded_idx_mapping_ptr: torch.Tensor,
    temp_ptr: torch.Tensor,
    PADDED_RESAMPLE_NUM_BLOCKS: int | None = None,
    **launch: object,
) -> None:
    num_reqs = cu_num_logits_ptr.shape[0] - 1
    if num_reqs == 0:
        return
    cu = cu_num_logits_ptr[: num_reqs + 1].long()
    count = num_sampled_ptr[:num_reqs].long()
    row = cu[:-1] + count
    req = expanded_idx_mapping_ptr[row.clamp(max=expanded_idx_mapping_ptr.shape[0] - 1)].long()
    greedy = temp_ptr[req].to(torch.float32) == 0.0
    run = ~(greedy & (row != cu[1:] - 1))
    num_sampled_ptr[:num_reqs] = (count + 1).to(num_sampled_ptr.dtype)
    blocks = int(resample_num_blocks)
    token = _argmax_of_blocks(
        resampled_local_max_ptr[:num_reqs, :blocks], resampled_local_argmax_ptr[:num_reqs, :blocks]
    )
    lanes = torch.arange(num_reqs, device=row.device)
    masked_set(sampled_ptr, (lanes, count.clamp(max=sampled_ptr.shape[1] - 1)), token, run)
