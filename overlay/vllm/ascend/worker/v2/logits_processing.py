"""Torch forms of the logits-processing kernels of upstream's ``sample/`` (min-p, the
repetition/frequency/presence penalties and the token counts they read, allowed token
ids / logit bias / min-tokens, bad words, logprobs and ranks, prompt logprobs, thinking-
token budgets) and of the grammar bitmask of ``structured_outputs.py``. Scatters that may
meet the same token twice count with ``scatter_add_`` and compare with zero, so
duplicates and masked-out padding never race.
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import request_of_token

_NEG_INF = float("-inf")


def _unpack_bits(words: torch.Tensor, size: int) -> torch.Tensor:
    """[rows, ceil(size / 32)] int32 bit sets -> [rows, size] bool, bit i of word w at w*32+i."""
    bits = (words.to(torch.int64)[:, :, None] >> torch.arange(32, device=words.device)) & 1
    return bits.reshape(words.shape[0], -1)[:, :size].bool()


def _flags(num_rows: int, size: int, ids: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """[num_rows, size] bool: True where some ``ids[r, k]`` with ``on[r, k]`` names the column."""
    hits = torch.zeros(num_rows, size, dtype=torch.int32, device=ids.device)
    hits.scatter_add_(1, ids.long().clamp(0, size - 1), on.to(torch.int32))
    return hits > 0


def apply_min_p(
    logits_ptr: torch.Tensor,
    logits_stride: int,
    expanded_idx_mapping_ptr: torch.Tensor,
    min_p_ptr: torch.Tensor,
    vocab_size: int,
    BLOCK_SIZE: int | None = None,
    **launch: object,
) -> None:
    num_tokens, vocab = logits_ptr.shape[0], int(vocab_size)
    if num_tokens == 0:
        return
    min_p = min_p_ptr[expanded_idx_mapping_ptr[:num_tokens].long()].to(torch.float32)
    view = logits_ptr[:, :vocab]
    threshold = view.to(torch.float32).max(dim=1).values + torch.log(min_p)
    drop = (min_p != 0.0)[:, None] & (view < threshold[:, None])
    view.masked_fill_(drop, _NEG_INF)


def apply_penalties(
    logits_ptr: torch.Tensor,
    logits_stride: int,
    expanded_idx_mapping_ptr: torch.Tensor,
    token_ids_ptr: torch.Tensor,
    expanded_local_pos_ptr: torch.Tensor,
    repetition_penalty_ptr: torch.Tensor,
    frequency_penalty_ptr: torch.Tensor,
    presence_penalty_ptr: torch.Tensor,
    prompt_bin_mask_ptr: torch.Tensor,
    prompt_bin_mask_stride: int,
    output_bin_counts_ptr: torch.Tensor,
    output_bin_counts_stride: int,
    vocab_size: int,
    BLOCK_SIZE: int | None = None,
    **launch: object,
) -> None:
    num_tokens, vocab = logits_ptr.shape[0], int(vocab_size)
    if num_tokens == 0:
        return
    req = expanded_idx_mapping_ptr[:num_tokens].long()
    rep = repetition_penalty_ptr[req].to(torch.float32)[:, None]
    freq = frequency_penalty_ptr[req].to(torch.float32)[:, None]
    pres = presence_penalty_ptr[req].to(torch.float32)[:, None]
    used = (rep != 1.0) | (freq != 0.0) | (pres != 0.0)

    counts = output_bin_counts_ptr[req, :vocab].to(torch.int32)
    # a draft position also counts the drafts before it in its request: the tokens at
    # flat positions start+1 .. t, start = t - local position
    t = torch.arange(num_tokens, device=req.device)
    start = t - expanded_local_pos_ptr[:num_tokens].long()
    earlier = (t[None, :] <= t[:, None]) & (t[None, :] > start[:, None])
    tokens = token_ids_ptr[:num_tokens].long().clamp(0, vocab - 1)
    counts.scatter_add_(1, tokens[None, :].expand(num_tokens, -1), earlier.to(torch.int32))
    seen = counts > 0

    in_prompt = _unpack_bits(prompt_bin_mask_ptr[req], vocab)

    x = logits_ptr[:, :vocab].to(torch.float32)
    scale = torch.where(in_prompt | seen, rep, 1.0)
    x = x * torch.where(x > 0, 1.0 / scale, scale)
    x = x - freq * counts
    x = x - pres * seen
    view = logits_ptr[:, :vocab]
    view.copy_(torch.where(used, x.to(view.dtype), view))


_BINCOUNT_ROWS = 16  # rows at a time: a [rows, vocab] count table each


def bincount(
    expanded_idx_mapping_ptr: torch.Tensor,
    all_token_ids_ptr: torch.Tensor,
    all_token_ids_stride: int,
    prompt_len_ptr: torch.Tensor,
    prefill_len_ptr: torch.Tensor,
    prompt_bin_mask_ptr: torch.Tensor,
    prompt_bin_mask_stride: int,
    output_bin_counts_ptr: torch.Tensor,
    output_bin_counts_stride: int,
    BLOCK_SIZE: int | None = None,
    **launch: object,
) -> None:
    num_rows = expanded_idx_mapping_ptr.shape[0]
    if num_rows == 0:
        return
    width = all_token_ids_ptr.shape[1]
    words = prompt_bin_mask_ptr.shape[1]
    vocab = output_bin_counts_ptr.shape[1]
    column = torch.arange(width, device=all_token_ids_ptr.device)
    weights = torch.ones(32, dtype=torch.int64, device=column.device) << torch.arange(
        32, device=column.device
    )
    for first in range(0, num_rows, _BINCOUNT_ROWS):
        req = expanded_idx_mapping_ptr[first : first + _BINCOUNT_ROWS].long()
        rows = req.shape[0]
        tokens = all_token_ids_ptr[req].long()
        prompt = column[None, :] < prompt_len_ptr[req].long()[:, None]
        output = ~prompt & (column[None, :] < prefill_len_ptr[req].long()[:, None])

        present = _flags(rows, words * 32, tokens, prompt).to(torch.int64)
        packed = (present.view(rows, words, 32) * weights).sum(dim=-1)  # bits 0..31 of each word
        packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(prompt_bin_mask_ptr.dtype)
        prompt_bin_mask_ptr[req] = prompt_bin_mask_ptr[req] | packed

        added = torch.zeros(rows, vocab, dtype=output_bin_counts_ptr.dtype, device=column.device)
        added.scatter_add_(1, tokens.clamp(0, vocab - 1), output.to(added.dtype))
        output_bin_counts_ptr.index_add_(0, req, added)


def apply_bias(
    logits_ptr: torch.Tensor,
    logits_stride: int,
    vocab_size: int,
    expanded_idx_mapping_ptr: torch.Tensor,
    num_allowed_token_ids_ptr: torch.Tensor,
    allowed_token_ids_ptr: torch.Tensor,
    allowed_token_ids_stride: int,
    num_logit_bias_ptr: torch.Tensor,
    bias_token_ids_ptr: torch.Tensor,
    bias_token_ids_stride: int,
    bias_ptr: torch.Tensor,
    bias_stride: int,
    pos_ptr: torch.Tensor,
    min_lens_ptr: torch.Tensor,
    num_stop_token_ids_ptr: torch.Tensor,
    restore_when_all_masked_ptr: torch.Tensor,
    stop_token_ids_ptr: torch.Tensor,
    stop_token_ids_stride: int,
    BLOCK_SIZE: int | None = None,
    LOGITS_BLOCK_SIZE: int | None = None,
    CHECK_ALL_MASKED_ROWS: bool = False,
    **launch: object,
) -> None:
    num_tokens, vocab = logits_ptr.shape[0], int(vocab_size)
    if num_tokens == 0:
        return
    req = expanded_idx_mapping_ptr[:num_tokens].long()
    view = logits_ptr[:, :vocab]
    device = req.device

    # allowed token ids: every other token to -inf
    allowed = allowed_token_ids_ptr[req]
    n_allowed = num_allowed_token_ids_ptr[req].long()
    listed = torch.arange(allowed.shape[1], device=device)[None, :] < n_allowed[:, None]
    keep = _flags(num_tokens, vocab, allowed, listed)
    view.masked_fill_((n_allowed > 0)[:, None] & ~keep, _NEG_INF)

    # logit bias: added at each listed token id (ids of one request are distinct)
    ids = bias_token_ids_ptr[req]
    listed = torch.arange(ids.shape[1], device=device)[None, :] < num_logit_bias_ptr[req].long()[:, None]
    bias = torch.where(listed, bias_ptr[req].to(view.dtype), torch.zeros((), dtype=view.dtype, device=device))
    rows = torch.arange(num_tokens, device=device)[:, None].expand_as(ids)
    view.index_put_((rows, ids.long().clamp(0, vocab - 1)), bias, accumulate=True)

    # min tokens: stop tokens to -inf until the request reaches its minimum length
    stops = stop_token_ids_ptr[req]
    n_stops = num_stop_token_ids_ptr[req].long()
    active = (n_stops > 0) & (pos_ptr[:num_tokens].long() + 1 < min_lens_ptr[req].long())
    listed = torch.arange(stops.shape[1], device=device)[None, :] < n_stops[:, None]
    banned = _flags(num_tokens, vocab, stops, listed & active[:, None])
    before = view.clone() if CHECK_ALL_MASKED_ROWS else None
    view.masked_fill_(banned, _NEG_INF)
    if CHECK_ALL_MASKED_ROWS:
        # a row left with nothing but -inf gets its finite stop logits back
        empty = (view.max(dim=1).values == _NEG_INF) & restore_when_all_masked_ptr[req].bool() & active
        back = empty[:, None] & banned & torch.isfinite(before)
        view.copy_(torch.where(back, before, view))


def apply_bad_words(
    logits_ptr: torch.Tensor,
    logits_stride: int,
    expanded_idx_mapping_ptr: torch.Tensor,
    bad_word_token_ids_ptr: torch.Tensor,
    bad_word_token_ids_stride: int,
    bad_word_offsets_ptr: torch.Tensor,
    bad_word_offsets_stride: int,
    num_bad_words_ptr: torch.Tensor,
    all_token_ids_ptr: torch.Tensor,
    all_token_ids_stride: int,
    prompt_len_ptr: torch.Tensor,
    total_len_ptr: torch.Tensor,
    input_ids_ptr: torch.Tensor,
    expanded_local_pos_ptr: torch.Tensor,
    **launch: object,
) -> None:
    """A bad word's last token is banned where the tokens before it (outputs, then this
    step's drafts) end with the word's other tokens."""
    num_tokens = logits_ptr.shape[0]
    if num_tokens == 0:
        return
    device = logits_ptr.device
    req = expanded_idx_mapping_ptr[:num_tokens].long()
    words = bad_word_offsets_ptr.shape[1] - 1
    width = bad_word_token_ids_ptr.shape[1]
    offsets = bad_word_offsets_ptr[req].long()  # [tokens, words + 1]
    start, end = offsets[:, :-1], offsets[:, 1:]
    prefix = end - start - 1
    local = expanded_local_pos_ptr[:num_tokens].long()
    prompt_len = prompt_len_ptr[req].long()
    output_len = total_len_ptr[req].long() - prompt_len
    effective = (output_len + local)[:, None]  # tokens before this position, after the prompt
    listed = torch.arange(words, device=device)[None, :] < num_bad_words_ptr[req].long()[:, None]
    fits = listed & (prefix <= effective) & (prefix >= 0)

    i = torch.arange(width, device=device)[None, None, :]
    word = bad_word_token_ids_ptr[req].long()  # [tokens, width]
    expected = word.gather(1, (start[:, :, None] + i).clamp(0, width - 1).flatten(1)).view(
        num_tokens, words, width
    )
    at = effective[:, :, None] - prefix[:, :, None] + i  # output positions compared
    from_drafts = at >= output_len[:, None, None]
    first = (torch.arange(num_tokens, device=device) - local)[:, None, None]
    draft_slot = (first + at - output_len[:, None, None] + 1).clamp(0, input_ids_ptr.shape[0] - 1)
    committed = all_token_ids_ptr[req].long()
    col = (prompt_len[:, None, None] + at).clamp(0, committed.shape[1] - 1)
    actual = torch.where(
        from_drafts,
        input_ids_ptr.long()[draft_slot],
        committed.gather(1, col.flatten(1)).view(num_tokens, words, width),
    )
    match = torch.where(i < prefix[:, :, None], expected == actual, True).all(dim=-1)
    last = word.gather(1, (end - 1).clamp(0, width - 1))
    vocab = logits_ptr.shape[1]
    logits_ptr.masked_fill_(_flags(num_tokens, vocab, last, fits & match), _NEG_INF)


# -- logprobs (logprob.py, prompt_logprob.py) ------------------------------------------
def topk_log_softmax(
    output_ptr: torch.Tensor,
    logits_ptr: torch.Tensor,
    logits_stride: int,
    topk_ids_ptr: torch.Tensor,
    topk_ids_stride: int,
    topk: int,
    vocab_size: int,
    BLOCK_SIZE: int | None = None,
    TOPK_BLOCK_SIZE: int | None = None,
    **launch: object,
) -> None:
    rows, vocab, k = logits_ptr.shape[0], int(vocab_size), int(topk)
    if rows == 0 or k == 0:
        return
    x = logits_ptr[:, :vocab].to(torch.float32)
    top = x.max(dim=1, keepdim=True).values
    lse = torch.log(torch.exp(x - top).sum(dim=1, keepdim=True))
    picked = x.gather(1, topk_ids_ptr[:, :k].long())
    output_ptr.view(-1)[: rows * k].copy_((picked - top - lse).reshape(-1))


def token_ranks(
    output_ptr: torch.Tensor,
    logits_ptr: torch.Tensor,
    logits_stride: int,
    token_ids_ptr: torch.Tensor,
    vocab_size: int,
    BLOCK_SIZE: int | None = None,
    **launch: object,
) -> None:
    rows, vocab = logits_ptr.shape[0], int(vocab_size)
    if rows == 0:
        return
    view = logits_ptr[:, :vocab]
    chosen = view.gather(1, token_ids_ptr[:rows].long().view(-1, 1))
    output_ptr[:rows] = (view >= chosen).sum(dim=1).to(output_ptr.dtype)


def fill_logprob_token_ids(
    out_token_ids_ptr: torch.Tensor,
    out_token_ids_stride: int,
    out_valid_mask_ptr: torch.Tensor,
    out_valid_mask_stride: int,
    sampled_token_ids_ptr: torch.Tensor,
    topk_indices_ptr: torch.Tensor,
    topk_indices_stride: int,
    expanded_idx_mapping_ptr: torch.Tensor,
    num_per_req_token_ids_ptr: torch.Tensor,
    per_req_token_ids_ptr: torch.Tensor,
    per_req_token_ids_stride: int,
    NUM_TOPK: int,
    PADDED_COLS: int | None = None,
    **launch: object,
) -> None:
    rows, cols = out_token_ids_ptr.shape[0], out_token_ids_ptr.shape[1] - 1
    if rows == 0:
        return
    device = out_token_ids_ptr.device
    out_token_ids_ptr[:, 0] = sampled_token_ids_ptr[:rows].to(out_token_ids_ptr.dtype)
    out_valid_mask_ptr[:, 0] = True
    req = expanded_idx_mapping_ptr[:rows].long()
    custom = num_per_req_token_ids_ptr[req].long()
    col = torch.arange(cols, device=device)[None, :]
    listed = torch.zeros(rows, cols, dtype=torch.int64, device=device)
    width = min(cols, per_req_token_ids_ptr.shape[1])
    listed[:, :width] = per_req_token_ids_ptr[req][:, :width].long()
    top = int(NUM_TOPK)
    if top > 0:
        ranked = torch.zeros(rows, cols, dtype=torch.int64, device=device)
        ranked[:, :top] = topk_indices_ptr[:rows, :top].long()
    else:
        ranked = torch.zeros_like(listed)
    valid = torch.where(custom[:, None] > 0, col < custom[:, None], col < top)
    tokens = torch.where(custom[:, None] > 0, listed, ranked)
    out = out_token_ids_ptr[:, 1:]
    out.copy_(torch.where(valid, tokens.to(out.dtype), out))
    mask = out_valid_mask_ptr[:, 1:]
    mask.copy_(mask | valid)


def prompt_logprobs_token_ids(
    prompt_logprobs_token_ids_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    idx_mapping_ptr: torch.Tensor,
    num_computed_tokens_ptr: torch.Tensor,
    all_token_ids_ptr: torch.Tensor,
    all_token_ids_stride: int,
    BLOCK_SIZE: int | None = None,
    **launch: object,
) -> None:
    """Each scheduled token's next prompt token (the token its logprob is for)."""
    num_reqs = idx_mapping_ptr.shape[0]
    size = prompt_logprobs_token_ids_ptr.shape[0]
    if num_reqs == 0 or size == 0:
        return
    req = idx_mapping_ptr.long()
    row, offset, inside = request_of_token(query_start_loc_ptr[1 : num_reqs + 1], size)
    target = num_computed_tokens_ptr[req].long()[row] + 1 + offset
    tokens = all_token_ids_ptr[req[row], target.clamp(0, all_token_ids_ptr.shape[1] - 1)]
    out = prompt_logprobs_token_ids_ptr
    out.copy_(torch.where(inside, tokens.to(out.dtype), out))


# -- structured outputs (structured_outputs.py) ---------------------------------------
def apply_grammar_bitmask(
    logits_ptr: torch.Tensor,
    logits_stride: int,
    logits_indices_ptr: torch.Tensor,
    cu_num_logits_ptr: torch.Tensor,
    bitmask_ptr: torch.Tensor,
    bitmask_stride: int,
    vocab_size: int,
    MASK_STRIDE: int,
    BLOCK_SIZE: int | None = None,
    **launch: object,
) -> None:
    """Each mask row bans the tokens whose bit is 0 at (request, position), where that
    position is among the request's logits this step."""
    masks, vocab, rows = logits_indices_ptr.shape[0], int(vocab_size), logits_ptr.shape[0]
    if masks == 0:
        return
    device = logits_ptr.device
    mapping = logits_indices_ptr.long()
    req, position = mapping // int(MASK_STRIDE), mapping % int(MASK_STRIDE)
    start = cu_num_logits_ptr.long()[req]
    active = position < cu_num_logits_ptr.long()[req + 1] - start
    banned = ~_unpack_bits(bitmask_ptr[:masks], vocab) & active[:, None]
    hits = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
    hits.index_add_(0, (start + position).clamp(0, rows - 1), banned.to(torch.int32))
    logits_ptr[:, :vocab].masked_fill_(hits > 0, _NEG_INF)


# -- thinking_budget.py -----------------------------------------------------------------
def _marker_hits(
    tokens: torch.Tensor, marker: torch.Tensor, length: int, limit: torch.Tensor
) -> torch.Tensor:
    """[rows, width]: ``marker`` (``length`` ids) starts at column p and ends by ``limit``."""
    width = tokens.shape[1]
    padded = torch.nn.functional.pad(tokens, (0, length), value=-1)
    hit = torch.arange(width, device=tokens.device)[None, :] + length <= limit[:, None]
    for j in range(length):
        hit = hit & (padded[:, j : j + width] == marker[j])
    return hit


def _last(hit: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """The last column with a hit in each row, else ``fallback``."""
    column = torch.arange(hit.shape[1], device=hit.device)[None, :]
    return torch.where(hit.any(dim=1), torch.where(hit, column, -1).max(dim=1).values, fallback)


def update_committed_marker_cache(
    req_ids_ptr: torch.Tensor,
    thinking_token_budget_ptr: torch.Tensor,
    all_token_ids_ptr: torch.Tensor,
    all_token_ids_stride: int,
    total_len_ptr: torch.Tensor,
    cached_last_start_ptr: torch.Tensor,
    cached_last_end_ptr: torch.Tensor,
    cached_scan_pos_ptr: torch.Tensor,
    reasoning_start_token_ids_ptr: torch.Tensor,
    natural_reasoning_end_token_ids_ptr: torch.Tensor,
    START_LEN: int,
    NATURAL_END_LEN: int,
    MAX_LEN: int,
    BLOCK: int,
    **launch: object,
) -> None:
    """The last reasoning start and natural end markers in each budgeted request's
    committed tokens: a first scan takes the nearest block (of ``BLOCK`` tokens, counted
    back from the end) holding any marker; later ones extend the cached markers over the
    tokens added since."""
    req = req_ids_ptr.long()
    if req.shape[0] == 0:
        return
    total = total_len_ptr[req].long()
    scan = cached_scan_pos_ptr[req].long()
    last_start = cached_last_start_ptr[req].long()
    last_end = cached_last_end_ptr[req].long()
    reset = scan > total
    scan = torch.where(reset, 0, scan)
    last_start = torch.where(reset, -1, last_start)
    last_end = torch.where(reset, -1, last_end)
    cold = (scan == 0) & (last_start < 0) & (last_end < 0)

    tokens = all_token_ids_ptr[req]
    start_hit = _marker_hits(tokens, reasoning_start_token_ids_ptr, int(START_LEN), total)
    end_hit = _marker_hits(tokens, natural_reasoning_end_token_ids_ptr, int(NATURAL_END_LEN), total)
    column = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    since = column >= scan[:, None]
    warm_start = _last(start_hit & since, last_start)
    warm_end = _last(end_hit & since, last_end)
    block = (total[:, None] - 1 - column) // int(BLOCK)
    nearest = torch.where(start_hit | end_hit, block, torch.iinfo(torch.int64).max).min(dim=1).values
    in_nearest = block == nearest[:, None]
    cold_start = _last(start_hit & in_nearest, torch.full_like(total, -1))
    cold_end = _last(end_hit & in_nearest, torch.full_like(total, -1))

    active = thinking_token_budget_ptr[req] >= 0
    updates = (
        (cached_last_start_ptr, torch.where(cold, cold_start, warm_start)),
        (cached_last_end_ptr, torch.where(cold, cold_end, warm_end)),
        (cached_scan_pos_ptr, (total - (int(MAX_LEN) - 1)).clamp(min=0)),
    )
    for cache, value in updates:
        cache[req] = torch.where(active, value.to(cache.dtype), cache[req])


def apply_thinking_budget(
    logits_ptr: torch.Tensor,
    logits_stride: int,
    expanded_idx_mapping_ptr: torch.Tensor,
    thinking_token_budget_ptr: torch.Tensor,
    all_token_ids_ptr: torch.Tensor,
    all_token_ids_stride: int,
    total_len_ptr: torch.Tensor,
    input_ids_ptr: torch.Tensor,
    expanded_local_pos_ptr: torch.Tensor,
    cached_last_start_ptr: torch.Tensor,
    cached_last_end_ptr: torch.Tensor,
    reasoning_start_token_ids_ptr: torch.Tensor,
    natural_reasoning_end_token_ids_ptr: torch.Tensor,
    reasoning_end_token_ids_ptr: torch.Tensor,
    START_LEN: int,
    NATURAL_END_LEN: int,
    END_LEN: int,
    **launch: object,
) -> torch.Tensor:
    """Once a request has reasoned for its budget (counting the draft tokens before each
    row), force the next token of the reasoning end sequence."""
    rows = logits_ptr.shape[0]
    if rows == 0:
        return
    start_len, natural_len, end_len = int(START_LEN), int(NATURAL_END_LEN), int(END_LEN)
    device = logits_ptr.device
    req = expanded_idx_mapping_ptr[:rows].long()
    local = expanded_local_pos_ptr[:rows].long()
    total = total_len_ptr[req].long()
    effective = total + local
    # each row's effective tokens at positions total - back .. total + rows - 1: committed
    # tokens, then the drafts before it (input ids after the row's first, already committed one)
    back = max(start_len, natural_len, end_len)
    offset = torch.arange(-back, rows, device=device)[None, :]
    position = total[:, None] + offset
    committed = all_token_ids_ptr[req[:, None], position.clamp(0, all_token_ids_ptr.shape[1] - 1)]
    first = torch.arange(rows, device=device) - local
    drafted = input_ids_ptr[(first[:, None] + offset + 1).clamp(0, input_ids_ptr.shape[0] - 1)]
    tokens = torch.where(position < total[:, None], committed.to(torch.int64), drafted.to(torch.int64))

    def last_marker(marker, length, cached):
        # markers may start from max(0, total - length + 1) and must end by the row
        hits = _marker_hits(tokens, marker, length, effective - total + back)
        lowest = (total - length + 1).clamp(min=0) - total + back
        hits = hits & (offset + back >= lowest[:, None])
        found = _last(hits, torch.full_like(total, -1))
        return torch.where(found >= 0, found - back + total, cached)

    last_start = last_marker(reasoning_start_token_ids_ptr, start_len, cached_last_start_ptr[req].long())
    last_end = last_marker(natural_reasoning_end_token_ids_ptr, natural_len, cached_last_end_ptr[req].long())
    budget = thinking_token_budget_ptr[req].long()
    reasoned = effective - (last_start + start_len)
    force = (budget >= 0) & (last_start >= 0) & (last_start > last_end) & (reasoned >= budget)

    # the end sequence may already be under way: continue after its longest begun prefix
    begun = torch.zeros_like(total)
    for prefix in range(1, end_len):
        match = prefix <= effective
        for j in range(prefix):
            column = local - prefix + j + back  # position effective - prefix + j
            match = match & (
                tokens.gather(1, column[:, None].clamp(min=0))[:, 0] == reasoning_end_token_ids_ptr[j]
            )
        begun = torch.where(match, prefix, begun)
    token = reasoning_end_token_ids_ptr.long()[begun]
    lanes = torch.arange(rows, device=device)
    old = logits_ptr[lanes, token]
    logits_ptr[lanes, token] = torch.where(force, torch.full_like(old, 1.0e9), old)
