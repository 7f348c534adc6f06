"""Torch forms of the Triton kernels Model Runner V2 launches for speculative decoding.

The draft model's input preparation (``spec_decode/target_dependent_ar/speculator.py``:
the prefill shift, the decode-step inputs, the per-step update) and the rejection
sampler (``spec_decode/rejection_sampler.py`` and ``rejection_sampler_utils.py``): the
gather of each logits row's draft token, the per-vocabulary-block statistics, the
accept/reject walk over the drafts, the resampling of the rejected or bonus token and
its insertion. Each function has its kernel's signature and fills the same outputs, so
vLLM's Triton kernel-override registry routes ``kernel[grid](...)`` to it; sizes come
from the tensors, never from a read back to the host.

Only the standard method is here (greedy and random requests, one-hot drafts or the
draft's own logits, upstream's synthetic acceptance rates): block verification, FLy and
watermarked resampling are refused at start-up (``spec_decode/config.py``), and these
forms raise if they are reached anyway. ``tests/unit/kernels/test_v2_runner_kernels.py``
compares each with upstream's kernel run by Triton's interpreter.
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import request_of_token
from vllm.ascend.kernels.v2_runner import _MASK32, _masked_set, draft_logits_row, gumbel_noised

_SD = "vllm.v1.worker.gpu.spec_decode."
_NEG_INF = float("-inf")
# gumbel.py's _TL_RAND_MIN: the smallest uniform tl_rand32 returns without zero
_RAND_MIN = torch.tensor(4.6566127342e-10, dtype=torch.float32)

# Triton's Philox 4x32-10 (triton/language/random.py)
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85


def _mul32(value: torch.Tensor, factor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``value * factor`` (both uint32, held in int64) without
    an int64 overflow: the factor is split into 16-bit halves."""
    high_part = value * (factor >> 16)  # < 2**48
    low_part = value * (factor & 0xFFFF)
    high = (high_part + (low_part >> 16)) >> 16
    low = (((high_part & 0xFFFF) << 16) + low_part) & _MASK32
    return high, low


def philox_uniform(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``tl.rand(seed, offset)`` (Philox 4x32 with 10 rounds, first word, as a float32
    in [0, 1)) for int64 ``seed`` and ``offset`` tensors of one shape."""
    offset = offset.to(torch.int64)
    c0, c1 = offset & _MASK32, (offset >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        high_b, low_b = _mul32(c2, _PHILOX_ROUND_B)
        high_a, low_a = _mul32(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0 = (k0 + _PHILOX_KEY_A) & _MASK32
        k1 = (k1 + _PHILOX_KEY_B) & _MASK32
    # uint_to_uniform_float: the word as int32, negatives folded with ~x, times 2**-31
    folded = torch.where(c0 >= 1 << 31, _MASK32 - c0, c0)
    return folded.to(torch.float32) * _RAND_MIN.to(folded.device)


def _rand32(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """gumbel.py's ``tl_rand32(seed, offset, includes_zero=False)``."""
    return torch.maximum(philox_uniform(seed, offset), _RAND_MIN.to(seed.device))


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
    _masked_set(flat_sampled_ptr, (where,), sampled_ptr[:num_reqs], live)


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
    _masked_set(sampled_ptr, (lanes, step.expand_as(row)), token, verified)
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
    _masked_set(sampled_ptr, (lanes, count.clamp(max=sampled_ptr.shape[1] - 1)), token, run)


# -- target_dependent_ar/speculator.py --------------------------------------------------
def draft_prefill_inputs(
    last_token_indices_ptr: torch.Tensor,
    draft_current_step_ptr: torch.Tensor,
    draft_input_ids_ptr: torch.Tensor,
    draft_positions_ptr: torch.Tensor,
    draft_query_start_loc_ptr: torch.Tensor,
    draft_seq_lens_ptr: torch.Tensor,
    target_input_ids_ptr: torch.Tensor,
    target_positions_ptr: torch.Tensor,
    idx_mapping_ptr: torch.Tensor,
    last_sampled_ptr: torch.Tensor,
    next_prefill_tokens_ptr: torch.Tensor,
    num_sampled_ptr: torch.Tensor,
    num_rejected_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    seq_lens_ptr: torch.Tensor,
    max_num_reqs: int,
    BLOCK_SIZE: int | None = None,
    **launch: object,
) -> None:
    """The draft's first step sees the target's tokens shifted by one, ending in the
    token just sampled (or, mid-prefill, the prompt's next token)."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    qsl = query_start_loc_ptr[: num_reqs + 1].long()
    length = qsl[1:] - qsl[:-1] - num_rejected_ptr[:num_reqs].long()
    req_state = idx_mapping_ptr.long()
    # flat indices, as the kernel's pointer arithmetic (both may be 2-D buffers)
    sampled = last_sampled_ptr.reshape(-1)[req_state].to(torch.int32)
    upcoming = next_prefill_tokens_ptr.reshape(-1)[req_state].to(torch.int32)
    next_token = torch.where(num_sampled_ptr[:num_reqs] > 0, sampled, upcoming)

    num_tokens = target_input_ids_ptr.shape[0]
    rows, offset, inside = request_of_token(qsl[1:], num_tokens)
    kept = inside & (offset < length[rows])
    token = torch.arange(num_tokens, device=qsl.device)
    _masked_set(draft_input_ids_ptr, ((token - 1).clamp(min=0),), target_input_ids_ptr, kept & (offset >= 1))
    _masked_set(draft_positions_ptr, (token,), target_positions_ptr, kept)
    last = qsl[:-1] + length - 1
    draft_input_ids_ptr[last] = next_token.to(draft_input_ids_ptr.dtype)
    last_token_indices_ptr[:num_reqs] = last.to(last_token_indices_ptr.dtype)
    last_token_indices_ptr[num_reqs:max_num_reqs] = 0
    draft_query_start_loc_ptr[:num_reqs] = qsl[:-1].to(draft_query_start_loc_ptr.dtype)
    draft_query_start_loc_ptr[num_reqs : max_num_reqs + 1] = qsl[-1].to(draft_query_start_loc_ptr.dtype)
    draft_seq_lens_ptr[:num_reqs] = seq_lens_ptr[:num_reqs].to(draft_seq_lens_ptr.dtype)
    draft_seq_lens_ptr[num_reqs:max_num_reqs] = 0
    draft_current_step_ptr.zero_()


def draft_decode_inputs(
    draft_tokens_ptr: torch.Tensor,
    draft_tokens_stride: int,
    target_seq_lens_ptr: torch.Tensor,
    num_rejected_ptr: torch.Tensor,
    input_ids_ptr: torch.Tensor,
    positions_ptr: torch.Tensor,
    sample_src_positions_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    seq_lens_ptr: torch.Tensor,
    max_model_len: int,
    max_num_reqs: int,
    BLOCK_SIZE: int | None = None,
    ADVANCE_DRAFT_POSITIONS: bool = True,
    **launch: object,
) -> None:
    num_reqs = draft_tokens_ptr.shape[0]
    first_draft = draft_tokens_ptr.as_strided((num_reqs,), (int(draft_tokens_stride),))
    input_ids_ptr[:num_reqs] = first_draft.to(input_ids_ptr.dtype)
    sample_src_positions_ptr[:num_reqs] += 1
    seq_len = target_seq_lens_ptr[:num_reqs].long() - num_rejected_ptr[:num_reqs].long()
    if ADVANCE_DRAFT_POSITIONS:
        positions_ptr[:num_reqs] = (positions_ptr[:num_reqs] + 1).clamp(max=int(max_model_len) - 1)
        seq_len = (seq_len + 1).clamp(max=int(max_model_len))
    seq_lens_ptr[:num_reqs] = seq_len.to(seq_lens_ptr.dtype)
    seq_lens_ptr[num_reqs:max_num_reqs] = 0
    lanes = torch.arange(max_num_reqs + 1, device=query_start_loc_ptr.device)
    query_start_loc_ptr[: max_num_reqs + 1] = lanes.clamp(max=num_reqs).to(query_start_loc_ptr.dtype)


def update_draft_inputs(
    output_draft_tokens_ptr: torch.Tensor,
    output_draft_tokens_stride: int,
    next_input_hidden_states_ptr: torch.Tensor,
    next_input_hidden_states_stride: int,
    input_ids_ptr: torch.Tensor,
    positions_ptr: torch.Tensor,
    sample_src_positions_ptr: torch.Tensor,
    seq_lens_ptr: torch.Tensor,
    draft_tokens_ptr: torch.Tensor,
    current_draft_step_ptr: torch.Tensor,
    hidden_states_ptr: torch.Tensor,
    hidden_states_stride: int,
    hidden_size: int,
    max_model_len_ptr: torch.Tensor,
    num_speculative_steps: int,
    BLOCK_SIZE: int | None = None,
    ADVANCE_DRAFT_POSITIONS: bool = True,
    **launch: object,
) -> None:
    """Record this step's draft tokens; before the last step, also make them (and the
    hidden states) the next step's inputs. The step and the model length (a scalar
    tensor, which may shrink after graph capture) stay on the device."""
    num_reqs = draft_tokens_ptr.shape[0]
    if num_reqs == 0:
        return
    step = current_draft_step_ptr.reshape(1).long()
    lanes = torch.arange(num_reqs, device=draft_tokens_ptr.device)
    drafts = draft_tokens_ptr[:num_reqs]
    output_draft_tokens_ptr[lanes, step.expand(num_reqs)] = drafts.to(output_draft_tokens_ptr.dtype)
    more = step < int(num_speculative_steps) - 1  # [1], on the device
    sample_src_positions_ptr[:num_reqs] += more.to(sample_src_positions_ptr.dtype)
    ids = input_ids_ptr[:num_reqs]
    ids.copy_(torch.where(more, drafts.to(ids.dtype), ids))
    size = int(hidden_size)
    hidden = next_input_hidden_states_ptr[:num_reqs, :size]
    hidden.copy_(torch.where(more[:, None], hidden_states_ptr[:num_reqs, :size].to(hidden.dtype), hidden))
    if ADVANCE_DRAFT_POSITIONS:
        limit = max_model_len_ptr.reshape(1).to(torch.int64)
        pos = positions_ptr[:num_reqs]
        advanced = torch.minimum(pos.to(torch.int64) + 1, limit - 1)
        pos.copy_(torch.where(more, advanced.to(pos.dtype), pos))
        seq = seq_lens_ptr[:num_reqs]
        advanced = torch.minimum(seq.to(torch.int64) + 1, limit)
        seq.copy_(torch.where(more, advanced.to(seq.dtype), seq))


# -- the n-gram drafter (spec_decode/ngram/speculator.py) ------------------------------
def ngram_scan(
    token_ids_ptr: torch.Tensor,
    token_ids_stride: int,
    idx_mapping_ptr: torch.Tensor,
    total_len_ptr: torch.Tensor,
    num_sampled_ptr: torch.Tensor,
    scratch_ptr: torch.Tensor,
    scratch_stride: int,
    L: int,
    MIN_N: int,
    MAX_N: int,
    MAX_N_PO2: int,
    BLOCK_L: int,
    **launch: object,
) -> None:
    """Per request and block of history positions, the best earlier occurrence of the
    request's last n tokens (MIN_N <= n <= MAX_N), packed as ``n * (L + 1) + pos + 1`` so
    that one maximum prefers the longest n, then the rightmost position (0: none)."""
    num_reqs = idx_mapping_ptr.shape[0]
    num_blocks = scratch_ptr.shape[1]
    width = num_blocks * int(BLOCK_L)
    req = idx_mapping_ptr.to(torch.int64)
    seq_len = total_len_ptr[req].to(torch.int64)[:, None]
    # (-1 past the row: positions that could read there are out of every match anyway)
    history = torch.nn.functional.pad(
        token_ids_ptr[req], (0, width + int(MAX_N) - token_ids_ptr.shape[1]), value=-1
    )
    pos = torch.arange(width, device=history.device)[None, :]
    # one row per request and history position (upstream's kernel keeps a block at a
    # time): int32 scores halve that (n * (L + 1) + L stays far below 2**31)
    best = torch.zeros(num_reqs, width, dtype=torch.int32, device=history.device)
    for n in range(int(MIN_N), int(MAX_N) + 1):
        match = pos <= seq_len - n - 1
        for j in range(n):
            suffix_token = history.gather(1, (seq_len - n + j).clamp(min=0))
            match = match & (history[:, j : j + width] == suffix_token)
        best = torch.where(match, (n * (int(L) + 1) + pos + 1).to(torch.int32), best)
    eligible = (num_sampled_ptr[:num_reqs] > 0)[:, None] & (seq_len >= int(MIN_N))
    block_best = best.view(num_reqs, num_blocks, -1).amax(dim=-1).to(scratch_ptr.dtype)
    scratch_ptr[:num_reqs, :num_blocks] = torch.where(eligible, block_best, 0)


def ngram_finalize(
    token_ids_ptr: torch.Tensor,
    token_ids_stride: int,
    idx_mapping_ptr: torch.Tensor,
    total_len_ptr: torch.Tensor,
    num_sampled_ptr: torch.Tensor,
    last_sampled_ptr: torch.Tensor,
    scratch_ptr: torch.Tensor,
    scratch_stride: int,
    drafts_ptr: torch.Tensor,
    L: int,
    N_BLOCKS: int,
    K: int,
    K_PO2: int | None = None,
    N_BLOCKS_PO2: int | None = None,
    **launch: object,
) -> None:
    """The K tokens that followed the best match become the drafts; slots without a
    match or past the history repeat the last sampled token (rejectable drafts)."""
    num_reqs = idx_mapping_ptr.shape[0]
    req = idx_mapping_ptr.to(torch.int64)
    score = scratch_ptr[:num_reqs, : int(N_BLOCKS)].amax(dim=1)
    has_match = score > 0
    packed = (score - 1).clamp(min=0)
    best_n = packed // (int(L) + 1)
    start = torch.where(has_match, packed - best_n * (int(L) + 1) + best_n, 0)
    available = (total_len_ptr[req].to(torch.int64) - start).clamp(min=0)
    slot = torch.arange(int(K), device=score.device)[None, :]
    index = (start[:, None] + slot).clamp(max=int(L) - 1)
    valid = (slot < available[:, None]) & ((num_sampled_ptr[:num_reqs] > 0) & has_match)[:, None]
    gathered = token_ids_ptr[req].to(torch.int64).gather(1, index)
    last = last_sampled_ptr[req].to(torch.int64)[:, None]
    drafts = drafts_ptr.view(-1, int(K))  # row b at b * K, as the kernel writes it
    drafts[:num_reqs] = torch.where(valid, gathered, last).to(drafts.dtype)


# -- a separate draft model (spec_decode/standalone_ar/speculator.py) --------------------
def standalone_prefill_inputs(
    target_input_ids_ptr: torch.Tensor,
    target_positions_ptr: torch.Tensor,
    last_sampled_ptr: torch.Tensor,
    idx_mapping_ptr: torch.Tensor,
    out_input_ids_ptr: torch.Tensor,
    out_positions_ptr: torch.Tensor,
    last_token_indices_ptr: torch.Tensor,
    out_query_start_loc_ptr: torch.Tensor,
    out_seq_lens_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    seq_lens_ptr: torch.Tensor,
    num_rejected_ptr: torch.Tensor,
    max_num_reqs: int,
    max_model_len: int,
    BLOCK_SIZE: int | None = None,
    **launch: object,
) -> None:
    """The draft model's first step: each request's query grown by one slot, holding its
    accepted tokens, then the target's correction token, then zeros for the rejected
    drafts, at consecutive positions (capped at the model length)."""
    num_reqs = idx_mapping_ptr.shape[0]
    qsl = query_start_loc_ptr[: num_reqs + 1].to(torch.int64)
    start, query_len = qsl[:-1], qsl[1:] - qsl[:-1]
    valid = query_len - num_rejected_ptr[:num_reqs].to(torch.int64)
    out_start = start + torch.arange(num_reqs, device=qsl.device)
    rows, j, inside = request_of_token(out_start + query_len + 1, out_input_ids_ptr.shape[0])
    source = (start[rows] + j).clamp(max=target_input_ids_ptr.shape[0] - 1)
    correction = last_sampled_ptr.reshape(-1)[idx_mapping_ptr.to(torch.int64)].to(torch.int64)[rows]
    token = torch.where(j < valid[rows], target_input_ids_ptr[source].to(torch.int64), 0)
    token = torch.where(j == valid[rows], correction, token)
    position = (target_positions_ptr[start].to(torch.int64)[rows] + j).clamp(max=int(max_model_len) - 1)
    out_input_ids_ptr.copy_(torch.where(inside, token.to(out_input_ids_ptr.dtype), out_input_ids_ptr))
    out_positions_ptr.copy_(torch.where(inside, position.to(out_positions_ptr.dtype), out_positions_ptr))
    last_token_indices_ptr[:num_reqs] = (out_start + valid).to(last_token_indices_ptr.dtype)
    last_token_indices_ptr[num_reqs : int(max_num_reqs)] = 0
    out_query_start_loc_ptr[:num_reqs] = out_start.to(out_query_start_loc_ptr.dtype)
    total = (out_start[-1:] + query_len[-1:] + 1).to(out_query_start_loc_ptr.dtype)
    out_query_start_loc_ptr[num_reqs : int(max_num_reqs) + 1] = total
    longer = (seq_lens_ptr[:num_reqs].to(torch.int64) + 1).clamp(max=int(max_model_len))
    out_seq_lens_ptr[:num_reqs] = longer.to(out_seq_lens_ptr.dtype)
    out_seq_lens_ptr[num_reqs : int(max_num_reqs)] = 0


_TDAR = _SD + "target_dependent_ar.speculator."
_RS = _SD + "rejection_sampler."
_RSU = _SD + "rejection_sampler_utils."
KERNELS = {
    _RS + "_gather_draft_sampled_kernel": gather_draft_sampled,
    _RS + "_flatten_sampled_kernel": flatten_sampled,
    _RSU + "_compute_local_logits_stats_kernel": compute_local_logits_stats,
    _RSU + "_rejection_kernel": rejection,
    _RSU + "_resample_kernel": resample,
    _RSU + "_insert_resampled_kernel": insert_resampled,
    _TDAR + "_prepare_prefill_inputs_kernel": draft_prefill_inputs,
    _TDAR + "_prepare_decode_inputs_kernel": draft_decode_inputs,
    _TDAR + "_update_draft_inputs_kernel": update_draft_inputs,
    _SD + "standalone_ar.speculator._prepare_prefill_inputs_kernel": standalone_prefill_inputs,
    _SD + "ngram.speculator._ngram_scan_kernel": ngram_scan,
    _SD + "ngram.speculator._ngram_finalize_kernel": ngram_finalize,
}


def register_v2_spec_decode_overrides() -> None:
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels(KERNELS)
