"""A decode step's work around the forward replayed from NPU graphs (worker/v2/step_graphs.py),
through the contract double's graphs (capture launches nothing, replay re-runs exactly the
captured ops on the captured memory), against the eager sequence upstream's runner runs
(``prepare_pos_seq_lens``, ``combine_sampled_and_draft_tokens``, the block tables' gather
and slot mappings; the greedy pick and ``get_num_sampled_and_rejected``; ``post_update``,
through the torch forms ``test_v2_runner_kernels.py`` holds equal to upstream's Triton
kernels): on random request slots, lengths, prefill lengths, block tables, sliding
windows, logits with ties and NaNs, padded and unpadded sizes and rows a larger batch left
behind, every buffer the step writes is equal, and each graph is one replay. The prefill
lengths and block counts come in new buffers each step, as upstream's rotating uploads
do; tokens from another sampler are copied into the state update. A step with drafts
(every request's last token and its k drafts) is checked the same way against upstream's
sequence with drafts: the logits' request slots (``expand_idx_mapping``), the drafts'
tokens (``gather_draft_sampled``), the greedy verification, ``post_update`` with drafts
and the MTP drafter's first-step inputs (``prepare_prefill_inputs``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch_npu = pytest.importorskip("torch_npu")
if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
    pytest.skip("the real torch_npu is active on this host", allow_module_level=True)

from torch_npu import _graphs  # noqa: E402

from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p  # noqa: E402
from vllm.v1.worker.gpu.input_batch import (  # noqa: E402
    combine_sampled_and_draft_tokens,
    expand_idx_mapping,
    get_num_sampled_and_rejected,
    post_update,
    prepare_pos_seq_lens,
)
from vllm.v1.worker.gpu.sample.gumbel import apply_temperature, gumbel_sample  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import (  # noqa: E402
    gather_draft_sampled,
    get_max_chunk_logits,
)
from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import (  # noqa: E402
    _prepare_decode_inputs_kernel,
)
from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import (  # noqa: E402
    prepare_prefill_inputs as prepare_draft_prefill_inputs,
)

from vllm.ascend import device as ascend_device  # noqa: E402
from vllm.ascend.device.npu import NPUPathDevice  # noqa: E402
from vllm.ascend.platform.npu import NPUPlatform  # noqa: E402
from vllm.ascend.worker.block_tables import NPUBlockTables  # noqa: E402
from vllm.ascend.worker.v2.gumbel import first_max_or_nan  # noqa: E402
from vllm.ascend.worker.v2.rejection_sampler import verify_greedy  # noqa: E402
from vllm.ascend.worker.v2.step_graphs import (  # noqa: E402
    GREEDY,
    SAMPLING_KINDS,
    DecodeStepGraphs,
    DrafterBuffers,
    SamplingSources,
    StepBuffers,
    sampling_kinds,
)

MAX_REQS = 10
MAX_TOKENS = 32
SIZES = [1, 2, 4, 8]
BLOCK_SIZES = [16, 32]
MAX_BLOCKS = [12, 6]
MODEL_LEN = 200
VOCAB = 1500  # the sampling-distribution test's (its tiny Qwen2's vocabulary)


def _side(groups: int, window: bool, k: int = 0):
    """One runner's worth of state: block tables and the step buffers (``k`` drafts per
    request)."""
    tables = NPUBlockTables(
        block_sizes=BLOCK_SIZES[:groups],
        max_num_reqs=MAX_REQS,
        max_num_batched_tokens=MAX_TOKENS,
        max_num_blocks_per_group=MAX_BLOCKS[:groups],
        device=torch.device("cpu"),
        sliding_window_reach=[40, 0][:groups] if window else None,
    )
    buffers = StepBuffers(
        positions=torch.zeros(MAX_TOKENS, dtype=torch.int64),
        seq_lens=torch.zeros(MAX_REQS, dtype=torch.int32),
        input_ids=torch.zeros(MAX_TOKENS, dtype=torch.int32),
        query_start_loc=torch.zeros(MAX_REQS + 1, dtype=torch.int32),
        num_computed_tokens=torch.zeros(MAX_REQS, dtype=torch.int32),
        last_sampled_tokens=torch.zeros(MAX_REQS, 1, dtype=torch.int64),
        draft_tokens=torch.zeros(MAX_REQS, k, dtype=torch.int64),
        all_token_ids=torch.zeros(MAX_REQS, MODEL_LEN, dtype=torch.int32),
        total_len=torch.zeros(MAX_REQS, dtype=torch.int32),
        output_bin_counts=torch.zeros(MAX_REQS, VOCAB, dtype=torch.int32),
        logits=torch.zeros(SIZES[-1], VOCAB, dtype=torch.float32),
    )
    return tables, buffers


def _draft_side(k: int) -> DrafterBuffers:
    """An MTP drafter's input buffers."""
    return DrafterBuffers(
        last_token_indices=torch.zeros(MAX_REQS, dtype=torch.int64),
        current_draft_step=torch.tensor(0, dtype=torch.int64),
        input_ids=torch.zeros(MAX_TOKENS, dtype=torch.int32),
        positions=torch.zeros(MAX_TOKENS, dtype=torch.int64),
        query_start_loc=torch.zeros(MAX_REQS + 1, dtype=torch.int32),
        seq_lens=torch.zeros(MAX_REQS, dtype=torch.int32),
        next_prefill_tokens=torch.zeros(1, MAX_REQS, dtype=torch.int32),
        draft_tokens=torch.zeros(MAX_REQS, k, dtype=torch.int64),
        sample_src_positions=torch.zeros(MAX_REQS, dtype=torch.int64),
        idx_mapping=torch.zeros(MAX_REQS, dtype=torch.int64),
        temperature=torch.zeros(MAX_REQS, dtype=torch.float32),
        seeds=torch.zeros(MAX_REQS, dtype=torch.int64),
        max_model_len=MODEL_LEN,
        advance_positions=True,
    )


@pytest.fixture(scope="module", params=[(1, False), (2, True)], ids=["one-group", "two-groups-window"])
def graphed(request):
    NPUPlatform.register_triton_kernel_overrides()  # upstream's Triton kernels -> torch forms (once)
    with pytest.MonkeyPatch.context() as mp:
        npu_path = NPUPathDevice()  # the double's graphs, as in an NPU-path engine
        mp.setattr(ascend_device, "current", lambda: npu_path)
        groups, window = request.param
        tables, buffers = _side(groups, window)
        graphs = DecodeStepGraphs(SIZES, buffers, tables, MAX_REQS)
        assert graphs.size_for(1, 1) is None, "nothing is captured yet"
        graphs.capture()
        yield graphs, tables, buffers, groups, window


def _state(g: torch.Generator, tables: NPUBlockTables, buffers: StepBuffers, groups: int, dirty: int):
    """Random contents, written in place (the graph reads the buffers it captured)."""
    for row in range(MAX_REQS):
        ids = tuple(
            torch.randint(
                1, 500, (int(torch.randint(1, MAX_BLOCKS[k] + 1, (1,), generator=g)),), generator=g
            ).tolist()
            for k in range(groups)
        )
        tables.append_block_ids(row, ids, overwrite=True)
    tables.apply_staged_writes()
    for buffer in tables.input_block_tables:
        buffer.copy_(torch.randint(0, 500, buffer.shape, generator=g, dtype=buffer.dtype))
    tables._num_dirty_rows = dirty  # what an earlier, larger batch left
    tables.slot_mappings.copy_(torch.randint(0, 999, tables.slot_mappings.shape, generator=g))
    buffers.positions.copy_(torch.randint(0, 999, (MAX_TOKENS,), generator=g))
    buffers.seq_lens.copy_(torch.randint(0, 999, (MAX_REQS,), generator=g, dtype=torch.int32))
    buffers.input_ids.copy_(torch.randint(0, 999, (MAX_TOKENS,), generator=g, dtype=torch.int32))
    buffers.num_computed_tokens.copy_(torch.randint(0, 190, (MAX_REQS,), generator=g, dtype=torch.int32))
    buffers.last_sampled_tokens.copy_(torch.randint(0, 999, (MAX_REQS, 1), generator=g))
    buffers.all_token_ids.copy_(
        torch.randint(0, VOCAB, (MAX_REQS, MODEL_LEN), generator=g, dtype=torch.int32)
    )
    buffers.total_len.copy_(torch.randint(1, MODEL_LEN - 1, (MAX_REQS,), generator=g, dtype=torch.int32))
    buffers.output_bin_counts.copy_(torch.randint(0, 3, (MAX_REQS, VOCAB), generator=g, dtype=torch.int32))


def _mirror(tables: NPUBlockTables, buffers: StepBuffers, groups: int, window: bool):
    """An eager runner's copy of the graphed side's state."""
    other, other_buffers = _side(groups, window, buffers.draft_tokens.shape[1])
    for mine, theirs in zip(other.block_tables, tables.block_tables):
        mine.gpu.copy_(theirs.gpu)
    other.num_blocks.np[:] = tables.num_blocks.np
    other.num_blocks.copy_to_uva()
    for mine, theirs in zip(other.input_block_tables, tables.input_block_tables):
        mine.copy_(theirs)
    other._num_dirty_rows = tables._num_dirty_rows
    other.slot_mappings.copy_(tables.slot_mappings)
    for name in FIELDS:
        getattr(other_buffers, name).copy_(getattr(buffers, name))
    return other, other_buffers


FIELDS = [name for name in StepBuffers.__dataclass_fields__ if name != "logits"]


_SOURCES: list[SamplingSources] = []


def _sources(g: torch.Generator, new: bool) -> SamplingSources:
    """The sampling states' uploads: new tensors (requests joined), or the last ones again."""
    if _SOURCES and not new:
        return _SOURCES[-1]
    temperature = torch.rand(MAX_REQS, generator=g) + 0.3
    temperature[torch.rand(MAX_REQS, generator=g) < 0.2] = 0.0  # greedy rows in a random batch
    temperature[torch.rand(MAX_REQS, generator=g) < 0.2] = 1.0
    top_k = torch.randint(1, VOCAB + 1, (MAX_REQS,), generator=g, dtype=torch.int32)
    top_k[torch.rand(MAX_REQS, generator=g) < 0.3] = VOCAB  # no top-k
    top_p = torch.rand(MAX_REQS, generator=g) * 0.9 + 0.1
    top_p[torch.rand(MAX_REQS, generator=g) < 0.3] = 1.0  # no top-p
    seeds = torch.randint(0, 2**62, (MAX_REQS,), generator=g)
    _SOURCES.append(SamplingSources(temperature, seeds, top_k, top_p))
    return _SOURCES[-1]


def _eager_sampling_params(
    logits: torch.Tensor, req: torch.Tensor, sources: SamplingSources, kind: str
) -> torch.Tensor:
    """Upstream's sampler on a random kind's logits, per row of request slot ``req``: a
    float32 copy, temperature, then top-k/top-p where the kind has them."""
    processed = logits.to(torch.float32)
    apply_temperature(processed, req, sources.temperature)
    top_k = sources.top_k[req] if "top_k" in kind else None
    top_p = sources.top_p[req] if "top_p" in kind else None
    if top_k is None and top_p is None:
        return processed
    return apply_top_k_top_p(processed, top_k, top_p)


def _logits(g: torch.Generator, rows: int) -> torch.Tensor:
    """bfloat16 logits (the model's), with ties and now and then a NaN."""
    logits = torch.randint(-3, 4, (rows, VOCAB), generator=g).to(torch.bfloat16)
    if bool(torch.randint(0, 2, (1,), generator=g)):
        logits[
            int(torch.randint(0, rows, (1,), generator=g)), int(torch.randint(0, VOCAB, (1,), generator=g))
        ] = float("nan")
    return logits


def _eager_inputs(eager: StepBuffers, tables: NPUBlockTables, idx, size: int, prefill_len, cu, q: int):
    """Upstream's prepare_inputs and prepare_attn of a step of ``q`` tokens per request,
    eagerly: the logits indices, the block tables' rows and the slot mappings."""
    qsl = eager.query_start_loc[: size + 1]
    prepare_pos_seq_lens(idx, qsl, eager.num_computed_tokens, eager.positions, eager.seq_lens)
    logits_indices = combine_sampled_and_draft_tokens(
        eager.input_ids,
        idx,
        eager.last_sampled_tokens,
        qsl,
        eager.seq_lens[:size],
        prefill_len,
        eager.draft_tokens,
        cu,
        idx.shape[0] * q,
        1,
    )
    rows = [
        t.clone()
        for t in tables.gather_block_tables(idx, size, num_computed_tokens=eager.num_computed_tokens)
    ]
    return logits_indices, rows, tables.compute_slot_mappings(idx, qsl, eager.positions, size * q).clone()


def _eager_update(eager: StepBuffers, idx, tokens, num_sampled, num_rejected, qsl) -> None:
    """Upstream's postprocess_sampled, eagerly (the last pipeline rank: no drafts in)."""
    post_update(
        idx,
        eager.num_computed_tokens,
        eager.last_sampled_tokens,
        eager.output_bin_counts,
        tokens,
        num_sampled,
        num_rejected,
        qsl,
        eager.all_token_ids,
        eager.total_len,
        None,
        eager.draft_tokens,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**31),
    num_reqs=st.integers(1, 8),
    dirty=st.integers(0, MAX_REQS),
    kind=st.sampled_from([*SAMPLING_KINDS, "another sampler"]),
    new_sources=st.booleans(),
)
def test_replayed_steps_are_the_eager_steps(graphed, seed, num_reqs, dirty, kind, new_sources):
    graphs, tables, buffers, groups, window = graphed
    g = torch.Generator().manual_seed(seed)
    _state(g, tables, buffers, groups, dirty)
    size = next(s for s in SIZES if s >= num_reqs)
    idx = torch.randperm(MAX_REQS, generator=g)[:num_reqs].to(torch.int64)
    # one decode token per request; padded rows start where the tokens end (upstream's padding)
    qsl = torch.full((MAX_REQS + 1,), num_reqs, dtype=torch.int32)
    qsl[: num_reqs + 1] = torch.arange(num_reqs + 1)
    buffers.query_start_loc.copy_(qsl)
    # mostly decoding, now and then a request whose prompt is longer (no token counted)
    prefill_len = torch.randint(1, 200, (MAX_REQS,), generator=g, dtype=torch.int32)
    eager_tables, eager = _mirror(tables, buffers, groups, window)
    logits = _logits(g, num_reqs)

    # upstream's runner, eagerly: prepare_inputs, prepare_attn, the sampler, postprocess_sampled
    q = eager.query_start_loc[: size + 1]
    cu = torch.arange(num_reqs + 1, dtype=torch.int32)
    want_logits, want_tables, want_slots = _eager_inputs(eager, eager_tables, idx, size, prefill_len, cu, 1)
    sources = _sources(g, new_sources)
    if kind == GREEDY:
        want_tokens = first_max_or_nan(logits).view(-1, 1)
    elif kind == "another sampler":
        want_tokens = torch.randint(0, VOCAB, (num_reqs, 1), generator=g)
    else:  # upstream's random sampler: float32 logits, temperature, top-k/top-p, Gumbel-max
        processed = _eager_sampling_params(logits, idx, sources, kind)
        positions = eager.positions[want_logits]
        want_tokens = gumbel_sample(
            processed,
            idx,
            sources.temperature,
            sources.seeds,
            positions,
            apply_temperature=False,
            is_drafting=False,
        ).view(-1, 1)
    want_sampled, want_rejected = get_num_sampled_and_rejected(
        eager.seq_lens.new_ones(num_reqs), eager.seq_lens, cu, idx, prefill_len
    )
    _eager_update(eager, idx, want_tokens, want_sampled, want_rejected, q)

    assert graphs.size_for(num_reqs, size) == size
    before = _graphs.stats["replays"]
    got_logits, expanded = graphs.begin_step(size, idx, prefill_len.clone(), tables.num_blocks.gpu.clone())
    assert expanded is None, "one logit per request: upstream's identity mapping stays"
    assert graphs.graphed(idx) and not graphs.graphed(idx.clone())
    assert torch.equal(got_logits, want_logits)
    for got, want in zip(tables.input_block_tables, want_tables):
        assert torch.equal(got[:size], want)
    assert torch.equal(tables.slot_mappings[:, :size], want_slots)
    sampled_by_graph = kind != "another sampler"
    if sampled_by_graph:
        tokens, num_sampled, num_rejected = graphs.replay_sampling(kind, logits, sources)
        assert torch.equal(tokens, want_tokens), kind
        assert torch.equal(num_sampled, want_sampled) and torch.equal(num_rejected, want_rejected)
    else:
        tokens, num_sampled, num_rejected = want_tokens, want_sampled.clone(), want_rejected.clone()
    graphs.replay_update(tokens, num_sampled, num_rejected, sources)
    assert _graphs.stats["replays"] == before + (3 if sampled_by_graph else 2)
    assert not graphs.graphed(idx), "the step ends with its update"

    for name in FIELDS:
        assert torch.equal(getattr(buffers, name), getattr(eager, name)), name
    for got, want in zip(tables.input_block_tables, eager_tables.input_block_tables):
        assert torch.equal(got, want)
    assert torch.equal(tables.slot_mappings, eager_tables.slot_mappings)
    assert tables._num_dirty_rows == eager_tables._num_dirty_rows


def test_sizes_not_captured_are_not_covered(graphed):
    graphs = graphed[0]
    assert graphs.size_for(3, 4) == 4 and graphs.size_for(8, 8) == 8
    assert graphs.size_for(3, 3) is None, "3 rows were not captured"
    assert graphs.size_for(9, 9) is None and graphs.size_for(5, 4) is None


def test_graph_sampled_draws_follow_the_exact_distribution_and_equal_the_eager_sampler(graphed):
    """The runner's sampler says a batch at temperature 0.8, top-k 50, top-p 0.8 may be
    sampled by the graphs; 4000 seeded draws through them, 8 requests a step with new seeds
    each step (new uploads), fit the distribution transformers' warpers make of a tiny
    Qwen2's logits (chi-square, false-alarm rate ``FALSE_ALARM``), reject the one without
    top-p, and equal the eager sampler's draws for the same seeds token for token."""
    from tests.unit.worker.test_v2_sampling_distribution import (
        FALSE_ALARM,
        TEMPERATURE,
        TOP_K,
        TOP_P,
        draw_tokens,
        exact_distribution,
        fit_p_value,
        npu_sampler,
        seeded_params,
        tiny_qwen2_logits,
    )

    graphs, tables, buffers, groups, _ = graphed
    vocab = buffers.logits.shape[1]
    hf_logits = tiny_qwen2_logits([3, 141, 59, 26, 535], 1, seed=0)[0]
    rows, steps, position = SIZES[-1], 500, 9
    idx = torch.arange(rows)
    buffers.query_start_loc.copy_(torch.cat([torch.arange(rows + 1), torch.full((MAX_REQS - rows,), rows)]))
    buffers.num_computed_tokens.fill_(position)  # a decode step's position is its computed count
    prefill_len = torch.ones(MAX_REQS, dtype=torch.int32)
    counts = torch.zeros(vocab, dtype=torch.int64)
    for step in range(steps):
        sampler = npu_sampler([seeded_params(1000 + step * rows + i) for i in range(rows)])
        kind = sampler.graph_sampling_kind(idx.numpy())
        assert kind == "random_top_k_top_p"
        graphs.begin_step(rows, idx, prefill_len, tables.num_blocks.gpu)
        tokens, _, _ = graphs.replay_sampling(
            kind, hf_logits[None].expand(rows, -1), sampler.sampling_sources()
        )
        graphs.forget_step()
        if step < 20:  # the eager sampler, the same seeds and positions
            assert torch.equal(tokens[:, 0], draw_tokens(sampler, hf_logits, list(range(rows)), position))
        counts += torch.bincount(tokens[:, 0], minlength=vocab)
    want = exact_distribution(hf_logits, TEMPERATURE, TOP_K, TOP_P)
    p = fit_p_value(counts, want)
    assert p > FALSE_ALARM, f"chi-square p = {p:.2e} over {rows * steps} draws"
    assert fit_p_value(counts, exact_distribution(hf_logits, TEMPERATURE, TOP_K, None)) < FALSE_ALARM**2


K = 2  # drafts per request in the verification steps


@pytest.fixture(scope="module", params=[(1, False), (2, True)], ids=["one-group", "two-groups-window"])
def graphed_drafts(request):
    NPUPlatform.register_triton_kernel_overrides()
    with pytest.MonkeyPatch.context() as mp:
        npu_path = NPUPathDevice()
        mp.setattr(ascend_device, "current", lambda: npu_path)
        groups, window = request.param
        tables, buffers = _side(groups, window, K)
        drafter = _draft_side(K)
        graphs = DecodeStepGraphs(SIZES, buffers, tables, MAX_REQS, query_len=K + 1, drafter=drafter)
        graphs.capture()
        yield graphs, tables, buffers, drafter, groups, window


def _drafter_tensors(drafter: DrafterBuffers) -> dict[str, torch.Tensor]:
    return {name: t for name, t in vars(drafter).items() if isinstance(t, torch.Tensor)}


def _copy_drafter(drafter: DrafterBuffers) -> DrafterBuffers:
    return dataclasses.replace(drafter, **{name: t.clone() for name, t in _drafter_tensors(drafter).items()})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**31),
    num_reqs=st.integers(1, 8),
    dirty=st.integers(0, MAX_REQS),
    kind=st.sampled_from((*SAMPLING_KINDS, "another sampler")),
    accept=st.floats(0.0, 1.0),
)
def test_replayed_verification_steps_are_the_eager_steps(graphed_drafts, seed, num_reqs, dirty, kind, accept):
    """Every request decodes its last token and K drafts; the logits favour each draft with
    probability ``accept`` (so every number of accepted drafts occurs). Tokens verified by
    the graph of ``kind`` (greedy, or random: upstream's rejection sampler on the sampling
    parameters' logits, some rows greedy), or by another sampler and copied in."""
    graphs, tables, buffers, drafter, groups, window = graphed_drafts
    q = K + 1
    g = torch.Generator().manual_seed(seed)
    _state(g, tables, buffers, groups, dirty)
    buffers.draft_tokens.copy_(torch.randint(0, VOCAB, (MAX_REQS, K), generator=g))
    for t in _drafter_tensors(drafter).values():
        t.copy_(torch.randint(0, 99, t.shape, generator=g, dtype=t.dtype))
    size = next(s for s in SIZES if s >= num_reqs)
    idx = torch.randperm(MAX_REQS, generator=g)[:num_reqs].to(torch.int64)
    qsl = torch.full((MAX_REQS + 1,), num_reqs * q, dtype=torch.int32)
    qsl[: num_reqs + 1] = torch.arange(num_reqs + 1) * q
    buffers.query_start_loc.copy_(qsl)
    # mostly decoding; now and then a request whose drafts are placeholders inside its prompt
    prefill_len = torch.randint(1, 60, (MAX_REQS,), generator=g, dtype=torch.int32)
    prefill_len[torch.rand(MAX_REQS, generator=g) < 0.15] = 195
    eager_tables, eager = _mirror(tables, buffers, groups, window)
    eager_drafter = _copy_drafter(drafter)

    # upstream's runner with drafts, eagerly: prepare_inputs, prepare_attn, verification,
    # postprocess_sampled, then the drafter's first-step inputs
    qs = eager.query_start_loc[: size + 1]
    total = num_reqs * q
    cu = torch.arange(num_reqs + 1, dtype=torch.int32) * q
    expanded_idx, local_pos = expand_idx_mapping(idx, total, cu, q)
    want_logits, want_tables, want_slots = _eager_inputs(eager, eager_tables, idx, size, prefill_len, cu, q)
    draft_sampled, pos = gather_draft_sampled(
        eager.input_ids, eager.positions, want_logits, expanded_idx, local_pos, prefill_len
    )
    logits = _logits(g, total)
    for row in range(total - 1):  # favour the next row's draft
        if (
            int(local_pos[row + 1]) > 0
            and draft_sampled[row + 1] >= 0
            and float(torch.rand(1, generator=g)) < accept
        ):
            logits[row, int(draft_sampled[row + 1])] = 9.0
    sources = _sources(g, new=bool(torch.randint(0, 2, (1,), generator=g)))
    if kind == GREEDY:
        want_tokens, num = verify_greedy(logits, draft_sampled, cu, local_pos, K)
    elif kind == "another sampler":  # its tokens and counts
        want_tokens = torch.randint(0, VOCAB, (num_reqs, q), generator=g)
        num = torch.randint(1, q + 1, (num_reqs,), generator=g, dtype=torch.int32)
    else:  # upstream's RejectionSampler._verify: sampling parameters per logit row, then
        # the standard rejection sampling of one-hot drafts
        want_tokens, num = rejection_sample(
            _eager_sampling_params(logits, expanded_idx, sources, kind),
            None,
            draft_sampled,
            cu,
            pos,
            idx,
            expanded_idx,
            local_pos,
            sources.temperature,
            sources.seeds,
            K,
            skip_masked_vocab_blocks=kind != "random",
        )
    want_sampled, want_rejected = get_num_sampled_and_rejected(num, eager.seq_lens, cu, idx, prefill_len)
    _eager_update(eager, idx, want_tokens, want_sampled, want_rejected, qs)
    # upstream's drafter method, on the buffers' copy (its fields have the drafter's names)
    copy_request_inputs = DraftModelSpeculator._copy_request_inputs
    copy_request_inputs(eager_drafter, num_reqs, idx, sources.temperature, sources.seeds)  # type: ignore[arg-type]
    prepare_draft_prefill_inputs(
        eager_drafter.last_token_indices,
        eager_drafter.current_draft_step,
        eager_drafter,  # (the drafter's input buffers: the same fields)
        _Batch(num_reqs, idx, qs, eager, size * q),
        want_sampled,
        want_rejected,
        eager.last_sampled_tokens,
        eager_drafter.next_prefill_tokens,
        MAX_REQS,
    )

    assert graphs.size_for(num_reqs, size) == size
    before = _graphs.stats["replays"]
    got_logits, expanded = graphs.begin_step(size, idx, prefill_len.clone(), tables.num_blocks.gpu.clone())
    assert torch.equal(got_logits, want_logits)
    assert expanded is not None
    assert torch.equal(expanded[0], expanded_idx) and torch.equal(expanded[1], local_pos)
    for got, want in zip(tables.input_block_tables, want_tables):
        assert torch.equal(got[:size], want)
    assert torch.equal(tables.slot_mappings[:, : size * q], want_slots)
    sampled_by_graph = kind != "another sampler"
    if sampled_by_graph:
        assert graphs.samples(kind)
        tokens, num_sampled, num_rejected = graphs.replay_sampling(kind, logits, sources)
        # (upstream's rejection sampler leaves a request's places past its tokens unset)
        unset = (
            torch.arange(q) >= num[:, None] if kind != GREEDY else torch.zeros_like(tokens, dtype=torch.bool)
        )
        assert torch.equal(tokens[~unset], want_tokens[~unset]), kind
        assert torch.equal(num_sampled, want_sampled) and torch.equal(num_rejected, want_rejected)
    else:
        tokens, num_sampled, num_rejected = want_tokens, want_sampled.clone(), want_rejected.clone()
    graphs.replay_update(tokens, num_sampled, num_rejected, sources)
    assert _graphs.stats["replays"] == before + (3 if sampled_by_graph else 2)

    for name in FIELDS:
        assert torch.equal(getattr(buffers, name), getattr(eager, name)), name
    for name, t in _drafter_tensors(drafter).items():
        assert torch.equal(t, getattr(eager_drafter, name)), f"drafter {name}"
    for got, want in zip(tables.input_block_tables, eager_tables.input_block_tables):
        assert torch.equal(got, want)
    assert torch.equal(tables.slot_mappings, eager_tables.slot_mappings)

    # the draft prefill's outputs (its first drafts, the positions it continues from), then
    # the drafter's decode-step inputs and the first decode step's slot mappings
    for name in ("draft_tokens", "positions", "sample_src_positions"):
        value = torch.randint(0, 150, getattr(drafter, name).shape, generator=g)
        getattr(drafter, name).copy_(value)
        getattr(eager_drafter, name).copy_(value)
    d = eager_drafter
    _prepare_decode_inputs_kernel[(num_reqs + 1,)](
        d.draft_tokens[:num_reqs, 0],
        d.draft_tokens.stride(0),
        eager.seq_lens,
        want_rejected,
        d.input_ids,
        d.positions,
        d.sample_src_positions,
        d.query_start_loc,
        d.seq_lens,
        MODEL_LEN,
        MAX_REQS,
        BLOCK_SIZE=1024,
        ADVANCE_DRAFT_POSITIONS=True,
    )
    want_slots = eager_tables.compute_slot_mappings(idx, d.query_start_loc[: num_reqs + 1], d.positions, size)
    assert graphs.replay_draft_decode_inputs(num_reqs + 1, size, MODEL_LEN) is None, (
        "not this step's requests"
    )
    assert graphs.replay_draft_decode_inputs(num_reqs, size + 1, MODEL_LEN) is None, (
        "more tokens than captured"
    )
    assert graphs.replay_draft_decode_inputs(num_reqs, size, MODEL_LEN - 1) is None, "another model length"
    got_slots = graphs.replay_draft_decode_inputs(num_reqs, size, MODEL_LEN)
    assert got_slots is not None and torch.equal(got_slots, want_slots)
    assert graphs.replay_draft_decode_inputs(num_reqs, size, MODEL_LEN) is None, "once per step"
    for name, t in _drafter_tensors(drafter).items():
        assert torch.equal(t, getattr(eager_drafter, name)), f"drafter {name} after its decode inputs"
    assert torch.equal(tables.slot_mappings, eager_tables.slot_mappings)


class _Batch:
    """The input batch fields upstream's drafter preparation reads."""

    def __init__(
        self, num_reqs: int, idx: torch.Tensor, qsl: torch.Tensor, buffers: StepBuffers, tokens: int
    ):
        self.num_reqs = num_reqs
        self.idx_mapping = idx
        self.query_start_loc = qsl[: num_reqs + 1]
        self.seq_lens = buffers.seq_lens[:num_reqs]
        self.input_ids = buffers.input_ids[:tokens]
        self.positions = buffers.positions[:tokens]


def test_random_verification_graphs_stop_at_upstreams_chunk():
    """Upstream's rejection sampler verifies at most get_max_chunk_logits rows at once and
    splits a larger step; the random verification graphs stop below that size."""
    vocab = 129280  # DeepSeek-V3's
    rows = get_max_chunk_logits(vocab) // (K + 1)
    assert sampling_kinds(rows, K + 1, vocab) == SAMPLING_KINDS
    assert sampling_kinds(rows + 1, K + 1, vocab) == (GREEDY,)
    assert sampling_kinds(rows + 1, 1, vocab) == SAMPLING_KINDS  # (no drafts: no chunks)
