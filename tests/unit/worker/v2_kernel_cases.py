"""Random cases for Model Runner V2's kernels, run two ways: through upstream's Triton
kernels under Triton's interpreter (the oracle: upstream's code unchanged, in a process
of its own, ``python -m tests.unit.worker.v2_kernel_cases OUT``) and through the
Ascend torch forms (``vllm.ascend.worker.v2``, the block tables of
``vllm.ascend.worker.block_tables``) in the test process. Each case calls upstream's own
launcher (or drives a block-tables object) and returns every tensor it touched."""

from __future__ import annotations

import contextlib
import os
import sys
from types import SimpleNamespace

if __name__ == "__main__":
    # The interpreter runs upstream's kernels on host tensors. vLLM takes Triton as
    # usable with no active driver only in a "distributed environment", which an empty
    # CUDA_VISIBLE_DEVICES declares; Triton must be imported before vLLM's bootstrap.
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["VLLM_ASCEND_EMULATE"] = "1"
    import triton  # noqa: F401

import torch

SEEDS = range(4)
MAX_REQS = 8
VOCAB = 300  # spans blocks of the sampler's 1024-wide tiles only partly: one tile
MODEL_LEN = 64


def _batch(g: torch.Generator):
    """A batch of 1..MAX_REQS requests in random request slots with ragged query lengths."""
    n = int(torch.randint(1, MAX_REQS + 1, (1,), generator=g))
    idx = torch.randperm(MAX_REQS, generator=g)[:n].to(torch.int32)
    qlen = torch.randint(1, 6, (n,), generator=g, dtype=torch.int32)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = qlen.cumsum(0)
    return n, idx, qsl


def _ints(g, high, shape, dtype=torch.int32, low=0):
    return torch.randint(low, high, shape, generator=g, dtype=dtype)


def case_prepare_pos_seq_lens(g, side, guard):
    from vllm.v1.worker.gpu.input_batch import prepare_pos_seq_lens

    n, idx, qsl = _batch(g)
    computed = _ints(g, 30, (MAX_REQS,))
    pos = _ints(g, 99, (40,), torch.int64)
    seq_lens = _ints(g, 99, (MAX_REQS,))
    with guard():
        prepare_pos_seq_lens(idx, qsl, computed, pos, seq_lens)
    return [pos, seq_lens]


def case_combine_sampled_and_draft_tokens(g, side, guard):
    from vllm.v1.worker.gpu.input_batch import combine_sampled_and_draft_tokens

    steps = int(torch.randint(0, 3, (1,), generator=g))
    new = 0 if steps and bool(torch.randint(0, 2, (1,), generator=g)) else 1
    n, idx, _ = _batch(g)
    num_logits = _ints(g, steps + new + 1, (n,), low=1)
    extra = _ints(g, 3, (n,))
    qlen = num_logits + extra
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = qlen.cumsum(0)
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = num_logits.cumsum(0)
    prefill_len = _ints(g, 20, (MAX_REQS,), low=1)
    seq_lens = prefill_len[idx.long()] + _ints(g, 9, (n,), low=-4)
    input_ids = _ints(g, VOCAB, (int(qsl[-1]) + 3,))
    last = _ints(g, VOCAB, (MAX_REQS, 1), torch.int64)
    drafts = _ints(g, VOCAB, (MAX_REQS, steps), torch.int64)
    total = int(cu[-1])
    with guard():
        indices = combine_sampled_and_draft_tokens(
            input_ids, idx, last, qsl, seq_lens, prefill_len, drafts, cu, total, num_new_sampled_tokens=new
        )
    return [input_ids, indices]


def case_prepare_prefill_inputs(g, side, guard):
    from vllm.v1.worker.gpu.input_batch import prepare_prefill_inputs

    n, idx, qsl = _batch(g)
    lookahead = int(torch.randint(1, 3, (1,), generator=g))  # the runner keeps at least one
    all_ids = _ints(g, VOCAB, (MAX_REQS, MODEL_LEN))
    prefill_len = _ints(g, 40, (MAX_REQS,), low=6)
    computed = _ints(g, 40, (MAX_REQS,))
    input_ids = _ints(g, VOCAB, (int(qsl[-1]) + 4,))
    nxt = _ints(g, VOCAB, (lookahead, MAX_REQS))
    with guard():
        prepare_prefill_inputs(input_ids, nxt, idx, qsl, all_ids, prefill_len, computed)
    return [input_ids, nxt]


def case_get_num_sampled_and_rejected(g, side, guard):
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected

    n, idx, cu = _batch(g)
    prefill_len = _ints(g, 20, (MAX_REQS,), low=1)
    seq_lens = prefill_len[idx.long()] + _ints(g, 5, (n,), low=-3)
    sampled = _ints(g, 4, (n,), low=0)
    with guard():
        a, b = get_num_sampled_and_rejected(sampled, seq_lens, cu, idx, prefill_len)
    return [a, b]


def case_post_update(g, side, guard):
    from vllm.v1.worker.gpu.input_batch import post_update

    n, idx, qsl = _batch(g)
    idx = torch.where(torch.rand(n, generator=g) < 0.2, torch.full_like(idx, -1), idx)  # rows to skip
    width = int(torch.randint(1, 4, (1,), generator=g))
    computed = _ints(g, 30, (MAX_REQS,))
    last = _ints(g, VOCAB, (MAX_REQS, 1), torch.int64)
    counts = _ints(g, 3, (MAX_REQS, VOCAB)) if bool(torch.randint(0, 2, (1,), generator=g)) else None
    sampled = _ints(g, VOCAB, (n, width), torch.int64)
    num_sampled = _ints(g, width + 1, (n,))
    num_rejected = _ints(g, 3, (n,))
    all_ids = _ints(g, VOCAB, (MAX_REQS, MODEL_LEN))
    total = _ints(g, MODEL_LEN - width, (MAX_REQS,))
    steps = width - 1
    drafts = _ints(g, VOCAB, (n, steps), torch.int64) if steps else None
    drafts_out = _ints(g, VOCAB, (MAX_REQS, steps), torch.int64) if steps else None
    use_qsl = bool(torch.randint(0, 2, (1,), generator=g))
    with guard():
        post_update(
            idx,
            computed,
            last,
            counts,
            sampled,
            num_sampled,
            num_rejected,
            qsl if use_qsl else None,
            all_ids,
            total,
            drafts,
            drafts_out,
        )
    return [computed, last, counts, all_ids, total, drafts_out]


def case_post_update_num_computed_tokens(g, side, guard):
    from vllm.v1.worker.gpu.input_batch import post_update_num_computed_tokens

    n, idx, qsl = _batch(g)
    computed = _ints(g, 30, (MAX_REQS,))
    with guard():
        post_update_num_computed_tokens(idx, computed, qsl)
    return [computed]


def case_mamba_num_accepted(g, side, guard):
    """A hybrid model's accepted-token counts per request slot (its state layers read
    them): scattered from the sampled counts (at least 1), then filled with one count;
    rows mapped to -1 are skipped."""
    from vllm.v1.worker.gpu.model_states import mamba_hybrid

    n, idx, _ = _batch(g)
    idx = torch.where(torch.rand(n, generator=g) < 0.25, -1, idx)
    sampled = _ints(g, 4, (n,))
    scattered = _ints(g, 9, (MAX_REQS,), low=5)
    filled = scattered.clone()
    with guard():
        mamba_hybrid._scatter_num_accepted_kernel[(n,)](idx, sampled, scattered)
        mamba_hybrid._fill_num_accepted_kernel[(n,)](idx, filled, 3)
    return [scattered, filled]


def case_expand_idx_mapping(g, side, guard):
    from vllm.v1.worker.gpu.input_batch import expand_idx_mapping

    n, idx, cu = _batch(g)
    total, longest = int(cu[-1]), int((cu[1:] - cu[:-1]).max())
    with guard():
        expanded, local = expand_idx_mapping(idx, total, cu, longest)
    return [expanded, local]


def case_dcp_local_seq_lens(g, side, guard):
    from vllm.v1.worker.gpu.cp_utils import prepare_dcp_local_seq_lens

    n = int(torch.randint(1, MAX_REQS + 1, (1,), generator=g))
    size = int(torch.randint(2, 5, (1,), generator=g))
    seq_lens = _ints(g, 300, (MAX_REQS,))
    out = torch.full((MAX_REQS,), -7, dtype=torch.int32)
    results = []
    for interleave in (1, 2, 8):
        for rank in range(size):
            with guard():
                results.append(prepare_dcp_local_seq_lens(out, seq_lens, n, size, rank, interleave).clone())
    return results


def case_rope_positions(g, side, guard):
    from vllm.v1.worker.gpu.mm.rope import RopeState

    dims = int(torch.randint(3, 5, (1,), generator=g))  # M-RoPE's 3 channels, or 4
    n, idx, qsl = _batch(g)
    state = RopeState(dims, MAX_REQS, max_num_tokens=40, max_model_len=MODEL_LEN, device=torch.device("cpu"))
    state.prefill_positions.gpu.copy_(_ints(g, 500, (MAX_REQS * dims, MODEL_LEN)))
    state.prefill_delta.gpu.copy_(_ints(g, 40, (MAX_REQS,), low=-40))
    state.positions.copy_(_ints(g, 99, state.positions.shape, torch.int64))
    prefill_lens = _ints(g, 50, (MAX_REQS,), low=1)
    # requests in their prompt, at its end and decoding; chunks stay inside the table
    computed = torch.minimum(_ints(g, 59, (MAX_REQS,)), prefill_lens + _ints(g, 3, (MAX_REQS,), low=-2))
    with guard():
        state.prepare_positions(idx.long(), qsl, prefill_lens, computed)
    return [state.positions]


def case_staged_write(g, side, guard):
    from vllm.v1.worker.gpu.buffer_utils import StagedWriteTensor

    dtype = [torch.int32, torch.int64, torch.float32][int(torch.randint(0, 3, (1,), generator=g))]
    table = StagedWriteTensor((MAX_REQS, 20), dtype=dtype, device=torch.device("cpu"))
    table.gpu.copy_(_ints(g, 50, (MAX_REQS, 20)).to(dtype))
    rows = torch.randperm(MAX_REQS, generator=g).tolist()
    for row in rows[:5]:
        start = int(torch.randint(0, 10, (1,), generator=g))
        values = _ints(g, 1000, (int(torch.randint(1, 10, (1,), generator=g)),)).tolist()
        table.stage_write(row, start, values)
    table.stage_write_elem(rows[5], 7)
    table.apply_write()
    return [table.gpu]


def case_temperature(g, side, guard):
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature

    n, idx, cu = _batch(g)
    tokens = int(cu[-1])
    expanded = idx.repeat_interleave((cu[1:] - cu[:-1]).long())
    temp = torch.rand(MAX_REQS, generator=g) * 2
    temp[torch.randperm(MAX_REQS, generator=g)[:3]] = torch.tensor([0.0, 1.0, 0.5])
    logits = torch.randn(tokens, VOCAB, generator=g)
    with guard():
        apply_temperature(logits, expanded, temp)
    return [logits]


def _row_mapping(g, rows: int) -> torch.Tensor:
    """A batch-sharded draft logits cache's row mapping: ``rows`` request slots hold one
    row each, the others -1 (cached by another rank)."""
    mapping = torch.full((MAX_REQS,), -1, dtype=torch.int32)
    mapping[torch.randperm(MAX_REQS, generator=g)[:rows]] = torch.randperm(rows, generator=g).to(torch.int32)
    return mapping


def case_gumbel_sample(g, side, guard):
    """Upstream's Gumbel sampler (the per-block kernel, then the combine kernel) four
    ways: plain with a bias added, a drafter caching its logits in a replicated cache,
    in a row-mapped (batch-sharded) cache with a bias, and from a separate cache source;
    float32 or float16 logits over one or three 1024-wide blocks, padded tokens."""
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    out = []
    for mode in ("bias", "cache", "mapped", "source"):
        n, idx, cu = _batch(g)
        if bool(torch.randint(0, 2, (1,), generator=g)):  # decode: one token per request
            cu = torch.arange(n + 1, dtype=torch.int32)
        per = (cu[1:] - cu[:-1]).long()
        tokens = int(cu[-1])
        expanded = idx.repeat_interleave(per)
        expanded[torch.rand(tokens, generator=g) < 0.15] = -1  # padded tokens
        vocab = [VOCAB, 2500][int(torch.randint(0, 2, (1,), generator=g))]
        # (a half dtype checks that the biased sum is rounded to it; float16, as Triton's
        # interpreter truncates float32 to bfloat16 where GPUs and torch round to nearest)
        dtype = [torch.float32, torch.float16][int(torch.randint(0, 2, (1,), generator=g))]
        temp = torch.rand(MAX_REQS, generator=g) + 0.3
        temp[torch.randperm(MAX_REQS, generator=g)[:2]] = 0.0  # greedy requests
        seeds = torch.randint(-(2**62), 2**62, (MAX_REQS,), generator=g, dtype=torch.int64)
        pos = _ints(g, 1000, (tokens,), torch.int64)
        logits = (torch.randn(tokens, vocab, generator=g) * 3).to(dtype)
        flags = torch.randint(0, 2, (2,), generator=g).tolist()
        bias = cache = col = source = mapping = None
        if mode in ("bias", "mapped"):  # (dspark's bias): the biased sum is what is sampled
            bias = (torch.randn(tokens, vocab, generator=g) * 2).to(dtype)
            if dtype == torch.float16:
                # two top logits whose biased sums tie once rounded to float16 (the first
                # wins a greedy row), though the later one's is larger in float32
                lo, hi = (int(x) for x in torch.randperm(vocab, generator=g)[:2].sort().values)
                logits[:, lo] = logits[:, hi] = 1000.0
                bias[:, lo], bias[:, hi] = 0.1, 0.2
        if mode != "bias":  # a drafter keeping its logits for the rejection sampler
            rows = MAX_REQS
            if mode == "mapped":  # this rank caches some requests, in rows of its own
                rows = 3
                mapping = _row_mapping(g, rows)
            cache = torch.full((rows, 5, vocab), -7.0, dtype=dtype)
            if bool((per == 1).all()):  # one token per request: one column for the step
                col = torch.tensor(int(torch.randint(0, 5, (1,), generator=g)))
            else:  # each token its own column (its position in its request)
                col = torch.cat([torch.arange(int(k)) for k in per])
            if mode == "source":
                source = torch.randn(tokens, vocab, generator=g).to(dtype)
        with guard():
            sampled = gumbel_sample(
                logits,
                expanded,
                temp,
                seeds,
                pos,
                apply_temperature=True,
                is_drafting=bool(flags[0]),
                logits_cache=cache,
                logits_cache_col=col,
                use_fp64=bool(flags[1]),
                logits_cache_source=source,
                logits_cache_row_mapping=mapping,
                bias=bias,
            )
        out += [sampled, cache]
    return out


def case_gumbel_combine(g, side, guard):
    """The combine kernel alone, over block maxima with ties, -inf rows and NaNs (the
    first NaN block wins, else the first block holding the maximum)."""
    from vllm.triton_utils import triton
    from vllm.v1.worker.gpu.sample import gumbel

    rows, blocks = int(torch.randint(1, 12, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
    values = _ints(g, 4, (rows, blocks)).to(torch.float32)  # few values: ties
    values[torch.rand(rows, blocks, generator=g) < 0.2] = float("-inf")
    values[0] = float("-inf")
    values[torch.rand(rows, blocks, generator=g) < 0.1] = float("nan")
    if bool(torch.randint(0, 2, (1,), generator=g)):
        values = values.to(torch.float64)
    argmax = _ints(g, 100000, (rows, blocks), torch.int64)
    sampled = torch.full((rows,), -5, dtype=torch.int64)
    with guard():
        gumbel._gumbel_combine_kernel[(rows,)](
            argmax,
            argmax.stride(0),
            values,
            values.stride(0),
            sampled,
            blocks,
            PADDED_NUM_BLOCKS=triton.next_power_of_2(blocks),
        )
    return [sampled]


def _logit_rows(g):
    """A batch's logits rows: requests with 1-3 rows each (drafts), their request slots
    and each row's position inside its request."""
    n, idx, _ = _batch(g)
    per = _ints(g, 4, (n,), low=1)
    expanded = idx.repeat_interleave(per.long())
    local = torch.cat([torch.arange(int(k), dtype=torch.int32) for k in per])
    return expanded, local, torch.randn(expanded.shape[0], VOCAB, generator=g) * 3


def case_min_p(g, side, guard):
    from vllm.v1.worker.gpu.sample.min_p import apply_min_p

    expanded, _, logits = _logit_rows(g)
    min_p = torch.rand(MAX_REQS, generator=g) * 0.3
    min_p[torch.randperm(MAX_REQS, generator=g)[:3]] = 0.0
    with guard():
        apply_min_p(logits, expanded, min_p)
    return [logits]


def case_penalties(g, side, guard):
    from vllm.v1.worker.gpu.sample.penalties import apply_penalties

    expanded, local, logits = _logit_rows(g)
    tokens = _ints(g, VOCAB, (expanded.shape[0],))
    rep = 1.0 + torch.rand(MAX_REQS, generator=g)
    freq = torch.rand(MAX_REQS, generator=g) - 0.5
    pres = torch.rand(MAX_REQS, generator=g) - 0.5
    off = torch.randperm(MAX_REQS, generator=g)[:2]  # requests without penalties
    rep[off], freq[off], pres[off] = 1.0, 0.0, 0.0
    rep[torch.randperm(MAX_REQS, generator=g)[:2]] = 1.0  # frequency/presence only
    mask = torch.randint(-(2**31), 2**31 - 1, (MAX_REQS, (VOCAB + 31) // 32), generator=g, dtype=torch.int32)
    counts = _ints(g, 3, (MAX_REQS, VOCAB)) * (torch.rand(MAX_REQS, VOCAB, generator=g) < 0.05)
    with guard():
        apply_penalties(logits, expanded, tokens, local, rep, freq, pres, mask, counts)
    return [logits]


def case_bincount(g, side, guard):
    from vllm.v1.worker.gpu.sample.penalties import bincount

    n, idx, _ = _batch(g)
    all_ids = _ints(g, VOCAB, (MAX_REQS, MODEL_LEN))
    prompt_len = _ints(g, MODEL_LEN // 2, (MAX_REQS,), low=1)
    prefill_len = prompt_len + _ints(g, MODEL_LEN // 2, (MAX_REQS,))
    mask = _ints(g, 1000, (MAX_REQS, (VOCAB + 31) // 32))
    counts = _ints(g, 5, (MAX_REQS, VOCAB))
    longest = int(prefill_len[idx.long()].max())
    with guard():
        bincount(idx, all_ids, prompt_len, prefill_len, mask, counts, longest)
    return [mask, counts]


def _distinct(g, rows: int, width: int) -> torch.Tensor:
    return torch.stack([torch.randperm(VOCAB, generator=g)[:width] for _ in range(rows)]).to(torch.int32)


def case_logit_bias(g, side, guard):
    from vllm.v1.worker.gpu.sample.logit_bias import apply_logit_bias

    expanded, _, logits = _logit_rows(g)
    allowed, bias_ids, stops = _distinct(g, MAX_REQS, 6), _distinct(g, MAX_REQS, 5), _distinct(g, MAX_REQS, 4)
    n_allowed = _ints(g, 7, (MAX_REQS,)) * (torch.rand(MAX_REQS, generator=g) < 0.5)
    n_bias = _ints(g, 6, (MAX_REQS,))
    bias = torch.randn(MAX_REQS, 5, generator=g)
    n_stops = _ints(g, 5, (MAX_REQS,))
    # some requests may emit only stop tokens: their rows end all -inf unless restored
    only_stops = torch.rand(MAX_REQS, generator=g) < 0.3
    allowed[only_stops, :4] = stops[only_stops]
    n_allowed[only_stops] = n_stops[only_stops]
    pos = _ints(g, 8, (expanded.shape[0],), torch.int64)
    min_lens = _ints(g, 10, (MAX_REQS,))
    restore = _ints(g, 2, (MAX_REQS,))
    check = bool(torch.randint(0, 2, (1,), generator=g))
    with guard():
        apply_logit_bias(
            logits,
            expanded,
            pos,
            n_allowed,
            allowed,
            n_bias,
            bias_ids,
            bias,
            min_lens,
            n_stops,
            restore,
            stops,
            check_all_masked_rows=check,
        )
    return [logits]


def case_bad_words(g, side, guard):
    from vllm.v1.worker.gpu.sample.bad_words import apply_bad_words

    expanded, local, logits = _logit_rows(g)
    tokens = expanded.shape[0]
    words, width = 3, 8
    lengths = _ints(g, 4, (MAX_REQS, words), low=1)
    offsets = torch.zeros(MAX_REQS, words + 1, dtype=torch.int32)
    offsets[:, 1:] = lengths.cumsum(1)
    vocab = 6  # few distinct tokens, so prefixes do match
    ids = _ints(g, vocab, (MAX_REQS, width))
    all_ids = _ints(g, vocab, (MAX_REQS, MODEL_LEN))
    prompt_len = _ints(g, 10, (MAX_REQS,), low=1)
    total = prompt_len + _ints(g, 6, (MAX_REQS,))
    # each request's drafts follow its committed tokens in input_ids (row 0: last committed)
    input_ids = _ints(g, vocab, (tokens,))
    num_words = _ints(g, words + 1, (MAX_REQS,))
    with guard():
        apply_bad_words(
            logits, expanded, ids, offsets, num_words, all_ids, prompt_len, total, input_ids, local, words
        )
    return [logits]


def case_logprobs(g, side, guard):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.sample.logprob import LogprobTokenIdsState, compute_topk_scores

    expanded, _, logits = _logit_rows(g)
    sampled = _ints(g, VOCAB, (expanded.shape[0],), torch.int64)
    k = int(torch.randint(0, 4, (1,), generator=g))
    custom = bool(torch.randint(0, 2, (1,), generator=g))
    logits_mode = bool(torch.randint(0, 2, (1,), generator=g))
    state = None
    widest = 0
    if custom:
        state = LogprobTokenIdsState(MAX_REQS, torch.device("cpu"))
        for r in range(MAX_REQS):
            n = int(torch.randint(0, 4, (1,), generator=g))
            ids = torch.randperm(VOCAB, generator=g)[:n].tolist()
            state.add_request(r, SamplingParams(logprobs=k, logprob_token_ids=ids or None))
            widest = max(widest, n)
        state.apply_staged_writes()
        if widest == 0:
            state = None
    with guard():
        out = compute_topk_scores(
            logits,
            k,
            sampled,
            logprob_token_ids_state=state,
            expanded_idx_mapping=expanded,
            max_per_req_token_ids=widest if state is not None else 0,
            logits_mode=logits_mode,
        )
    return [out.logprob_token_ids, out.logprobs, out.selected_token_ranks]


def case_prompt_logprobs_token_ids(g, side, guard):
    from vllm.v1.worker.gpu.sample.prompt_logprob import get_prompt_logprobs_token_ids

    n, idx, qsl = _batch(g)
    computed = _ints(g, 30, (MAX_REQS,))
    all_ids = _ints(g, VOCAB, (MAX_REQS, MODEL_LEN))
    tokens = int(qsl[-1])
    with guard():
        out = get_prompt_logprobs_token_ids(tokens, qsl, idx, computed, all_ids)
    return [out]


def case_grammar_bitmask(g, side, guard):
    from vllm.v1.worker.gpu import structured_outputs

    n, idx, cu = _batch(g)
    logits = torch.randn(int(cu[-1]), VOCAB, generator=g)
    stride = 3  # bitmask rows per grammar request (positions)
    grammar = torch.randperm(n, generator=g)[: int(torch.randint(1, n + 1, (1,), generator=g))]
    mapping = torch.tensor([int(r) * stride + p for r in grammar for p in range(stride)], dtype=torch.int32)
    words = (VOCAB + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (mapping.shape[0], words), generator=g, dtype=torch.int32)
    grid = (mapping.shape[0], 1)
    with guard():
        structured_outputs._apply_grammar_bitmask_kernel[grid](
            logits,
            logits.stride(0),
            mapping,
            cu,
            bitmask,
            bitmask.stride(0),
            VOCAB,
            MASK_STRIDE=stride,
            BLOCK_SIZE=512,
        )
    return [logits]


def _block_tables(side, groups: int, **kwargs):
    if side == "oracle":
        from vllm.v1.worker.gpu.block_table import BlockTables as cls
    else:
        from vllm.ascend.worker.block_tables import NPUBlockTables as cls
    return cls(
        block_sizes=[16, 32][:groups],
        max_num_reqs=MAX_REQS,
        max_num_batched_tokens=64,
        max_num_blocks_per_group=[12, 6][:groups],
        device=torch.device("cpu"),
        **kwargs,
    )


def _fill_block_tables(g, tables, groups: int):
    for row in range(MAX_REQS):
        ids = tuple(
            _ints(g, 500, (int(torch.randint(1, 6, (1,), generator=g)),)).tolist() for _ in range(groups)
        )
        tables.append_block_ids(row, ids, overwrite=True)
    tables.apply_staged_writes()
    extra = tuple(_ints(g, 500, (1,)).tolist() for _ in range(groups))
    tables.append_block_ids(int(torch.randint(0, MAX_REQS, (1,), generator=g)), extra, overwrite=False)
    tables.apply_staged_writes()


def case_block_tables_gather(g, side, guard):
    groups = int(torch.randint(1, 3, (1,), generator=g))
    window = bool(torch.randint(0, 2, (1,), generator=g))
    tables = _block_tables(side, groups, sliding_window_reach=[20, 0][:groups] if window else None)
    _fill_block_tables(g, tables, groups)
    n, idx, _ = _batch(g)
    computed = _ints(g, 100, (MAX_REQS,))
    for buffer in tables.input_block_tables:  # what earlier, larger batches left
        buffer.copy_(_ints(g, 500, buffer.shape))
    with guard():
        first = [t.clone() for t in tables.gather_block_tables(idx, MAX_REQS)]  # dirty every row
        out = tables.gather_block_tables(
            idx, min(n + 1, MAX_REQS), num_computed_tokens=computed if window else None
        )
    return [*first, *out, *tables.input_block_tables, *(t.gpu for t in tables.block_tables)]


def case_block_tables_slots(g, side, guard):
    groups = int(torch.randint(1, 3, (1,), generator=g))
    cp = [1, 2, 4][int(torch.randint(0, 3, (1,), generator=g))]
    rank = int(torch.randint(0, cp, (1,), generator=g))
    interleave = [1, 4, 16][int(torch.randint(0, 3, (1,), generator=g))]
    sharded = [True, bool(torch.randint(0, 2, (1,), generator=g))][:groups]
    tables = _block_tables(
        side, groups, cp_size=cp, cp_rank=rank, cp_interleave=interleave, dcp_sharded=sharded
    )
    _fill_block_tables(g, tables, groups)
    n, idx, qsl = _batch(g)
    idx = torch.where(torch.rand(n, generator=g) < 0.2, torch.full_like(idx, -1), idx)  # dummy requests
    positions = _ints(g, 5 * 16 * cp, (64,), torch.int64)
    padded = int(qsl[-1]) + 2
    with guard():
        out = tables.compute_slot_mappings(idx, qsl, positions, padded)
    return [out, tables.slot_mappings]


# reasoning markers of the thinking-budget cases: start, natural end, forced end
THINK_START = torch.tensor([3, 4], dtype=torch.int32)
THINK_NATURAL_END = torch.tensor([5, 8], dtype=torch.int32)
THINK_END = torch.tensor([6, 7, 5], dtype=torch.int32)


def _thinking_budget(guard, logits, idx, expanded, budget, all_ids, total, input_ids, local, *cache):
    from vllm.v1.worker.gpu.sample.thinking_budget import apply_thinking_budget

    with guard():
        apply_thinking_budget(
            logits,
            idx,
            expanded,
            budget,
            all_ids,
            total,
            input_ids,
            local,
            *cache,
            THINK_START,
            THINK_NATURAL_END,
            THINK_END,
        )
    return [logits, *cache]


def case_thinking_budget(g, side, guard):
    """Upstream's thinking-budget step (marker cache update, then the forced end token)
    over a small vocabulary where the markers occur by chance: requests with and
    without a budget, first scans and cached ones (some stale), draft rows."""
    vocab = 10
    n, idx, cu, expanded, local = _spec_batch(g)
    rows = int(cu[-1])
    all_ids = _ints(g, vocab, (MAX_REQS, MODEL_LEN))
    total = _ints(g, MODEL_LEN - 8, (MAX_REQS,))
    budget = torch.where(torch.rand(MAX_REQS, generator=g) < 0.2, -1, _ints(g, 8, (MAX_REQS,)))
    input_ids = _ints(g, vocab, (rows + 2,))
    logits = torch.randn(rows, vocab, generator=g)
    cold = torch.rand(MAX_REQS, generator=g) < 0.5
    last_start = torch.where(cold, -1, _ints(g, MODEL_LEN, (MAX_REQS,), low=-1))
    last_end = torch.where(cold, -1, _ints(g, MODEL_LEN, (MAX_REQS,), low=-1))
    scan = torch.where(cold, 0, _ints(g, MODEL_LEN, (MAX_REQS,)))  # some past total: stale
    for r in range(MAX_REQS):  # most requests are reasoning; some have begun the end sequence
        t = int(total[r])
        if t >= 16 and bool(torch.rand(1, generator=g) < 0.7):
            k = int(torch.randint(2, 15, (1,), generator=g))
            all_ids[r, t - k : t - k + 2] = THINK_START
            tail = int(torch.randint(0, 3, (1,), generator=g))
            if tail and k > tail + 2:
                all_ids[r, t - tail : t] = THINK_END[:tail]
    return _thinking_budget(
        guard, logits, idx, expanded, budget, all_ids, total, input_ids, local, last_start, last_end, scan
    )


def case_thinking_budget_long(g, side, guard):
    """First scans over committed tokens spanning several of the scan's 1024-token blocks,
    each holding one start and one natural end marker somewhere (the scan keeps only the
    nearest block with a marker)."""
    length = 2600
    n, idx, cu, expanded, local = _spec_batch(g)
    rows = int(cu[-1])
    filler = torch.tensor([0, 1, 2, 9])  # no marker token
    all_ids = filler[torch.randint(0, 4, (MAX_REQS, length), generator=g)].to(torch.int32)
    total = _ints(g, length - 8, (MAX_REQS,), low=1100)
    for r in range(MAX_REQS):
        t = int(total[r])
        s_at, e_at = (int(x) for x in torch.randint(0, t - 2, (2,), generator=g))
        if r == 0:  # on either side of the nearest block's lower edge
            s_at, e_at = t - 1024, t - 1026
        all_ids[r, s_at : s_at + 2] = THINK_START
        all_ids[r, e_at : e_at + 2] = THINK_NATURAL_END
    budget = _ints(g, 3000, (MAX_REQS,))
    input_ids = filler[torch.randint(0, 4, (rows + 2,), generator=g)].to(torch.int32)
    logits = torch.randn(rows, 10, generator=g)
    last_start = torch.full((MAX_REQS,), -1, dtype=torch.int32)
    last_end = torch.full((MAX_REQS,), -1, dtype=torch.int32)
    scan = torch.zeros(MAX_REQS, dtype=torch.int32)
    return _thinking_budget(
        guard, logits, idx, expanded, budget, all_ids, total, input_ids, local, last_start, last_end, scan
    )


# -- speculative decoding (worker/v2/rejection_sampler_utils.py, speculator.py) ---------
SPEC_STEPS = 3
SPEC_VOCAB = 8300  # two of the statistics' 8192-wide blocks, nine of the resampler's 1024


def _spec_batch(g):
    """Requests with 0..SPEC_STEPS drafts each: (n, request slots, cu_num_logits,
    each row's request slot, each row's position inside its request)."""
    n, idx, _ = _batch(g)
    per = _ints(g, SPEC_STEPS + 2, (n,), low=1)
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = per.cumsum(0)
    expanded = idx.repeat_interleave(per.long())
    local = torch.cat([torch.arange(int(k), dtype=torch.int32) for k in per])
    return n, idx, cu, expanded, local


def case_gather_draft_sampled(g, side, guard):
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import gather_draft_sampled

    n, idx, cu, expanded, local = _spec_batch(g)
    rows = int(cu[-1])
    input_ids = _ints(g, VOCAB, (rows + 5,))
    positions = _ints(g, 40, (rows + 5,), torch.int64)
    logits_indices = torch.randperm(rows + 5, generator=g)[:rows].to(torch.int64)
    prefill_len = _ints(g, 40, (MAX_REQS,), low=1)
    with guard():
        draft, pos = gather_draft_sampled(input_ids, positions, logits_indices, expanded, local, prefill_len)
    return [draft, pos]


def case_flatten_sampled(g, side, guard):
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler

    n, _, cu, _, _ = _spec_batch(g)
    sampled = _ints(g, VOCAB, (n, SPEC_STEPS + 1), torch.int64)
    num_sampled = torch.minimum(_ints(g, SPEC_STEPS + 2, (n,), low=1), (cu[1:] - cu[:-1]))
    flat = torch.zeros(int(cu[-1]), dtype=torch.int64)
    with guard():
        rejection_sampler._flatten_sampled_kernel[(n,)](flat, sampled, sampled.stride(0), num_sampled, cu)
    return [flat]


def case_ngram_drafts(g, side, guard):
    """The n-gram drafter's two kernels, launched as its ``propose`` launches them, over
    histories of a 4-token vocabulary (many matches, of every length) of random lengths,
    requests that sampled nothing, and blocks of 16 or 64 positions."""
    from vllm.v1.worker.gpu.spec_decode.ngram import speculator

    n, idx, _ = _batch(g)
    history = _ints(g, 4, (MAX_REQS, MODEL_LEN + 3))  # rows wider than the model length
    total_len = _ints(g, MODEL_LEN + 1, (MAX_REQS,))
    num_sampled = _ints(g, 3, (n,))
    last_sampled = _ints(g, VOCAB, (MAX_REQS, 1), torch.int64)
    min_n = int(torch.randint(1, 4, (1,), generator=g))
    max_n = min_n + int(torch.randint(0, 3, (1,), generator=g))
    k = int(torch.randint(1, 5, (1,), generator=g))
    block = [16, 64][int(torch.randint(0, 2, (1,), generator=g))]
    blocks = -(-MODEL_LEN // block)
    scratch = _ints(g, 99, (MAX_REQS, blocks), torch.int64)
    drafts = _ints(g, 99, (MAX_REQS, k), torch.int64)
    args = (history, history.stride(0), idx.long(), total_len, num_sampled)
    with guard():
        speculator._ngram_scan_kernel[(n, blocks)](
            *args, scratch, scratch.stride(0), MODEL_LEN, min_n, max_n, 1 << (max_n - 1).bit_length(), block
        )
        speculator._ngram_finalize_kernel[(n,)](
            *args,
            last_sampled.view(-1),
            scratch,
            scratch.stride(0),
            drafts,
            MODEL_LEN,
            blocks,
            k,
            1 << (k - 1).bit_length(),
            1 << (blocks - 1).bit_length(),
        )
    return [scratch, drafts]


def case_standalone_prefill_inputs(g, side, guard):
    """The separate draft model's first-step inputs: ragged queries with 0..all of their
    drafts rejected, positions near the model length (capped), stale buffers."""
    from vllm.v1.worker.gpu.spec_decode.standalone_ar import speculator

    n, idx, qsl = _batch(g)
    tokens = int(qsl[-1])
    query_len = qsl[1:] - qsl[:-1]
    rejected = (torch.rand(n, generator=g) * query_len).to(torch.int32)
    target_ids = _ints(g, VOCAB, (tokens + 3,))
    target_pos = _ints(g, MODEL_LEN, (tokens + 3,), torch.int64)
    last_sampled = _ints(g, VOCAB, (MAX_REQS, 1), torch.int64)  # (the runner's shape)
    out_ids = _ints(g, 99, (tokens + MAX_REQS + 4,))
    out_pos = _ints(g, 99, (tokens + MAX_REQS + 4,), torch.int64)
    last_idx = _ints(g, 99, (MAX_REQS,), torch.int64)
    out_qsl = _ints(g, 99, (MAX_REQS + 1,))
    out_seq = _ints(g, 99, (MAX_REQS,))
    seq_lens = _ints(g, MODEL_LEN + 1, (n,), low=1)
    with guard():
        speculator._prepare_prefill_inputs_kernel[(n,)](
            target_ids, target_pos, last_sampled.int(), idx.long(), out_ids, out_pos, last_idx,
            out_qsl, out_seq, qsl, seq_lens, rejected, MAX_REQS, MODEL_LEN, BLOCK_SIZE=8,
        )  # fmt: skip
    return [out_ids, out_pos, last_idx, out_qsl, out_seq]


def _interpreter_log1p() -> None:
    """Triton's interpreter has no libdevice; upstream's resampler (draft-logits residual)
    calls ``tldevice.log1p``: the oracle gets numpy's, on the interpreter's own tensors."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils

    def log1p(x):
        return tl.tensor(TensorHandle(np.log1p(x.handle.data), x.handle.dtype), x.type)

    rejection_sampler_utils.tldevice = SimpleNamespace(log1p=log1p)


def _draft_logits_cache(g, mapped: bool):
    """A stand-in for upstream's DraftLogitsCache (``values``, ``row_mapping``): replicated
    (a row per request slot), or batch-sharded (3 rows; requests of other ranks at -1,
    read as row 0 as upstream reads them)."""
    rows = 3 if mapped else MAX_REQS
    values = torch.randn(rows, SPEC_STEPS, SPEC_VOCAB, generator=g) * 2
    mapping = _row_mapping(g, rows) if mapped else None
    return SimpleNamespace(values=values, row_mapping=mapping)


def case_rejection_sample(g, side, guard):
    """Upstream's whole standard rejection sampler (statistics, the accept/reject walk,
    resampling, insertion) over greedy and random requests and placeholder drafts, for
    each of: one-hot drafts or the draft's logits (a replicated or a row-mapped cache),
    real or synthetic acceptance, float32 or float64 noise; some targets with whole
    vocabulary blocks masked (top-k/top-p), resampled with or without skipping them."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

    if side == "oracle":
        _interpreter_log1p()
    out = []
    for flags in range(8):
        n, idx, cu, expanded, local = _spec_batch(g)
        rows = int(cu[-1])
        logits = torch.randn(rows, SPEC_VOCAB, generator=g) * 2
        draft_sampled = _ints(g, SPEC_VOCAB, (rows,), torch.int64)
        # most drafts are the target's argmax, so walks go past their first draft
        lucky = (torch.rand(rows, generator=g) < 0.7) & (local > 0)
        logits[lucky.nonzero()[:, 0] - 1, draft_sampled[lucky]] += 12.0
        draft_sampled[(torch.rand(rows, generator=g) < 0.1) & (local > 0)] = -1  # placeholders
        skip = bool(torch.randint(0, 2, (1,), generator=g))
        if bool(torch.randint(0, 2, (1,), generator=g)):  # top-k/top-p left a few blocks
            for r in range(rows):
                kept = torch.randperm(9, generator=g)[: int(torch.randint(1, 4, (1,), generator=g))]
                masked = torch.ones(9 * 1024, dtype=torch.bool)
                for b in kept.tolist():
                    masked[b * 1024 : (b + 1) * 1024] = False
                logits[r, masked[:SPEC_VOCAB]] = float("-inf")
        temp = torch.rand(MAX_REQS, generator=g) + 0.5
        temp[torch.randperm(MAX_REQS, generator=g)[:3]] = 0.0
        seeds = torch.randint(-(2**62), 2**62, (MAX_REQS,), generator=g, dtype=torch.int64)
        pos = _ints(g, 1000, (rows,), torch.int64)
        draft_logits = None
        if flags & 1:
            draft_logits = _draft_logits_cache(g, mapped=bool(torch.randint(0, 2, (1,), generator=g)))
        rates = torch.tensor([0.9, 0.6, 0.3]) if flags & 2 else None
        with guard():
            sampled, num_sampled = rejection_sample(
                logits,
                draft_logits,
                draft_sampled,
                cu,
                pos,
                idx,
                expanded,
                local,
                temp,
                seeds,
                SPEC_STEPS,
                rates,
                use_fp64=bool(flags & 4),
                skip_masked_vocab_blocks=skip,
            )
        # entries past num_sampled are left unwritten (torch.empty) on both sides
        kept = torch.arange(SPEC_STEPS + 1)[None, :] < num_sampled[:, None]
        out += [torch.where(kept, sampled, -2), num_sampled]
    return out


def _draft_buffers(g):
    return SimpleNamespace(
        input_ids=_ints(g, VOCAB, (64,)),
        positions=_ints(g, MODEL_LEN, (64,), torch.int64),
        query_start_loc=_ints(g, 64, (MAX_REQS + 1,)),
        seq_lens=_ints(g, MODEL_LEN, (MAX_REQS,)),
    )


def case_draft_prefill_inputs(g, side, guard):
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import prepare_prefill_inputs

    n, idx, qsl = _batch(g)
    tokens = int(qsl[-1])
    batch = SimpleNamespace(
        num_reqs=n,
        input_ids=_ints(g, VOCAB, (tokens,)),
        positions=_ints(g, MODEL_LEN, (tokens,), torch.int64),
        idx_mapping=idx,
        query_start_loc=qsl,
        seq_lens=_ints(g, MODEL_LEN, (n,), low=1),
    )
    buffers = _draft_buffers(g)
    qlen = qsl[1:] - qsl[:-1]
    num_rejected = torch.minimum(_ints(g, 3, (n,)), qlen - 1)
    num_sampled = _ints(g, 3, (n,))
    last_sampled = _ints(g, VOCAB, (MAX_REQS, 1), torch.int64)
    next_prefill = _ints(g, VOCAB, (MAX_REQS,))
    last_token_indices = _ints(g, 64, (MAX_REQS,), torch.int64)
    step = torch.tensor(2, dtype=torch.int64)
    with guard():
        prepare_prefill_inputs(
            last_token_indices,
            step,
            buffers,
            batch,
            num_sampled,
            num_rejected,
            last_sampled,
            next_prefill,
            MAX_REQS,
        )
    return [last_token_indices, step, *vars(buffers).values()]


def case_draft_decode_inputs(g, side, guard):
    """The decode-step inputs (upstream launches the kernel from the speculator's
    ``_prepare_decode_inputs``, with these arguments)."""
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar import speculator

    n = int(torch.randint(1, MAX_REQS + 1, (1,), generator=g))
    drafts = _ints(g, VOCAB, (MAX_REQS, SPEC_STEPS), torch.int64)
    target_seq_lens = _ints(g, MODEL_LEN + 1, (n,), low=4)
    num_rejected = _ints(g, 3, (n,))
    buffers = _draft_buffers(g)
    buffers.positions[:n] = torch.where(
        torch.rand(n, generator=g) < 0.3, MODEL_LEN - 1, buffers.positions[:n]
    )
    sample_src = _ints(g, 99, (MAX_REQS,), torch.int64)
    advance = bool(torch.randint(0, 2, (1,), generator=g))
    with guard():
        speculator._prepare_decode_inputs_kernel[(n + 1,)](
            drafts[:n, 0],
            drafts.stride(0),
            target_seq_lens,
            num_rejected,
            buffers.input_ids,
            buffers.positions,
            sample_src,
            buffers.query_start_loc,
            buffers.seq_lens,
            MODEL_LEN,
            MAX_REQS,
            BLOCK_SIZE=1024,
            ADVANCE_DRAFT_POSITIONS=advance,
        )
    return [sample_src, *vars(buffers).values()]


def case_update_draft_inputs(g, side, guard):
    """Each draft step (the last one records its tokens only), advancing positions or
    not, against a model length held in a device scalar (int32; auto-fit may lower it
    after graph capture) that some positions and lengths reach."""
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import update_draft_inputs

    results = []
    for advance in (False, True):
        for current in range(SPEC_STEPS):
            n = int(torch.randint(1, MAX_REQS + 1, (1,), generator=g))
            hidden = 40
            drafts = _ints(g, VOCAB, (n,), torch.int64)
            step = torch.tensor(current, dtype=torch.int64)
            hidden_states = torch.randn(n + 2, hidden, generator=g)
            out = _ints(g, VOCAB, (MAX_REQS, SPEC_STEPS), torch.int64)
            next_hidden = torch.randn(MAX_REQS, hidden, generator=g)
            buffers = _draft_buffers(g)
            sample_src = _ints(g, 99, (MAX_REQS,), torch.int64)
            limit = int(torch.randint(8, MODEL_LEN + 1, (1,), generator=g))
            max_model_len = torch.tensor(limit, dtype=torch.int32)
            with guard():
                update_draft_inputs(
                    drafts,
                    step,
                    hidden_states,
                    out,
                    next_hidden,
                    buffers,
                    sample_src,
                    n,
                    max_model_len,
                    SPEC_STEPS,
                    advance,
                )
            results += [out, next_hidden, sample_src, *vars(buffers).values()]
    return results


CASES = {name.removeprefix("case_"): fn for name, fn in dict(globals()).items() if name.startswith("case_")}


def run(name: str, seed: int, side: str, guard=contextlib.nullcontext) -> list:
    """``guard``: a context the kernel launches (not the case's set-up) run inside."""
    g = torch.Generator().manual_seed(1000 * seed + sorted(CASES).index(name))
    return CASES[name](g, side, guard)


def main(out: str) -> None:
    results = {f"{name}/{seed}": run(name, seed, "oracle") for name in CASES for seed in SEEDS}
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1])
