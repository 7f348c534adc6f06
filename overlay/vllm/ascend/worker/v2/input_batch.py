"""Torch forms of the input and bookkeeping kernels of upstream's ``input_batch.py``
(``vllm/v1/worker/gpu``): positions and sequence lengths, the step's token ids (sampled
and draft tokens combined, prefill tokens), the sampled/rejected counts and the state
updates after a step. The contract every module of this package keeps is in its
``__init__``.
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import request_of_token


def masked_set(target: torch.Tensor, index: tuple[torch.Tensor, ...], values, mask) -> None:
    """``target[index] = values`` where ``mask`` (integer tensors; masked-out entries may
    point anywhere valid, even at entries that are written)."""
    old = target[index]
    target.index_put_(index, torch.where(mask, values.to(target.dtype) - old, 0), accumulate=True)


# -- inputs (input_batch.py) ----------------------------------------------------------
def prepare_pos_seq_lens(
    pos_ptr: torch.Tensor,
    seq_lens_ptr: torch.Tensor,
    idx_mapping_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    num_computed_tokens_ptr: torch.Tensor,
    max_num_reqs: int,
    BLOCK_SIZE: int | None = None,
    **launch: object,
) -> None:
    num_reqs = idx_mapping_ptr.shape[0]
    computed = num_computed_tokens_ptr[idx_mapping_ptr.long()].to(torch.int64)
    qsl = query_start_loc_ptr[: num_reqs + 1].to(torch.int64)
    seq_lens_ptr[:num_reqs] = (computed + qsl[1:] - qsl[:-1]).to(seq_lens_ptr.dtype)
    seq_lens_ptr[num_reqs:max_num_reqs].fill_(0)  # (a 0 assigned would be a temporary tensor)
    if num_reqs == 0:
        return
    rows, offset, inside = request_of_token(qsl[1:], pos_ptr.shape[0])
    positions = computed[rows] + offset
    pos_ptr.copy_(torch.where(inside, positions.to(pos_ptr.dtype), pos_ptr))


def combine_sampled_and_draft_tokens(
    input_ids_ptr: torch.Tensor,
    idx_mapping_ptr: torch.Tensor,
    last_sampled_tokens_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    seq_lens_ptr: torch.Tensor,
    prefill_len_ptr: torch.Tensor,
    draft_tokens_ptr: torch.Tensor,
    draft_tokens_stride: int,
    cu_num_logits_ptr: torch.Tensor,
    logits_indices_ptr: torch.Tensor,
    BLOCK_SIZE: int | None = None,
    NUM_NEW_SAMPLED_TOKENS: int = 1,
    **launch: object,
) -> None:
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    req = idx_mapping_ptr.long()
    cu = cu_num_logits_ptr[: num_reqs + 1].to(torch.int64)
    num_logits = cu[1:] - cu[:-1]
    query_end = query_start_loc_ptr[1 : num_reqs + 1].to(torch.int64)
    logits_start = query_end - num_logits

    rows, offset, _ = request_of_token(cu[1:], logits_indices_ptr.shape[0])
    logits_indices_ptr.copy_((logits_start[rows] + offset).to(logits_indices_ptr.dtype))

    seq_len = seq_lens_ptr[:num_reqs].to(torch.int64)
    prefill_len = prefill_len_ptr[req].to(torch.int64)
    generating = seq_len > prefill_len
    last_slot = logits_start.clamp(0, input_ids_ptr.shape[0] - 1)
    if NUM_NEW_SAMPLED_TOKENS > 0:
        # only generated-token slots are rewritten, never the prompt's tail
        write_last = generating & (seq_len - num_logits >= prefill_len)
        masked_set(input_ids_ptr, (last_slot,), last_sampled_tokens_ptr.view(-1)[req], write_last)

    steps = draft_tokens_ptr.shape[-1] if draft_tokens_ptr is not None and draft_tokens_ptr.dim() > 1 else 0
    if steps == 0:
        return
    num_draft = num_logits - NUM_NEW_SAMPLED_TOKENS
    k = torch.arange(steps, device=cu.device)
    wanted = generating[:, None] & (k[None, :] < num_draft[:, None])
    slot = (query_end - num_draft)[:, None] + k[None, :]
    slot = slot.clamp(0, input_ids_ptr.shape[0] - 1)
    masked_set(input_ids_ptr, (slot,), draft_tokens_ptr[req][:, :steps], wanted)


def prepare_prefill_inputs(
    input_ids_ptr: torch.Tensor,
    next_prefill_tokens_ptr: torch.Tensor,
    next_prefill_tokens_stride: int,
    num_lookahead: int,
    idx_mapping_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    all_token_ids_ptr: torch.Tensor,
    all_token_ids_stride: int,
    prefill_lens_ptr: torch.Tensor,
    num_computed_tokens_ptr: torch.Tensor,
    BLOCK_SIZE: int | None = None,
    LOOKAHEAD_BLOCK: int | None = None,
    **launch: object,
) -> None:
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    req = idx_mapping_ptr.long()
    prefill_len = prefill_lens_ptr[req].to(torch.int64)
    computed = num_computed_tokens_ptr[req].to(torch.int64)
    prefilling = computed < prefill_len
    qsl = query_start_loc_ptr[: num_reqs + 1].to(torch.int64)
    last_col = all_token_ids_ptr.shape[1] - 1

    rows, offset, inside = request_of_token(qsl[1:], input_ids_ptr.shape[0])
    cols = (computed[rows] + offset).clamp(0, last_col)
    tokens = all_token_ids_ptr[req[rows], cols]
    take = inside & prefilling[rows]
    input_ids_ptr.copy_(torch.where(take, tokens.to(input_ids_ptr.dtype), input_ids_ptr))

    lookahead = int(num_lookahead)
    if lookahead == 0:
        return
    k = torch.arange(lookahead, device=qsl.device)
    pos = (computed + qsl[1:] - qsl[:-1])[None, :] + k[:, None]  # [lookahead, num_reqs]
    ahead = all_token_ids_ptr[req[None, :].expand_as(pos), pos.clamp(0, last_col)]
    ahead = torch.where(pos < prefill_len[None, :], ahead, 0)
    columns = req[None, :].expand_as(pos)
    lines = k[:, None].expand_as(pos)
    masked_set(next_prefill_tokens_ptr, (lines, columns), ahead, prefilling[None, :].expand_as(pos))


def get_num_sampled_and_rejected(
    num_sampled_ptr: torch.Tensor,
    num_rejected_ptr: torch.Tensor,
    seq_lens_ptr: torch.Tensor,
    cu_num_logits_ptr: torch.Tensor,
    idx_mapping_ptr: torch.Tensor,
    prefill_len_ptr: torch.Tensor,
    **launch: object,
) -> None:
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    chunked = seq_lens_ptr[:num_reqs] < prefill_len_ptr[idx_mapping_ptr.long()]
    sampled = num_sampled_ptr[:num_reqs]
    num_logits = (cu_num_logits_ptr[1 : num_reqs + 1] - cu_num_logits_ptr[:num_reqs]).to(sampled.dtype)
    num_rejected_ptr[:num_reqs] = torch.where(chunked, 0, num_logits - sampled).to(num_rejected_ptr.dtype)
    num_sampled_ptr[:num_reqs] = torch.where(chunked, 0, sampled)


def post_update(
    idx_mapping_ptr: torch.Tensor,
    num_computed_tokens_ptr: torch.Tensor,
    last_sampled_tokens_ptr: torch.Tensor,
    output_bin_counts_ptr: torch.Tensor,
    output_bin_counts_stride: int,
    sampled_tokens_ptr: torch.Tensor,
    sampled_tokens_stride: int,
    num_sampled_ptr: torch.Tensor,
    num_rejected_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    all_token_ids_ptr: torch.Tensor,
    all_token_ids_stride: int,
    total_len_ptr: torch.Tensor,
    draft_tokens_ptr: torch.Tensor,
    draft_tokens_out_ptr: torch.Tensor,
    num_draft_tokens: int,
    **launch: object,
) -> None:
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    req_raw = idx_mapping_ptr.long()
    real = req_raw >= 0  # negative entries: rows to skip
    req = req_raw.clamp(min=0)

    if draft_tokens_ptr is not None and int(num_draft_tokens) > 0:
        steps = int(num_draft_tokens)
        k = torch.arange(steps, device=req.device)
        masked_set(
            draft_tokens_out_ptr,
            (req[:, None].expand(-1, steps), k[None, :].expand(num_reqs, -1)),
            draft_tokens_ptr[:num_reqs, :steps],
            real[:, None].expand(-1, steps),
        )

    total_len = total_len_ptr[req].to(torch.int64)
    num_sampled = num_sampled_ptr[:num_reqs].to(torch.int64)
    sampled = sampled_tokens_ptr[:num_reqs]
    width = sampled.shape[1]
    has_sample = real & (num_sampled > 0)
    if width == 1:  # a step without drafts (the shape says so): one token, no gather
        last = sampled[:, 0]
        new = has_sample[:, None]
        cols = total_len[:, None].clamp(0, all_token_ids_ptr.shape[1] - 1)
    else:
        last = sampled.gather(1, (num_sampled - 1).clamp(0, width - 1)[:, None])[:, 0]
        i = torch.arange(width, device=req.device)
        new = real[:, None] & (i[None, :] < num_sampled[:, None])
        cols = (total_len[:, None] + i[None, :]).clamp(0, all_token_ids_ptr.shape[1] - 1)
    masked_set(last_sampled_tokens_ptr.view(-1), (req,), last, has_sample)
    masked_set(total_len_ptr, (req,), total_len + num_sampled, has_sample)

    reqs = req[:, None].expand(-1, width)
    masked_set(all_token_ids_ptr, (reqs, cols), sampled, new)
    if output_bin_counts_ptr is not None:
        tokens = sampled.long().clamp(0, output_bin_counts_ptr.shape[1] - 1)
        output_bin_counts_ptr.index_put_((reqs, tokens), new.to(output_bin_counts_ptr.dtype), accumulate=True)

    if query_start_loc_ptr is None:
        query_len = torch.zeros_like(num_sampled)
    else:
        qsl = query_start_loc_ptr[: num_reqs + 1].to(torch.int64)
        query_len = qsl[1:] - qsl[:-1]
    delta = query_len - num_rejected_ptr[:num_reqs].to(torch.int64)
    delta = torch.where(real, delta, 0).to(num_computed_tokens_ptr.dtype)
    num_computed_tokens_ptr.index_put_((req,), delta, accumulate=True)


def post_update_num_computed_tokens(
    idx_mapping_ptr: torch.Tensor,
    num_computed_tokens_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    **launch: object,
) -> None:
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    qsl = query_start_loc_ptr[: num_reqs + 1]
    delta = (qsl[1:] - qsl[:-1]).to(num_computed_tokens_ptr.dtype)
    num_computed_tokens_ptr.index_put_((idx_mapping_ptr.long(),), delta, accumulate=True)


def expand_idx_mapping(
    idx_mapping_ptr: torch.Tensor,
    expanded_idx_mapping_ptr: torch.Tensor,
    expanded_local_pos_ptr: torch.Tensor,
    cu_num_logits_ptr: torch.Tensor,
    BLOCK_SIZE: int | None = None,
    **launch: object,
) -> None:
    num_reqs = idx_mapping_ptr.shape[0]
    size = expanded_idx_mapping_ptr.shape[0]
    if num_reqs == 0 or size == 0:
        return
    cu = cu_num_logits_ptr[: num_reqs + 1].to(torch.int64)
    rows, offset, _ = request_of_token(cu[1:], size)
    expanded_idx_mapping_ptr.copy_(idx_mapping_ptr[rows])
    expanded_local_pos_ptr.copy_(offset.to(expanded_local_pos_ptr.dtype))
