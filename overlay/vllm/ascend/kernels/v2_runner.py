"""Torch forms of the Triton kernels Model Runner V2 launches on a plain step.

Model Runner V2 (``vllm/v1/worker/gpu``) prepares inputs, applies its staged state
writes and samples with Triton kernels that have no torch fallback upstream. Each
function here has the signature of one of those kernels and fills the same outputs, so
vLLM's Triton kernel-override registry can route ``kernel[grid](...)`` to it (the grid
is not passed: every size comes from the tensors). The pointer-table kernels of the
block tables are not here: ``vllm.ascend.worker.block_tables`` replaces the class that
launches them.

Written with torch tensor ops and no reads back to the host (no ``.item()``, no
boolean-mask indexing), so on an NPU they run as device ops (checked by the torch_npu
contract double; not run on an NPU here) and in host emulation alike. Masked scatters
into integer state tensors add ``new - old`` with ``index_put_(accumulate=True)``,
which makes masked-out rows harmless without knowing how many rows are real.
``tests/unit/kernels/test_v2_runner_kernels.py`` compares each one with upstream's
Triton kernel run by Triton's interpreter.
"""

from __future__ import annotations

import torch

from vllm.ascend.context_parallel.placement import local_count
from vllm.ascend.kernels import request_of_token

_V2 = "vllm.v1.worker.gpu."
_MASK32 = 0xFFFFFFFF
# gumbel.py: the draft's noise stream is offset by 2**30 positions
_DRAFT_NOISE_SALT = 1 << 30


# -- helpers --------------------------------------------------------------------------
def _masked_set(target: torch.Tensor, index: tuple[torch.Tensor, ...], values, mask) -> None:
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
    seq_lens_ptr[num_reqs:max_num_reqs] = 0
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
        _masked_set(input_ids_ptr, (last_slot,), last_sampled_tokens_ptr.view(-1)[req], write_last)

    steps = draft_tokens_ptr.shape[-1] if draft_tokens_ptr is not None and draft_tokens_ptr.dim() > 1 else 0
    if steps == 0:
        return
    num_draft = num_logits - NUM_NEW_SAMPLED_TOKENS
    k = torch.arange(steps, device=cu.device)
    wanted = generating[:, None] & (k[None, :] < num_draft[:, None])
    slot = (query_end - num_draft)[:, None] + k[None, :]
    slot = slot.clamp(0, input_ids_ptr.shape[0] - 1)
    _masked_set(input_ids_ptr, (slot,), draft_tokens_ptr[req][:, :steps], wanted)


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
    _masked_set(next_prefill_tokens_ptr, (lines, columns), ahead, prefilling[None, :].expand_as(pos))


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
        _masked_set(
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
    _masked_set(last_sampled_tokens_ptr.view(-1), (req,), last, has_sample)
    _masked_set(total_len_ptr, (req,), total_len + num_sampled, has_sample)

    reqs = req[:, None].expand(-1, width)
    _masked_set(all_token_ids_ptr, (reqs, cols), sampled, new)
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


def dcp_local_seq_lens(
    out_ptr: torch.Tensor,
    seq_lens_ptr: torch.Tensor,
    dcp_size: int,
    dcp_rank: int,
    cp_interleave: int,
    num_reqs: int,
    max_num_reqs: int,
    BLOCK_SIZE: int | None = None,
    **launch: object,
) -> None:
    """Tokens of each request this DCP rank holds (the placement's count); 0 past
    ``num_reqs``."""
    seq = seq_lens_ptr[:num_reqs].to(out_ptr.dtype)
    out_ptr[:num_reqs] = local_count(seq, dcp_rank, dcp_size, cp_interleave)
    out_ptr[num_reqs:max_num_reqs] = 0


# -- M-RoPE positions (mm/rope.py) ----------------------------------------------------
def prepare_rope_positions(
    positions_ptr: torch.Tensor,
    positions_stride: int,
    prefill_positions_ptr: torch.Tensor,
    prefill_positions_stride0: int,
    prefill_positions_stride1: int,
    prefill_delta_ptr: torch.Tensor,
    idx_mapping_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    prefill_lens_ptr: torch.Tensor,
    num_computed_tokens_ptr: torch.Tensor,
    BLOCK_SIZE: int,
    NUM_DIMS: int,
    **launch: object,
) -> None:
    """Each scheduled token's position per M-RoPE channel: the model's precomputed
    prefill positions while the request is in its prompt, then the plain position plus
    the request's delta. Rows past the batch keep their values."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    qsl = query_start_loc_ptr[: num_reqs + 1].to(torch.int64)
    width = positions_ptr.shape[1]
    rows, offset, inside = request_of_token(qsl[1:], width)
    req = idx_mapping_ptr.to(torch.int64)[rows]
    computed = num_computed_tokens_ptr[req].to(torch.int64)
    position = computed + offset
    in_prompt = computed < prefill_lens_ptr[req].to(torch.int64)
    decoded = position + prefill_delta_ptr[req].to(torch.int64)
    # (the request's table row; positions out of it belong to tokens that are not used)
    column = position.clamp(max=int(prefill_positions_stride1) - 1)
    table = prefill_positions_ptr.reshape(-1)
    for dim in range(int(NUM_DIMS)):
        flat = req * int(prefill_positions_stride0) + dim * int(prefill_positions_stride1) + column
        value = torch.where(in_prompt, table[flat].to(torch.int64), decoded)
        row = positions_ptr[dim]
        row.copy_(torch.where(inside, value.to(row.dtype), row))


# -- staged state writes (buffer_utils.py) --------------------------------------------
def apply_write(
    output_ptr: torch.Tensor,
    output_stride: int,
    write_indices_ptr: torch.Tensor,
    write_starts_ptr: torch.Tensor,
    write_contents_ptr: torch.Tensor,
    write_cu_lens_ptr: torch.Tensor,
    write_group_ids_ptr: torch.Tensor,
    BLOCK_SIZE: int | None = None,
    MULTI_GROUP: bool = False,
    **launch: object,
) -> None:
    if MULTI_GROUP:
        # tables of data pointers: vllm.ascend.worker.block_tables applies each group alone
        raise NotImplementedError("the multi-group staged write reads raw pointers; apply each group alone")
    num_writes = write_indices_ptr.shape[0]
    size = write_contents_ptr.shape[0]
    if num_writes == 0 or size == 0:
        return
    writes, offset, _ = request_of_token(write_cu_lens_ptr[:num_writes], size)
    col = write_starts_ptr[writes].to(torch.int64) + offset
    flat = write_indices_ptr[writes].to(torch.int64) * int(output_stride) + col
    output_ptr.view(-1).index_put_((flat,), write_contents_ptr.to(output_ptr.dtype))


# -- sampling (sample/gumbel.py) ------------------------------------------------------
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
    return ((value << shift) | (value >> (32 - shift))) & _MASK32


def _mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    # int64 products wrap modulo 2**64; their low 32 bits are the uint32 product's
    key = (key * 0xCC9E2D51) & _MASK32
    key = _rotl32(key, 15)
    key = (key * 0x1B873593) & _MASK32
    h = _rotl32(h ^ key, 13)
    return (h * 5 + 0xE6546B64) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def murmur3_hash32(
    seed: torch.Tensor, pos: torch.Tensor, offset: torch.Tensor, domain: int = 0
) -> torch.Tensor:
    """Upstream's counter-based noise hash (MurmurHash3's mixing over seed, position and
    token id), as uint32 values held in int64."""
    h = torch.full_like(seed, domain & _MASK32)
    h = _mix(h, seed & _MASK32)
    h = _mix(h, (seed >> 32) & _MASK32)
    h = _mix(h, pos & _MASK32)
    h = _mix(h, offset & _MASK32)
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


def scatter_num_accepted(
    idx_mapping_ptr: torch.Tensor,
    num_sampled_ptr: torch.Tensor,
    num_accepted_ptr: torch.Tensor,
    **launch: object,
) -> None:
    """A hybrid model's tokens accepted per request (at least 1), by its state row; rows
    mapped to -1 are skipped."""
    rows = idx_mapping_ptr.to(torch.int64)
    value = num_sampled_ptr[: rows.shape[0]].clamp(min=1)
    _masked_set(num_accepted_ptr, (rows.clamp(min=0),), value, rows >= 0)


def fill_num_accepted(
    idx_mapping_ptr: torch.Tensor, num_accepted_ptr: torch.Tensor, num_sampled: int, **launch: object
) -> None:
    rows = idx_mapping_ptr.to(torch.int64)
    _masked_set(num_accepted_ptr, (rows.clamp(min=0),), torch.full_like(rows, num_sampled), rows >= 0)


KERNELS = {
    _V2 + "input_batch._prepare_pos_seq_lens_kernel": prepare_pos_seq_lens,
    _V2 + "input_batch._combine_sampled_and_draft_tokens_kernel": combine_sampled_and_draft_tokens,
    _V2 + "input_batch._prepare_prefill_inputs_kernel": prepare_prefill_inputs,
    _V2 + "input_batch._get_num_sampled_and_rejected_kernel": get_num_sampled_and_rejected,
    _V2 + "input_batch._post_update_kernel": post_update,
    _V2 + "input_batch._post_update_num_computed_tokens_kernel": post_update_num_computed_tokens,
    _V2 + "input_batch._expand_idx_mapping_kernel": expand_idx_mapping,
    _V2 + "buffer_utils._apply_write_kernel": apply_write,
    _V2 + "cp_utils._dcp_local_seq_lens_kernel": dcp_local_seq_lens,
    _V2 + "mm.rope._prepare_rope_positions_kernel": prepare_rope_positions,
    _V2 + "sample.gumbel._temperature_kernel": apply_temperature,
    _V2 + "sample.gumbel._gumbel_sample_kernel": gumbel_sample,
    _V2 + "sample.gumbel._gumbel_combine_kernel": gumbel_combine,
    _V2 + "model_states.mamba_hybrid._scatter_num_accepted_kernel": scatter_num_accepted,
    _V2 + "model_states.mamba_hybrid._fill_num_accepted_kernel": fill_num_accepted,
}


def register_v2_runner_overrides() -> None:
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels(KERNELS)
