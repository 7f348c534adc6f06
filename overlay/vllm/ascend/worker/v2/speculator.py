"""Torch forms of the drafters' input kernels (``spec_decode/``): the target-dependent
drafter's (MTP, EAGLE: ``target_dependent_ar/speculator.py``: the prefill shift, the
decode-step inputs, the per-step update), the n-gram drafter's and a separate draft
model's (``standalone_ar/speculator.py``).
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import request_of_token
from vllm.ascend.worker.v2.input_batch import masked_set


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
    padding_rows: bool = False,
    **launch: object,
) -> None:
    """The draft's first step sees the target's tokens shifted by one, ending in the
    token just sampled (or, mid-prefill, the prompt's next token). ``padding_rows`` (a
    graph's padded batch; upstream's launch never passes it): negative request slots are
    padding rows, which get nothing, as rows past the kernel's launch."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    real = idx_mapping_ptr >= 0 if padding_rows else None
    qsl = query_start_loc_ptr[: num_reqs + 1].long()
    length = qsl[1:] - qsl[:-1] - num_rejected_ptr[:num_reqs].long()
    req_state = idx_mapping_ptr.long()
    if real is not None:
        length = torch.where(real, length, 0)
        req_state = req_state.clamp(min=0)
    # flat indices, as the kernel's pointer arithmetic (both may be 2-D buffers)
    sampled = last_sampled_ptr.reshape(-1)[req_state].to(torch.int32)
    upcoming = next_prefill_tokens_ptr.reshape(-1)[req_state].to(torch.int32)
    next_token = torch.where(num_sampled_ptr[:num_reqs] > 0, sampled, upcoming)

    num_tokens = target_input_ids_ptr.shape[0]
    rows, offset, inside = request_of_token(qsl[1:], num_tokens)
    kept = inside & (offset < length[rows])
    token = torch.arange(num_tokens, device=qsl.device)
    masked_set(draft_input_ids_ptr, ((token - 1).clamp(min=0),), target_input_ids_ptr, kept & (offset >= 1))
    masked_set(draft_positions_ptr, (token,), target_positions_ptr, kept)
    last = qsl[:-1] + length - 1
    starts = qsl[:-1]
    seq_lens = seq_lens_ptr[:num_reqs]
    if real is None:
        draft_input_ids_ptr[last] = next_token.to(draft_input_ids_ptr.dtype)
    else:
        last = torch.where(real, last, 0)
        masked_set(draft_input_ids_ptr, (last,), next_token, real)
        starts = torch.where(real, starts, qsl[-1])  # (where the last request's query ends)
        seq_lens = torch.where(real, seq_lens, 0)
    last_token_indices_ptr[:num_reqs] = last.to(last_token_indices_ptr.dtype)
    last_token_indices_ptr[num_reqs:max_num_reqs].fill_(0)
    draft_query_start_loc_ptr[:num_reqs] = starts.to(draft_query_start_loc_ptr.dtype)
    draft_query_start_loc_ptr[num_reqs : max_num_reqs + 1] = qsl[-1].to(draft_query_start_loc_ptr.dtype)
    draft_seq_lens_ptr[:num_reqs] = seq_lens.to(draft_seq_lens_ptr.dtype)
    draft_seq_lens_ptr[num_reqs:max_num_reqs].fill_(0)
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
    real_rows: torch.Tensor | None = None,
    **launch: object,
) -> None:
    """``real_rows`` (a graph's padded batch; upstream's launch never passes it): which
    rows are requests; the others are left as they are and get no query token, as rows
    past the kernel's launch."""
    num_reqs = draft_tokens_ptr.shape[0]
    first_draft = draft_tokens_ptr.as_strided((num_reqs,), (int(draft_tokens_stride),))
    input_ids = first_draft.to(input_ids_ptr.dtype)
    seq_len = target_seq_lens_ptr[:num_reqs].long() - num_rejected_ptr[:num_reqs].long()
    positions = positions_ptr[:num_reqs]
    if ADVANCE_DRAFT_POSITIONS:
        positions = (positions + 1).clamp(max=int(max_model_len) - 1)
        seq_len = (seq_len + 1).clamp(max=int(max_model_len))
    lanes = torch.arange(max_num_reqs + 1, device=query_start_loc_ptr.device)
    if real_rows is None:
        sample_src_positions_ptr[:num_reqs] += 1
        query_ends = lanes.clamp(max=num_reqs)
    else:
        input_ids = torch.where(real_rows, input_ids, input_ids_ptr[:num_reqs])
        sample_src_positions_ptr[:num_reqs] += real_rows
        positions = torch.where(real_rows, positions, positions_ptr[:num_reqs])
        seq_len = torch.where(real_rows, seq_len, 0)
        query_ends = torch.minimum(lanes, real_rows.sum())
    input_ids_ptr[:num_reqs] = input_ids
    if ADVANCE_DRAFT_POSITIONS:
        positions_ptr[:num_reqs] = positions
    seq_lens_ptr[:num_reqs] = seq_len.to(seq_lens_ptr.dtype)
    seq_lens_ptr[num_reqs:max_num_reqs] = 0
    query_start_loc_ptr[: max_num_reqs + 1] = query_ends.to(query_start_loc_ptr.dtype)


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
