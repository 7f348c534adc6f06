"""The device work around a decode step's forward replayed from NPU graphs, per request
count the decode graphs are captured for: the step's inputs, its sampling and the
states' update after sampling.

Upstream's runner does this work in a few Triton launches: positions and sequence
lengths, the token ids (last sampled tokens), the block tables' rows and slot mappings
before the forward; temperature, top-k/top-p, the draw and the sampled/rejected counts
after it; the state update (``post_update``) at the end. Their torch forms
(``input_batch.py``, ``gumbel.py``, upstream's top-k/top-p, ``worker/block_tables.py``)
are 130 to 150 device ops, each a host dispatch and a kernel launch on Ascend. In a decode
step (no prefill) with the same number of tokens per request (one; with drafts, the
bonus token and every draft) they are pure functions of persistent buffers, so they
replay from graphs:

- **inputs** (``begin_step``): the request slots copied into the graph's buffer (padded),
  the block counts too (upstream uploads them anew each step), the prefill lengths when
  requests joined; one replay; with drafts also each logit's request slot and place
  (upstream's ``expand_idx_mapping``);
- **sampling** (``replay_sampling``), for a batch the sampler says may take it
  (``NPUSampler.graph_sampling_kind``): without drafts one graph per kind, greedy (the
  pick) or random with or without top-k and with or without top-p (temperature,
  upstream's top-k/top-p form, the Gumbel-max draw), the logits copied into the
  sampler's float32 buffer (exact for bfloat16 and float16 logits; its random-batch
  graphs read the same buffer, a step takes one or the other), the sampling states'
  values when requests joined; with drafts the verification, on a float32 buffer of its
  own: the drafts' tokens gathered, then greedy ``rejection_sampler.verify_greedy`` or,
  per random kind, upstream's standard rejection sampling of one-hot drafts on the
  sampling parameters' logits (sizes whose logits upstream verifies in one chunk);
  one replay; copies of the tokens and counts out (an asynchronous copy to the host may
  read them after the next replay);
- **state update** (``replay_update``): one replay after a sampling graph, which reads
  its outputs in place; after any other sampler, three copies in first. With an MTP or
  EAGLE drafter it also prepares the drafter's first-step inputs (the target's tokens
  shifted by one), and with two drafts or more a graph of its own replays after the
  draft prefill: the drafter's decode-step inputs and the first decode step's slot
  mappings (``replay_draft_decode_inputs``).

Rows past the step's requests, up to the captured size, are request slot ``-1``: zero
sequence length and block-table row, padding slots, no token written, no state updated,
as upstream leaves padded rows. What is captured is the forms the eager step runs, on the
padded batch: ``tests/unit/worker/test_v2_step_graphs.py`` holds every buffer equal to
upstream's eager sequence and the random draws to the eager sampler's and to the exact
distribution, ``tests/engine/test_graphs.py`` the tokens. Captured after the decode
graphs, measured in the memory profile and dropped there, as the sampler's graphs.
NPU-unverified: passes the contract double's graph checks (no host read, no
default-stream capture, replay on captured memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.logger import init_logger
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.worker.gpu.sample.gumbel import apply_temperature, gumbel_sample
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import get_max_chunk_logits
from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

from vllm.ascend import device as ascend_device
from vllm.ascend.graph import capture as graph_capture
from vllm.ascend.worker.block_tables import NPUBlockTables
from vllm.ascend.worker.v2.gumbel import first_max_or_nan
from vllm.ascend.worker.v2.input_batch import (
    combine_sampled_and_draft_tokens,
    expand_idx_mapping,
    get_num_sampled_and_rejected,
    post_update,
    prepare_pos_seq_lens,
)
from vllm.ascend.worker.v2.rejection_sampler import verify_greedy
from vllm.ascend.worker.v2.rejection_sampler_utils import gather_draft_sampled
from vllm.ascend.worker.v2.speculator import draft_decode_inputs, draft_prefill_inputs

logger = init_logger(__name__)


@dataclass
class StepBuffers:
    """The runner's persistent buffers the graphs read and write (fixed addresses)."""

    positions: torch.Tensor
    seq_lens: torch.Tensor
    input_ids: torch.Tensor
    query_start_loc: torch.Tensor
    num_computed_tokens: torch.Tensor
    last_sampled_tokens: torch.Tensor
    draft_tokens: torch.Tensor
    all_token_ids: torch.Tensor
    total_len: torch.Tensor
    output_bin_counts: torch.Tensor | None  # (None: not the last pipeline rank)
    # the sampler's float32 [rows, vocab]: the sampling graphs' input (with drafts, the
    # verification takes a buffer of its own, of rows x tokens per request); None: no
    # sampling graphs
    logits: torch.Tensor | None


@dataclass
class DrafterBuffers:
    """A target-dependent drafter's (MTP, EAGLE) input buffers. The state update graph
    prepares its first step's inputs (upstream's ``_copy_request_inputs`` and
    ``prepare_prefill_inputs``; the drafter then skips both:
    ``InputBatch.draft_prefill_inputs_prepared``); with two drafts or more,
    a graph of its own its decode steps' inputs and the first one's slot mappings, after
    the draft prefill (``_prepare_decode_inputs``; ``prepare_draft_decode_inputs``)."""

    last_token_indices: torch.Tensor
    current_draft_step: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    next_prefill_tokens: torch.Tensor  # the runner's
    draft_tokens: torch.Tensor  # [requests, k]
    sample_src_positions: torch.Tensor
    idx_mapping: torch.Tensor  # [max requests] its request slots (-1: skip the row)
    temperature: torch.Tensor  # [max requests] (by slot, as the sampling states')
    seeds: torch.Tensor
    max_model_len: int  # (the drafter's, at capture: a later change is not served)
    advance_positions: bool


@dataclass
class SamplingSources:
    """The sampling states' per-request values this step: upstream uploads each anew (a new
    tensor at another address) when requests join, and never rewrites an upload in place."""

    temperature: torch.Tensor
    seeds: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor


# how a batch is sampled from a graph: greedy, or random with top-k and/or top-p or neither
GREEDY = "greedy"
RANDOM_KINDS = ("random", "random_top_k", "random_top_p", "random_top_k_top_p")
SAMPLING_KINDS = (GREEDY, *RANDOM_KINDS)


def random_kind(top_k: bool, top_p: bool) -> str:
    return RANDOM_KINDS[int(top_k) + 2 * int(top_p)]


def sampling_kinds(rows: int, query_len: int, vocab: int) -> tuple[str, ...]:
    """The kinds captured for ``rows`` requests of ``query_len`` tokens each: every kind;
    with drafts the random ones only while upstream's rejection sampler verifies the
    step's logits in one chunk (past that it splits them; such a step verifies eagerly)."""
    if query_len > 1 and rows * query_len > get_max_chunk_logits(vocab):
        return (GREEDY,)
    return SAMPLING_KINDS


class _Mirror:
    """A fixed-address copy of one of those uploads, copied again only when the upload is a
    new tensor (steps without joining requests copy nothing)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.tensor = torch.zeros(size, dtype=dtype, device=device)
        self._source: torch.Tensor | None = None

    def refresh(self, source: torch.Tensor) -> None:
        if source is not self._source:
            self.tensor[: source.shape[0]].copy_(source)
            self._source = source  # (held: its identity is not reused while held)


@dataclass
class _Captured:
    inputs: graph_capture.AscendGraph
    logits_indices: torch.Tensor
    sampling: dict[str, graph_capture.AscendGraph]
    update: graph_capture.AscendGraph
    draft_decode: graph_capture.AscendGraph | None  # the drafter's decode inputs


@dataclass
class _Step:
    """The step whose inputs came from a graph: its size and its request slots (upstream's
    tensor, which the runner passes on to sampling and the update)."""

    size: int
    idx_mapping: torch.Tensor
    sampled: bool = False  # by a sampling graph, whose outputs the update reads in place


class DecodeStepGraphs:
    def __init__(
        self,
        sizes: list[int],
        buffers: StepBuffers,
        block_tables: NPUBlockTables,
        max_num_reqs: int,
        use_fp64_gumbel: bool = False,
        query_len: int = 1,
        drafter: DrafterBuffers | None = None,
    ) -> None:
        """``query_len``: the tokens of each request in a graphed step (1; with ``k``
        drafts per request, ``1 + k``, and the sampling graph verifies them)."""
        self.sizes = sorted({s for s in sizes if 0 < s <= max_num_reqs})
        self.query_len = query_len
        q = query_len
        if buffers.logits is not None and self.sizes and buffers.logits.shape[0] < self.sizes[-1]:
            raise ValueError(
                f"the logits buffer holds {buffers.logits.shape[0]} rows, fewer than {self.sizes[-1]}"
            )
        # the sampling graphs' logits (with drafts made at the capture, which measures them)
        self._logits = buffers.logits if query_len == 1 else None
        self._buffers = buffers
        self._drafter = drafter
        self._block_tables = block_tables
        self._max_num_reqs = max_num_reqs
        device = buffers.positions.device
        rows = self.sizes[-1] if self.sizes else 0
        # the graphs' inputs and outputs besides the runner's buffers
        self._idx = torch.full((rows,), -1, dtype=torch.int32, device=device)
        self._use_fp64_gumbel = use_fp64_gumbel
        self._prefill_len = _Mirror(max_num_reqs, torch.int32, device)
        self._temperature = _Mirror(max_num_reqs, torch.float32, device)
        self._seeds = _Mirror(max_num_reqs, torch.int64, device)
        self._top_k = _Mirror(max_num_reqs, torch.int32, device)
        self._top_p = _Mirror(max_num_reqs, torch.float32, device)
        self._num_blocks = torch.zeros(
            block_tables.num_kv_cache_groups, max_num_reqs, dtype=torch.int32, device=device
        )
        self._cu_num_logits = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        # each logit's request slot and place in its request (upstream's expand_idx_mapping)
        self._expanded_idx = torch.zeros(rows * q, dtype=torch.int64, device=device)
        self._expanded_local_pos = torch.zeros(rows * q, dtype=torch.int32, device=device)
        self._draft_sampled = torch.zeros(rows * q, dtype=torch.int64, device=device)
        self._draft_pos = torch.zeros(rows * q, dtype=torch.int64, device=device)
        self._sampled = torch.zeros(rows, q, dtype=torch.int64, device=device)
        # both counts in one tensor: one copy hands them out (replay_sampling)
        self._counts = torch.zeros(2, rows, dtype=torch.int32, device=device)
        self._num_sampled, self._num_rejected = self._counts[0], self._counts[1]
        self._captured: dict[int, _Captured] = {}
        self._step: _Step | None = None
        self._updated: tuple[int, int] | None = None  # (size, requests) of the step a graph just updated

    # -- capture ------------------------------------------------------------------------
    def capture(self, log: bool = True) -> int:
        """Per size the inputs graph, one per sampling kind, the update graph and (a
        drafter with two drafts or more) its decode inputs' graph, on the capture
        context's side stream, one memory pool (they replay one at a time); the device
        memory they took, the verification's logits buffer included. Every row is padding
        while capturing."""
        if self._captured or not self.sizes:
            return 0
        layer = ascend_device.current()
        free_before = layer.accelerator_memory_info()[0]
        pool = layer.graph_pool_handle()
        if self._logits is None and self._buffers.logits is not None:
            vocab = self._buffers.logits.shape[1]
            self._logits = torch.zeros(
                self.sizes[-1] * self.query_len, vocab, dtype=torch.float32, device=self._idx.device
            )
        self._idx.fill_(-1)
        with graph_capture.capture_context() as session:
            for rows in self.sizes:
                inputs = graph_capture.AscendGraph()
                logits_indices = torch.zeros(
                    rows * self.query_len, dtype=torch.int64, device=self._idx.device
                )
                with graph_capture.capture(inputs, pool, session.stream):
                    self.prepare_inputs(rows, logits_indices)
                sampling = {}
                vocab = self._buffers.logits.shape[1] if self._buffers.logits is not None else 0
                for kind in sampling_kinds(rows, self.query_len, vocab) if vocab else ():
                    sampling[kind] = graph_capture.AscendGraph()
                    with graph_capture.capture(sampling[kind], pool, session.stream):
                        self.sample(rows, kind, logits_indices)
                update = graph_capture.AscendGraph()
                with graph_capture.capture(update, pool, session.stream):
                    self.update_states(rows)
                draft_decode = None
                if self.prepares_draft_decode_inputs:
                    draft_decode = graph_capture.AscendGraph()
                    with graph_capture.capture(draft_decode, pool, session.stream):
                        self.prepare_draft_decode_inputs(rows)
                self._captured[rows] = _Captured(inputs, logits_indices, sampling, update, draft_decode)
        taken = free_before - layer.accelerator_memory_info()[0]
        if log:
            logger.info(
                "Ascend decode-step graphs: %d captured (inputs, %s and state updates of up to %d "
                "requests, %d tokens each), %.1f MiB",
                sum(2 + len(c.sampling) + (c.draft_decode is not None) for c in self._captured.values()),
                self._sampling_described(),
                self.sizes[-1],
                self.query_len,
                taken / 2**20,
            )
        return taken

    def _sampling_described(self) -> str:
        kinds = {kind for captured in self._captured.values() for kind in captured.sampling}
        if not kinds:
            return "no sampling"
        if self.query_len == 1:
            return "sampling"
        return "greedy and random verification" if kinds != {GREEDY} else "greedy verification"

    def release(self) -> None:
        self._captured.clear()
        if self.query_len > 1:
            self._logits = None
        self._step = None
        self._updated = None

    # -- what each graph captures (fixed shapes, no host state; the tests run them eagerly)
    def prepare_inputs(self, rows: int, logits_indices: torch.Tensor) -> None:
        """The step's inputs for the first ``rows`` staged request slots (``-1``: padding):
        ``query_len`` tokens and logits per request (the last sampled token, the drafts)."""
        b = self._buffers
        q = self.query_len
        idx = self._idx[:rows]
        real = idx >= 0
        req = idx.clamp(min=0)
        qsl = b.query_start_loc[: rows + 1]
        prepare_pos_seq_lens(b.positions, b.seq_lens, req, qsl, b.num_computed_tokens, self._max_num_reqs)
        b.seq_lens[:rows] = torch.where(real, b.seq_lens[:rows], 0)
        cu = self._cu_num_logits[: rows + 1]
        torch.cumsum(real * q, 0, out=cu[1:])  # q logits per real request, none per padding row
        combine_sampled_and_draft_tokens(
            b.input_ids,
            req,
            b.last_sampled_tokens,
            qsl,
            b.seq_lens[:rows],
            self._prefill_len.tensor,
            b.draft_tokens,
            b.draft_tokens.stride(0),
            cu,
            logits_indices,
            NUM_NEW_SAMPLED_TOKENS=1,
        )
        if q > 1:
            expand_idx_mapping(req, self._expanded_idx[: rows * q], self._expanded_local_pos[: rows * q], cu)
        self._block_tables.gather_padded_rows(idx, self._num_blocks, b.num_computed_tokens)
        self._block_tables.compute_slot_mappings(idx, qsl, b.positions, rows * q)

    def sample(self, rows: int, kind: str, logits_indices: torch.Tensor) -> None:
        """Sample the staged float32 logits as upstream's sampler does a batch of this
        ``kind`` without logits processing, logprobs or NaN counts: greedy, the pick (the
        rule ``gumbel.first_max_or_nan`` states); random, temperature, then top-k/top-p
        (upstream's torch form) where the kind has them, then the Gumbel-max draw. Then
        the counts upstream's sampler makes: one token per request not mid-prefill, no
        rejections. With drafts (greedy only): the greedy verification of upstream's
        rejection sampler on the same float32 logits, then its counts."""
        b = self._buffers
        assert self._logits is not None
        idx = self._idx[:rows]
        q = self.query_len
        if q > 1:
            self._verify(rows, kind, logits_indices)
            return
        logits = self._logits[:rows]
        if kind == GREEDY:
            self._sampled[:rows, 0] = first_max_or_nan(logits)
        else:
            logits = self._sampling_params(logits, idx.clamp(min=0), kind)
            self._sampled[:rows, 0] = gumbel_sample(
                logits,
                idx,  # padding rows -1: sampled greedily, read by nothing
                self._temperature.tensor,
                self._seeds.tensor,
                b.positions[logits_indices],
                apply_temperature=False,
                is_drafting=False,
                use_fp64=self._use_fp64_gumbel,
            )
        self._num_sampled[:rows].fill_(1)
        get_num_sampled_and_rejected(
            self._num_sampled[:rows],
            self._num_rejected[:rows],
            b.seq_lens[:rows],
            self._cu_num_logits[: rows + 1],
            idx.clamp(min=0),
            self._prefill_len.tensor,
        )

    def _sampling_params(self, logits: torch.Tensor, req: torch.Tensor, kind: str) -> torch.Tensor:
        """A random kind's logits: temperature (in place), then top-k/top-p where the kind
        has them (upstream's torch form), per row of request slot ``req``."""
        apply_temperature(logits, req, self._temperature.tensor)
        top_k = self._top_k.tensor[req] if kind in ("random_top_k", "random_top_k_top_p") else None
        top_p = self._top_p.tensor[req] if kind in ("random_top_p", "random_top_k_top_p") else None
        if top_k is None and top_p is None:
            return logits
        # (the flag is a speed hint of the Triton form; True is right for any batch)
        return apply_top_k_top_p(logits, top_k, top_p, has_topp_only_rows=True)

    def _verify(self, rows: int, kind: str, logits_indices: torch.Tensor) -> None:
        """The drafts' verification, as upstream's rejection sampler does it for a batch
        without logits processors: greedy, the pick and the walk; random, the sampling
        parameters on each logit row, then the standard rejection sampling of one-hot
        drafts (``rejection_sample``: its Philox draws depend on the seed and position
        only, so a replay draws what the eager sampler draws)."""
        b = self._buffers
        assert self._logits is not None
        n = rows * self.query_len
        # (no draft is proposed inside a prompt: a draft slot there is a placeholder, -1)
        gather_draft_sampled(
            self._draft_sampled[:n],
            self._draft_pos[:n],
            b.input_ids,
            b.positions,
            logits_indices,
            self._expanded_idx[:n],
            self._expanded_local_pos[:n],
            self._prefill_len.tensor,
            n,
        )
        cu = self._cu_num_logits[: rows + 1]
        if kind == GREEDY:
            sampled, num_sampled = verify_greedy(
                self._logits[:n],
                self._draft_sampled[:n],
                cu,
                self._expanded_local_pos[:n],
                self.query_len - 1,
            )
        else:
            expanded = self._expanded_idx[:n]  # (padding rows: slot 0, read by nothing)
            sampled, num_sampled = rejection_sample(
                self._sampling_params(self._logits[:n], expanded, kind),
                None,  # one-hot drafts: a drafter keeping its logits verifies eagerly
                self._draft_sampled[:n],
                cu,
                self._draft_pos[:n],
                self._idx[:rows].clamp(min=0),
                expanded,
                self._expanded_local_pos[:n],
                self._temperature.tensor,
                self._seeds.tensor,
                self.query_len - 1,
                use_fp64=self._use_fp64_gumbel,
                # (as upstream decides it: a request of these kinds may mask logits)
                skip_masked_vocab_blocks=kind != "random",
            )
        self._sampled[:rows] = sampled
        self._num_sampled[:rows] = num_sampled
        get_num_sampled_and_rejected(
            self._num_sampled[:rows],
            self._num_rejected[:rows],
            b.seq_lens[:rows],
            cu,
            self._idx[:rows].clamp(min=0),
            self._prefill_len.tensor,
        )

    def update_states(self, rows: int) -> None:
        """Upstream's ``post_update`` of the step (the drafts' tokens, if any, were written
        by the drafter already); padding rows skipped. Then the drafter's first-step
        inputs, if it has them prepared here (what upstream's drafter does next): its
        request inputs (padding rows and rows past the step -1), then its tokens."""
        self._post_update(rows)
        d = self._drafter
        if d is not None:
            d.temperature.copy_(self._temperature.tensor)
            d.seeds.copy_(self._seeds.tensor)
            d.idx_mapping[:rows].copy_(self._idx[:rows])
            d.idx_mapping[rows:].fill_(-1)
            b = self._buffers
            n = rows * self.query_len
            draft_prefill_inputs(
                d.last_token_indices,
                d.current_draft_step,
                d.input_ids,
                d.positions,
                d.query_start_loc,
                d.seq_lens,
                b.input_ids[:n],
                b.positions[:n],
                self._idx[:rows],
                b.last_sampled_tokens,
                d.next_prefill_tokens,
                self._num_sampled[:rows],
                self._num_rejected[:rows],
                b.query_start_loc,
                b.seq_lens,
                self._max_num_reqs,
                padding_rows=True,
            )

    def prepare_draft_decode_inputs(self, rows: int) -> None:
        """The drafter's decode-step inputs after its prefill (upstream's
        ``_prepare_decode_inputs``: the first draft as input, positions and lengths one
        further, the rejected drafts off the lengths), padding rows left as they are and
        given no tokens; then the first decode step's slot mappings."""
        d = self._drafter
        assert d is not None
        idx = self._idx[:rows]
        draft_decode_inputs(
            d.draft_tokens[:rows],
            d.draft_tokens.stride(0),
            self._buffers.seq_lens,
            self._num_rejected[:rows],
            d.input_ids,
            d.positions,
            d.sample_src_positions,
            d.query_start_loc,
            d.seq_lens,
            d.max_model_len,
            self._max_num_reqs,
            ADVANCE_DRAFT_POSITIONS=d.advance_positions,
            real_rows=idx >= 0,
        )
        self._block_tables.compute_slot_mappings(idx, d.query_start_loc[: rows + 1], d.positions, rows)

    def _post_update(self, rows: int) -> None:
        b = self._buffers
        post_update(
            self._idx[:rows],
            b.num_computed_tokens,
            b.last_sampled_tokens,
            b.output_bin_counts,
            b.output_bin_counts.stride(0) if b.output_bin_counts is not None else 0,
            self._sampled[:rows],
            self._sampled.stride(0),
            self._num_sampled[:rows],
            self._num_rejected[:rows],
            b.query_start_loc,
            b.all_token_ids,
            b.all_token_ids.stride(0),
            b.total_len,
            None,
            b.draft_tokens,
            0,
        )

    # -- a step ------------------------------------------------------------------------
    def writes(self, block_tables: NPUBlockTables) -> bool:
        return block_tables is self._block_tables

    def size_for(self, num_reqs: int, num_reqs_padded: int) -> int | None:
        """The captured size that replays a step of ``num_reqs`` requests padded to
        ``num_reqs_padded`` rows, ``query_len`` tokens each, if any."""
        if num_reqs_padded not in self._captured or num_reqs > num_reqs_padded:
            return None
        if ascend_device.current().is_capturing():
            return None
        return num_reqs_padded

    def begin_step(
        self, size: int, idx_mapping: torch.Tensor, prefill_len: torch.Tensor, num_blocks: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Stage the step's inputs and replay its input graph: the logits indices and, with
        drafts, each logit's request slot and place in its request (views of the graph's
        outputs, rewritten by the next step's replay, which the stream orders after this
        step's reads)."""
        num_reqs = idx_mapping.shape[0]
        self._idx[:num_reqs].copy_(idx_mapping)
        if size > num_reqs:
            self._idx[num_reqs:size].fill_(-1)
        self._prefill_len.refresh(prefill_len)
        self._num_blocks[:, : num_blocks.shape[1]].copy_(num_blocks)
        captured = self._captured[size]
        captured.inputs.replay()
        self._block_tables.clear_rows_beyond(size, num_reqs)
        self._step = _Step(size, idx_mapping)
        n = num_reqs * self.query_len
        expanded = (self._expanded_idx[:n], self._expanded_local_pos[:n]) if self.query_len > 1 else None
        return captured.logits_indices[:n], expanded

    @property
    def prepares_draft_inputs(self) -> bool:
        """Does a graphed step's state update prepare the drafter's first-step inputs?"""
        return self._drafter is not None

    @property
    def prepares_draft_decode_inputs(self) -> bool:
        """Does a graph prepare the drafter's decode-step inputs (two drafts or more)?"""
        return self._drafter is not None and self._drafter.draft_tokens.shape[1] > 1

    def replay_draft_decode_inputs(
        self, num_reqs: int, num_tokens: int, max_model_len: int
    ) -> torch.Tensor | None:
        """After the draft prefill of the step just updated: its decode steps' inputs and
        the first one's slot mappings [groups, ``num_tokens``], or None (not this step's
        requests, more tokens than the captured size, or another model length)."""
        d = self._drafter
        if self._updated is None or d is None or max_model_len != d.max_model_len:
            return None
        rows, step_reqs = self._updated
        draft_decode = self._captured[rows].draft_decode
        if draft_decode is None or num_reqs != step_reqs or num_tokens > rows:
            return None
        draft_decode.replay()
        self._updated = None  # (once: the replay advances the positions)
        return self._block_tables.slot_mappings[:, :num_tokens]

    def forget_step(self) -> None:
        self._step = None
        self._updated = None

    def graphed(self, idx_mapping: torch.Tensor) -> bool:
        """Did this step (whose request slots are ``idx_mapping``) take its inputs from a graph?"""
        return self._step is not None and self._step.idx_mapping is idx_mapping

    @property
    def has_sampling_graphs(self) -> bool:
        return self._buffers.logits is not None

    def samples(self, kind: str) -> bool:
        """Does this graphed step's size have a sampling graph of ``kind``?"""
        step = self._step
        return step is not None and kind in self._captured[step.size].sampling

    def replay_sampling(
        self, kind: str, logits: torch.Tensor, sources: SamplingSources
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens [requests, query_len], sampled and rejected counts of this graphed
        step's logits [requests x query_len, vocab], sampled (or verified) the ``kind`` way."""
        step = self._step
        assert step is not None and self._logits is not None
        self._logits[: logits.shape[0]].copy_(logits)
        rows = logits.shape[0] // self.query_len
        if kind != GREEDY:
            self._temperature.refresh(sources.temperature)
            self._seeds.refresh(sources.seeds)
            self._top_k.refresh(sources.top_k)
            self._top_p.refresh(sources.top_p)
        self._captured[step.size].sampling[kind].replay()
        step.sampled = True
        # copies: the host reads them asynchronously, possibly after the next replay
        num_sampled, num_rejected = self._counts[:, :rows].clone()
        return self._sampled[:rows].clone(), num_sampled, num_rejected

    def replay_update(
        self,
        sampled: torch.Tensor,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        sources: SamplingSources,
    ) -> None:
        """``post_update`` of this graphed step: after a sampling graph its outputs are the
        update's inputs already; after any other sampler they are copied in first. With a
        drafter, ``sources`` are its request inputs (the target's temperatures and seeds)."""
        step = self._step
        assert step is not None
        if self._drafter is not None:
            self._temperature.refresh(sources.temperature)
            self._seeds.refresh(sources.seeds)
        if not step.sampled:
            rows = sampled.shape[0]
            self._sampled[:rows].copy_(sampled)
            self._num_sampled[:rows].copy_(num_sampled)
            self._num_rejected[:rows].copy_(num_rejected)
        self._captured[step.size].update.replay()
        self._updated = (step.size, step.idx_mapping.shape[0])
        self._step = None
