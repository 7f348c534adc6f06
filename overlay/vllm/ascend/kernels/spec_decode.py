"""Speculative decoding: the drafter's step kernels and the rejection sampler.

Upstream writes these seven ops as Triton kernels with no torch fallback; the platform
registers the functions below in their place (``register_spec_decode_overrides``).
Each keeps its kernel's parameter names and order, so upstream's launcher forwards its
keyword arguments unchanged, and writes its results into the tensors it is given (the
callers keep references to them). The launcher never passes the grid, so sizes come
from tensor shapes.

Shared conventions: ``cu_num_draft_tokens`` is an inclusive cumulative sum (request
``r`` owns draft tokens ``cu[r-1] .. cu[r]-1``); ``-1`` marks a padded draft token or
a padding slot and is never used as an index.

``reference_*`` is plain torch and may read values back to the host (what host
emulation runs). ``npu_*`` computes the same without reading anything back and without
data-dependent shapes, so a step never waits for the device: torch_npu has no
rejection-sampling or drafter op (none in its 2.14 schema), so these are torch ops on
the NPU. They pass the same tests as the reference here; they have not run on an NPU.
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import pick, request_of_token

_SPEC_UTILS = "vllm.v1.spec_decode.utils."
_SAMPLER = "vllm.v1.sample.rejection_sampler."


def _flat(*tensors):
    """Kernels address their 1-D inputs through pointers; callers may pass [N, 1] views."""
    return [None if t is None else t.reshape(-1) for t in tensors]


def _spans(cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, count) of every request's draft tokens, int64."""
    end = cu.to(torch.int64)
    start = torch.cat([end.new_zeros(1), end])[:-1]
    return start, end - start


def _grid(cu: torch.Tensor, width: int, num_tokens: int):
    """Request x position grid: the flat token index of each (request, position), clamped
    into range, and whether the position exists in that request."""
    start, count = _spans(cu)
    pos = torch.arange(width, device=cu.device)
    inside = pos < count[:, None]
    index = (start[:, None] + pos).clamp(0, max(num_tokens - 1, 0))
    return index, inside, count


# -- drafter steps (vllm/v1/spec_decode/utils.py) ---------------------------------------
def eagle_step_slot_mapping_metadata(
    positions_ptr,
    block_table_ptr,
    block_table_stride,
    seq_lens_ptr,
    out_clamped_positions_ptr,
    out_slot_mapping_ptr,
    block_size,
    max_model_len,
    n_blocks_per_req,
    PAD_ID,
    batch_size,
):
    """Next draft token of each request: its position (0 past ``max_model_len``), slot
    (PAD_ID there) and sequence length; slots past the batch are the launcher's padding."""
    batch_size = int(batch_size)
    position = positions_ptr[:batch_size].to(torch.int64) + 1
    beyond = position >= max_model_len
    position = torch.where(beyond, 0, position)
    block = (position // block_size).clamp(max=n_blocks_per_req - 1)
    rows = torch.arange(batch_size, device=position.device)
    slot = block_table_ptr[rows, block].to(torch.int64) * block_size + position % block_size
    seq_len = torch.where(beyond, 1, seq_lens_ptr[:batch_size] + 1).clamp(max=max_model_len)
    out_clamped_positions_ptr[:batch_size].copy_(position)
    seq_lens_ptr[:batch_size].copy_(seq_len)
    out_slot_mapping_ptr[:batch_size].copy_(torch.where(beyond, PAD_ID, slot))
    out_slot_mapping_ptr[batch_size:].fill_(PAD_ID)


# Both forms: one formula, no data-dependent shape and nothing read back.
reference_eagle_step_slot_mapping_metadata = npu_eagle_step_slot_mapping_metadata = (
    eagle_step_slot_mapping_metadata
)


def eagle_prepare_inputs_padded(
    cu_num_draft_tokens_ptr,
    valid_sampled_tokens_count_ptr,
    query_start_loc_gpu_ptr,
    token_indices_to_sample_ptr,
    num_rejected_tokens_gpu_ptr,
    num_reqs,
):
    num_reqs = int(num_reqs)
    if num_reqs == 0:
        return
    _, drafts = _spans(cu_num_draft_tokens_ptr[:num_reqs])
    valid = valid_sampled_tokens_count_ptr[:num_reqs].to(torch.int64)
    rejected = torch.where(drafts > 0, drafts + 1 - valid, 0)
    last = query_start_loc_gpu_ptr[1 : num_reqs + 1].to(torch.int64) - 1
    token_indices_to_sample_ptr[:num_reqs].copy_(last - rejected)
    num_rejected_tokens_gpu_ptr[:num_reqs].copy_(rejected)


# Both forms: one formula, no data-dependent shape and nothing read back.
reference_eagle_prepare_inputs_padded = npu_eagle_prepare_inputs_padded = eagle_prepare_inputs_padded


def reference_eagle_prepare_next_token_padded(
    sampled_token_ids_ptr,
    discard_request_mask_ptr,
    backup_next_token_ids_ptr,
    next_token_ids_ptr,
    valid_sampled_tokens_count_ptr,
    vocab_size,
    num_sampled_tokens_per_req,
    num_reqs,
    stride_sampled_token_ids,
    BLOCK_SIZE_TOKENS,
):
    """Per request: how many sampled tokens are real (not -1, inside the vocabulary) and
    the last real one; a discarded request, or one with none, takes its backup token."""
    for r in range(int(num_reqs)):
        row = sampled_token_ids_ptr[r, :num_sampled_tokens_per_req].tolist()
        real = [i for i, t in enumerate(row) if t != -1 and t < vocab_size]
        if bool(discard_request_mask_ptr[r]):
            next_token_ids_ptr[r], valid_sampled_tokens_count_ptr[r] = backup_next_token_ids_ptr[r], 0
            continue
        next_token_ids_ptr[r] = row[real[-1]] if real else backup_next_token_ids_ptr[r]
        valid_sampled_tokens_count_ptr[r] = len(real)


def npu_eagle_prepare_next_token_padded(
    sampled_token_ids_ptr,
    discard_request_mask_ptr,
    backup_next_token_ids_ptr,
    next_token_ids_ptr,
    valid_sampled_tokens_count_ptr,
    vocab_size,
    num_sampled_tokens_per_req,
    num_reqs,
    stride_sampled_token_ids,
    BLOCK_SIZE_TOKENS,
):
    num_reqs = int(num_reqs)
    if num_reqs == 0:
        return
    rows = sampled_token_ids_ptr[:num_reqs, :num_sampled_tokens_per_req]
    real = (rows != -1) & (rows < vocab_size)
    count = real.sum(dim=1)
    columns = torch.arange(rows.shape[1], device=rows.device)
    last = torch.where(real, columns, -1).amax(dim=1).clamp(min=0)
    last_token = rows.gather(1, last[:, None])[:, 0]
    discard = discard_request_mask_ptr[:num_reqs]
    backup = backup_next_token_ids_ptr[:num_reqs]
    use_backup = discard | (count == 0)
    next_token_ids_ptr[:num_reqs].copy_(torch.where(use_backup, backup.to(last_token.dtype), last_token))
    valid_sampled_tokens_count_ptr[:num_reqs].copy_(torch.where(discard, 0, count))


# -- rejection sampler (vllm/v1/sample/rejection_sampler.py) ----------------------------
def _rates(synthetic_conditional_rates_ptr, width: int, device):
    rates = synthetic_conditional_rates_ptr
    pos = torch.arange(width, device=device).clamp(max=max(rates.numel() - 1, 0))
    return rates[pos]


def _write_verdicts(output_token_ids_ptr, accepted, token, inside, count, bonus, rows):
    """Each row of ``rows`` keeps its tokens up to and including the first rejection;
    a row with no rejection gets its bonus token after its drafts."""
    accepted = accepted & inside
    before = torch.cumprod(accepted.to(torch.int32), dim=1)
    written = torch.cat([torch.ones_like(before[:, :1]), before[:, :-1]], dim=1).bool() & inside
    out = output_token_ids_ptr
    width = accepted.shape[1]
    written &= rows[:, None]
    out[:, :width].copy_(torch.where(written, token.to(out.dtype), out[:, :width]))
    none_rejected = (accepted | ~inside).all(dim=1) & rows
    column = count[:, None]
    current = out.gather(1, column)
    out.scatter_(1, column, torch.where(none_rejected[:, None], bonus.reshape(-1, 1).to(out.dtype), current))


def reference_rejection_greedy_sample(
    output_token_ids_ptr,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    target_argmax_ptr,
    bonus_token_ids_ptr,
    is_greedy_ptr,
    max_spec_len,
    uniform_probs_ptr,
    synthetic_conditional_rates_ptr,
    SYNTHETIC_MODE,
):
    """Walk the drafts position by position: a greedy request keeps the target's argmax
    (synthetic mode: the draft when its uniform draw is below the position's rate) and
    stops at the first disagreement; with none, the bonus token follows."""
    draft_token_ids_ptr, target_argmax_ptr, uniform_probs_ptr = _flat(
        draft_token_ids_ptr, target_argmax_ptr, uniform_probs_ptr
    )
    out = output_token_ids_ptr
    start, count = _spans(cu_num_draft_tokens_ptr)
    live = torch.ones_like(count, dtype=torch.bool) if is_greedy_ptr is None else is_greedy_ptr.clone()
    for pos in range(int(count.max()) if count.numel() else 0):
        rows = live & (pos < count)
        if not bool(rows.any()):
            break
        t = (start + pos)[rows]
        draft, argmax = draft_token_ids_ptr[t].to(torch.int64), target_argmax_ptr[t].to(torch.int64)
        if SYNTHETIC_MODE:
            accept = (uniform_probs_ptr[t] < synthetic_conditional_rates_ptr[pos]) & (draft >= 0)
            out[rows, pos] = torch.where(accept, draft, argmax).to(out.dtype)
        else:
            accept = draft == argmax
            out[rows, pos] = argmax.to(out.dtype)
        idx = rows.nonzero()[:, 0]
        live[idx[~accept]] = False
    greedy = torch.ones_like(live) if is_greedy_ptr is None else is_greedy_ptr
    finished = live & greedy
    out[finished, count[finished]] = bonus_token_ids_ptr.reshape(-1)[finished].to(out.dtype)


def npu_rejection_greedy_sample(
    output_token_ids_ptr,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    target_argmax_ptr,
    bonus_token_ids_ptr,
    is_greedy_ptr,
    max_spec_len,
    uniform_probs_ptr,
    synthetic_conditional_rates_ptr,
    SYNTHETIC_MODE,
):
    draft_token_ids_ptr, target_argmax_ptr, uniform_probs_ptr = _flat(
        draft_token_ids_ptr, target_argmax_ptr, uniform_probs_ptr
    )
    out = output_token_ids_ptr
    width = out.shape[1] - 1
    num_tokens = draft_token_ids_ptr.numel()
    index, inside, count = _grid(cu_num_draft_tokens_ptr, width, num_tokens)
    rows = torch.ones_like(count, dtype=torch.bool) if is_greedy_ptr is None else is_greedy_ptr.bool()
    if num_tokens == 0:
        accepted = token = torch.zeros_like(inside, dtype=torch.int64)
    else:
        draft = draft_token_ids_ptr[index].to(torch.int64)
        token = target_argmax_ptr[index].to(torch.int64)
        if SYNTHETIC_MODE:
            rates = _rates(synthetic_conditional_rates_ptr, width, out.device)
            accepted = (uniform_probs_ptr[index] < rates) & (draft >= 0)
            token = torch.where(accepted, draft, token)
        else:
            accepted = draft == token
    _write_verdicts(out, accepted.bool(), token, inside, count, bonus_token_ids_ptr, rows)


def reference_rejection_random_sample(
    output_token_ids_ptr,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    bonus_token_ids_ptr,
    recovered_token_ids_ptr,
    uniform_probs_ptr,
    is_greedy_ptr,
    max_spec_len,
    vocab_size,
    synthetic_conditional_rates_ptr,
    NO_DRAFT_PROBS,
    SYNTHETIC_MODE,
):
    """Walk the drafts of each random request: accept draft d when p(d)/q(d) >= u (q = 1
    without draft probabilities; synthetic mode: u < the position's rate), a -1 draft is
    rejected; the first rejection takes the recovered token and ends the request."""
    draft_token_ids_ptr, recovered_token_ids_ptr, uniform_probs_ptr = _flat(
        draft_token_ids_ptr, recovered_token_ids_ptr, uniform_probs_ptr
    )
    out = output_token_ids_ptr
    start, count = _spans(cu_num_draft_tokens_ptr)
    live = ~is_greedy_ptr.bool()
    for pos in range(int(count.max()) if count.numel() else 0):
        rows = live & (pos < count)
        if not bool(rows.any()):
            break
        t = (start + pos)[rows]
        draft = draft_token_ids_ptr[t].to(torch.int64)
        u = uniform_probs_ptr[t]
        real = draft >= 0
        safe = draft.clamp(min=0)
        if SYNTHETIC_MODE:
            accept = real & (u < synthetic_conditional_rates_ptr[pos])
        else:
            p = target_probs_ptr[t, safe]
            q = torch.ones_like(p) if NO_DRAFT_PROBS else draft_probs_ptr[t, safe]
            accept = real & (q > 0) & (p / q >= u)
        out[rows, pos] = torch.where(accept, draft, recovered_token_ids_ptr[t].to(torch.int64)).to(out.dtype)
        idx = rows.nonzero()[:, 0]
        live[idx[~accept]] = False
    out[live, count[live]] = bonus_token_ids_ptr.reshape(-1)[live].to(out.dtype)


def npu_rejection_random_sample(
    output_token_ids_ptr,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    bonus_token_ids_ptr,
    recovered_token_ids_ptr,
    uniform_probs_ptr,
    is_greedy_ptr,
    max_spec_len,
    vocab_size,
    synthetic_conditional_rates_ptr,
    NO_DRAFT_PROBS,
    SYNTHETIC_MODE,
):
    draft_token_ids_ptr, recovered_token_ids_ptr, uniform_probs_ptr = _flat(
        draft_token_ids_ptr, recovered_token_ids_ptr, uniform_probs_ptr
    )
    out = output_token_ids_ptr
    width = out.shape[1] - 1
    num_tokens = draft_token_ids_ptr.numel()
    index, inside, count = _grid(cu_num_draft_tokens_ptr, width, num_tokens)
    rows = ~is_greedy_ptr.bool()
    if num_tokens == 0:
        accepted = torch.zeros_like(inside)
        token = torch.zeros_like(inside, dtype=torch.int64)
    else:
        draft = draft_token_ids_ptr[index].to(torch.int64)
        safe = draft.clamp(0, vocab_size - 1)
        u = uniform_probs_ptr[index]
        if SYNTHETIC_MODE:
            accepted = u < _rates(synthetic_conditional_rates_ptr, width, out.device)
        else:
            p = target_probs_ptr[index, safe]
            q = torch.ones_like(p) if NO_DRAFT_PROBS else draft_probs_ptr[index, safe]
            accepted = (q > 0) & (p / q >= u)
        accepted &= draft >= 0
        token = torch.where(accepted, draft, recovered_token_ids_ptr[index].to(torch.int64))
    _write_verdicts(out, accepted, token, inside, count, bonus_token_ids_ptr, rows)


def reference_expand(output_ptr, input_ptr, cu_num_tokens_ptr, replace_from, replace_to, MAX_NUM_TOKENS):
    """Repeat each request's value over its tokens (at most MAX_NUM_TOKENS of them),
    with ``replace_from`` swapped for ``replace_to``."""
    start, count = _spans(cu_num_tokens_ptr)
    for r, (s, n) in enumerate(zip(start.tolist(), count.tolist())):
        value = input_ptr[r]
        output_ptr[s : s + min(n, MAX_NUM_TOKENS)] = replace_to if bool(value == replace_from) else value


def npu_expand(output_ptr, input_ptr, cu_num_tokens_ptr, replace_from, replace_to, MAX_NUM_TOKENS):
    num_tokens = output_ptr.numel()
    if num_tokens == 0 or input_ptr.numel() == 0:
        return
    req, pos, owned = request_of_token(cu_num_tokens_ptr, num_tokens)
    values = input_ptr.masked_fill(input_ptr == replace_from, replace_to)
    output_ptr.copy_(torch.where(owned & (pos < MAX_NUM_TOKENS), values[req], output_ptr))


def _recovery_scores(draft_token_ids_ptr, draft_probs_ptr, target_probs_ptr, inv_q_ptr, req, NO_DRAFT_PROBS):
    """Where rejection lands: argmax over the vocabulary of (target - draft)^+ / q, one
    exponential draw q per request (without draft probabilities: the target with the
    draft token removed)."""
    vocab = target_probs_ptr.shape[1]
    if NO_DRAFT_PROBS:
        draft = draft_token_ids_ptr.to(torch.int64)
        in_vocab = (draft >= 0) & (draft < vocab)
        removed = torch.arange(vocab, device=draft.device) == draft[:, None]
        prob = target_probs_ptr.masked_fill(removed & in_vocab[:, None], 0.0)
    else:
        prob = (target_probs_ptr - draft_probs_ptr).clamp(min=0.0)
    inv_q = inv_q_ptr[req]
    return prob.to(inv_q.dtype) * inv_q


def reference_sample_recovered_tokens(
    output_token_ids_ptr,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    inv_q_ptr,
    vocab_size,
    BLOCK_SIZE,
    NO_DRAFT_PROBS,
    USE_FP64_GUMBEL,
):
    output_token_ids_ptr, draft_token_ids_ptr = output_token_ids_ptr.view(-1), draft_token_ids_ptr.reshape(-1)
    start, count = _spans(cu_num_draft_tokens_ptr)
    req = torch.repeat_interleave(torch.arange(count.numel(), device=count.device), count)
    n = req.numel()
    draft_probs = None if draft_probs_ptr is None else draft_probs_ptr[:n]
    scores = _recovery_scores(
        draft_token_ids_ptr[:n], draft_probs, target_probs_ptr[:n], inv_q_ptr, req, NO_DRAFT_PROBS
    )
    output_token_ids_ptr[:n] = scores.argmax(dim=1).clamp(max=vocab_size - 1).to(output_token_ids_ptr.dtype)


def npu_sample_recovered_tokens(
    output_token_ids_ptr,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    inv_q_ptr,
    vocab_size,
    BLOCK_SIZE,
    NO_DRAFT_PROBS,
    USE_FP64_GUMBEL,
):
    output_token_ids_ptr, draft_token_ids_ptr = output_token_ids_ptr.view(-1), draft_token_ids_ptr.reshape(-1)
    num_tokens = output_token_ids_ptr.numel()
    if num_tokens == 0:
        return
    req, _, owned = request_of_token(cu_num_draft_tokens_ptr, num_tokens)
    scores = _recovery_scores(
        draft_token_ids_ptr, draft_probs_ptr, target_probs_ptr, inv_q_ptr, req, NO_DRAFT_PROBS
    )
    recovered = scores.argmax(dim=1).clamp(max=vocab_size - 1).to(output_token_ids_ptr.dtype)
    output_token_ids_ptr.copy_(torch.where(owned, recovered, output_token_ids_ptr))


KERNELS = {
    _SPEC_UTILS + "eagle_step_slot_mapping_metadata_kernel": eagle_step_slot_mapping_metadata,
    _SPEC_UTILS + "eagle_prepare_inputs_padded_kernel": eagle_prepare_inputs_padded,
    _SPEC_UTILS + "eagle_prepare_next_token_padded_kernel": pick(
        reference_eagle_prepare_next_token_padded, npu_eagle_prepare_next_token_padded
    ),
    _SAMPLER + "rejection_greedy_sample_kernel": pick(
        reference_rejection_greedy_sample, npu_rejection_greedy_sample
    ),
    _SAMPLER + "rejection_random_sample_kernel": pick(
        reference_rejection_random_sample, npu_rejection_random_sample
    ),
    _SAMPLER + "expand_kernel": pick(reference_expand, npu_expand),
    _SAMPLER + "sample_recovered_tokens_kernel": pick(
        reference_sample_recovered_tokens, npu_sample_recovered_tokens
    ),
}


def register_spec_decode_overrides() -> None:
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels(KERNELS)
