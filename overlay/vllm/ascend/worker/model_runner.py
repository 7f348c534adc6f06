"""The Ascend model runner: upstream's Model Runner V2 (``vllm/v1/worker/gpu``), the only
runner the distribution builds. What V2 does not run on Ascend is refused at start-up
(``platform/checks.py``, ``check_runner``).

A thin subclass: V2 asks the platform for its streams and events (hook patch
``v2-runner-make-its-streams-and-events-through-the-platform``), its Triton kernels
are replaced by the torch forms of ``vllm.ascend.worker.v2`` (registered by the
platform), and its block tables by :class:`~vllm.ascend.worker.block_tables.NPUBlockTables`
(hook: ``block_tables_cls``), its sampler by :class:`~vllm.ascend.worker.v2.sample.NPUSampler`
(hook: ``sampler_cls``: an all-greedy batch takes an argmax, a random one replays its
Gumbel sampler from a graph captured after the decode graphs) and its rejection sampler by
:class:`~vllm.ascend.worker.v2.rejection_sampler.NPURejectionSampler` (hook:
``rejection_sampler_cls``), and its prompt-embeddings state, which reads a table of
device pointers, by :class:`~vllm.ascend.worker.prompt_embeds.NPUPromptEmbedsState`
after the model is loaded. Prefill context parallel splits a step's tokens around
the model call (hook: ``model_forward``). DP ranks agree on a step in V2's own single
all-reduce (``vllm/v1/worker/gpu/dp_utils.py``); seeded sampling needs no generator
state (V2's noise is a hash of seed, position and token). With the NPU kernels the
memory profile runs attention (``worker/profiling.py``). Under asynchronous scheduling
with drafts, each step's host sequence lengths are made exact before the attention
metadata is built (``worker/v2/seq_lens.py``). With decode graphs on, a decode step
(without drafts, or with every request's drafts) replays its inputs, sampling (with
drafts: the greedy verification) and state update from graphs captured per size
(``worker/v2/step_graphs.py``; hook: ``prepare_positions_and_tokens``, with
``prepare_attn``, ``sample`` and ``postprocess_sampled``).
"""

from __future__ import annotations

import functools

import torch

from vllm.config.compilation import CUDAGraphMode
from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from vllm.logger import init_logger
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import TargetDependentARSpeculator

from vllm.ascend import device as ascend_device
from vllm.ascend import step_cache
from vllm.ascend.attention.kv_layout import connector_addresses_planes
from vllm.ascend.kernels import npu_kernels
from vllm.ascend.worker import pcp_forward, profiling
from vllm.ascend.worker.block_tables import NPUBlockTables
from vllm.ascend.worker.prompt_embeds import NPUPromptEmbedsState
from vllm.ascend.worker.v2.rejection_sampler import NPURejectionSampler
from vllm.ascend.worker.v2.sample import NPUSampler
from vllm.ascend.worker.v2.seq_lens import ExactHostSeqLens
from vllm.ascend.worker.v2.step_graphs import GREEDY, DecodeStepGraphs, DrafterBuffers, StepBuffers

logger = init_logger(__name__)


class NPUModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device: torch.device) -> None:
        self.device_layer = ascend_device.current()
        self._profiling_with_attention = False
        super().__init__(vllm_config, device)
        # asynchronous scheduling with drafts: the host's lengths are upper bounds
        self.exact_host_seq_lens = (
            ExactHostSeqLens(self.max_num_reqs, self.device_layer)
            if vllm_config.scheduler_config.async_scheduling and vllm_config.speculative_config is not None
            else None
        )
        # a decode step's work around the forward replayed from graphs (made with the captures)
        self.decode_step_graphs: DecodeStepGraphs | None = None
        # the block tables and slot mappings the input graph wrote for this step
        self._graphed_attention_inputs: tuple | None = None

    @property
    def block_tables_cls(self):
        pc = self.parallel_config
        if pc.prefill_context_parallel_size == 1:
            return NPUBlockTables
        from vllm.ascend.attention.context_parallel import rank_layout

        rank = rank_layout(pc)  # slots over PCP x DCP, not DCP alone
        return functools.partial(NPUBlockTables, layout=(rank.cp, rank.cp_rank))

    @property
    def sampler_cls(self):
        return NPUSampler  # (hook patch ``v2-runner-let-a-hardware-runner-select-its-sampler-class``)

    @property
    def rejection_sampler_cls(self):
        return NPURejectionSampler  # (hook patch ``...-select-its-rejection-sampler``)

    def capture_model(self, *, profile_only: bool = False) -> int:
        captured = super().capture_model(profile_only=profile_only)
        if isinstance(self.sampler, NPUSampler):  # a random batch's sampler (worker/v2/gumbel_graphs.py)
            captured += self.sampler.capture_graphs(profile_only)
        with torch.inference_mode():  # as upstream's capture (its buffers are inference tensors)
            graphs = self._make_decode_step_graphs()
            if graphs is not None:
                captured += graphs.capture(log=not profile_only)
                if profile_only:
                    # measured and dropped: the block tables it writes are made again with
                    # the real KV cache, after the profile
                    graphs.release()
                    self.decode_step_graphs = None
        return captured

    def _make_decode_step_graphs(self) -> DecodeStepGraphs | None:
        if self.decode_step_graphs is None and isinstance(self.block_tables, NPUBlockTables):
            # (its buffers are the runner's of now: the block tables, the sampler's logits)
            sizes = self.compilation_config.decode_cudagraph_capture_request_sizes or ()
            if self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE and sizes:
                buffers, states = self.input_buffers, self.req_states
                sampler = self.sampler if isinstance(self.sampler, NPUSampler) else None
                # with drafts, the graphs verify greedy ones (NPURejectionSampler's path)
                query_len = self.decode_query_len if self.speculator is not None else 1
                if self.model_state.num_new_sampled_tokens_per_step != 1 or (
                    query_len > 1 and not isinstance(self.rejection_sampler, NPURejectionSampler)
                ):
                    return None
                self.decode_step_graphs = DecodeStepGraphs(
                    list(sizes),
                    StepBuffers(
                        positions=buffers.positions,
                        seq_lens=buffers.seq_lens,
                        input_ids=buffers.input_ids,
                        query_start_loc=buffers.query_start_loc,
                        num_computed_tokens=states.num_computed_tokens.gpu,
                        last_sampled_tokens=states.last_sampled_tokens,
                        draft_tokens=states.draft_tokens,
                        all_token_ids=states.all_token_ids.gpu,
                        total_len=states.total_len.gpu,
                        output_bin_counts=(
                            self.sampler.penalties_state.output_bin_counts if self.is_last_pp_rank else None
                        ),
                        logits=sampler.logits_buffer if sampler is not None else None,
                    ),
                    self.block_tables,
                    self.max_num_reqs,
                    use_fp64_gumbel=sampler.use_fp64_gumbel if sampler is not None else False,
                    query_len=query_len,
                    drafter=self._drafter_buffers() if query_len > 1 else None,
                )
        return self.decode_step_graphs

    def _drafter_buffers(self) -> DrafterBuffers | None:
        """An MTP/EAGLE drafter's inputs, for the step graphs to prepare (only the last
        pipeline rank updates the state from a graph)."""
        drafter = self.speculator
        if not isinstance(drafter, TargetDependentARSpeculator) or not self.is_last_pp_rank:
            return None
        inputs = drafter.input_buffers
        return DrafterBuffers(
            last_token_indices=drafter.last_token_indices,
            current_draft_step=drafter.current_draft_step,
            input_ids=inputs.input_ids,
            positions=inputs.positions,
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            next_prefill_tokens=self.req_states.next_prefill_tokens,
            draft_tokens=drafter.draft_tokens,
            sample_src_positions=drafter.sample_src_positions,
            idx_mapping=drafter.idx_mapping,
            temperature=drafter.temperature,
            seeds=drafter.seeds,
            max_model_len=drafter.max_model_len,
            advance_positions=drafter.advance_draft_positions,
        )

    def _drafter_keeps_no_logits(self) -> bool:
        # (a drafter sampling its drafts "probabilistic"ally keeps their logits for the
        # verification; the default greedy drafting proposes one-hot drafts)
        return self.speculator is not None and self.speculator.draft_logits is None

    def _prepare_draft_decode_inputs(self, num_reqs: int, num_tokens: int) -> torch.Tensor | None:
        # (InputBatch.prepare_draft_decode_inputs: the drafter calls it after its prefill)
        graphs, drafter = self.decode_step_graphs, self.speculator
        assert graphs is not None and isinstance(drafter, TargetDependentARSpeculator)
        return graphs.replay_draft_decode_inputs(num_reqs, num_tokens, drafter.max_model_len)

    def prepare_inputs(self, *args, **kwargs):
        input_batch = super().prepare_inputs(*args, **kwargs)
        if self.exact_host_seq_lens is not None:
            self.exact_host_seq_lens.apply(input_batch)
        graphs = self.decode_step_graphs
        if graphs is not None and graphs.prepares_draft_inputs and graphs.graphed(input_batch.idx_mapping):
            # (the state update graph will: postprocess_sampled replays it for this step)
            input_batch.draft_prefill_inputs_prepared = True
            if graphs.prepares_draft_decode_inputs:
                input_batch.prepare_draft_decode_inputs = self._prepare_draft_decode_inputs
        return input_batch

    # -- a decode step's work around the forward from graphs (worker/v2/step_graphs.py) ----
    def prepare_positions_and_tokens(
        self, batch_req_state, idx_mapping, query_start_loc, cu_num_logits, total_num_logits, expand_logits
    ):
        # (hook patch ``v2-runner-let-a-hardware-runner-prepare-positions-and-tokens``)
        self._graphed_attention_inputs = None
        graphs = self.decode_step_graphs
        size = None
        if graphs is not None:
            graphs.forget_step()
            num_reqs = idx_mapping.shape[0]
            # every request's query is its last token and its drafts (none, or all k):
            # the sums equal means each request's does, as no request has more than k
            tokens = num_reqs * graphs.query_len
            if (
                self.pcp_manager is None
                and graphs.writes(self.block_tables)  # (not ones made again since the capture)
                and not batch_req_state.has_prefill
                and batch_req_state.num_tokens == tokens == total_num_logits
                and self.model_state.num_new_sampled_tokens_per_step == 1
                and (graphs.query_len == 1 or self.adaptive_verification is None)
                and query_start_loc.data_ptr() == self.input_buffers.query_start_loc.data_ptr()
            ):
                size = graphs.size_for(num_reqs, query_start_loc.shape[0] - 1)
        if graphs is None or size is None:
            return super().prepare_positions_and_tokens(
                batch_req_state, idx_mapping, query_start_loc, cu_num_logits, total_num_logits, expand_logits
            )
        blocks = self.block_tables
        logits_indices, expanded = graphs.begin_step(
            size, idx_mapping, self.req_states.prefill_len.gpu, blocks.num_blocks.gpu
        )
        self._graphed_attention_inputs = (
            tuple(t[:size] for t in blocks.input_block_tables),
            blocks.slot_mappings[:, : size * graphs.query_len],
        )
        return logits_indices, expanded if expand_logits else None

    def prepare_attn(self, input_batch):
        graphed, self._graphed_attention_inputs = self._graphed_attention_inputs, None
        if graphed is None:
            return super().prepare_attn(input_batch)
        block_tables, slot_mappings = graphed
        if slot_mappings.shape[1] != input_batch.num_tokens_after_padding:
            # (padded otherwise than the decode graphs pad: the eager gather and mappings)
            return super().prepare_attn(input_batch)
        return block_tables, slot_mappings

    def sample(self, hidden_states, input_batch, grammar_output):
        graphs = self.decode_step_graphs
        kind = None
        if (
            graphs is not None
            and graphs.has_sampling_graphs
            and graphs.graphed(input_batch.idx_mapping)
            and grammar_output is None
            and self.batch_sharder is None
            and input_batch.num_draft_tokens == input_batch.num_reqs * (graphs.query_len - 1)
        ):
            kind = self.sampler.graph_sampling_kind(input_batch.idx_mapping_np)
            verifier = self.rejection_sampler
            if graphs.query_len > 1 and not (
                kind is not None
                and isinstance(verifier, NPURejectionSampler)
                and (
                    verifier.greedy_path(input_batch.idx_mapping_np)
                    if kind == GREEDY
                    # (the random verification graphs take one-hot drafts)
                    else verifier.standard_method and self._drafter_keeps_no_logits()
                )
                and graphs.samples(kind)
            ):
                kind = None  # upstream's rejection sampler, eagerly
        if kind is None:
            return super().sample(hidden_states, input_batch, grammar_output)
        logits = self.model_state.compute_sample_logits(hidden_states[input_batch.logits_indices])
        tokens, num_sampled, num_rejected = graphs.replay_sampling(
            kind, logits, self.sampler.sampling_sources()
        )
        output = SamplerOutput(
            sampled_token_ids=tokens,
            logprobs_tensors=None,
            num_nans=None,
            num_sampled=num_sampled,
            num_rejected=num_rejected,
        )
        return output, num_sampled, num_rejected

    def postprocess_sampled(
        self, idx_mapping, sampled_tokens, num_sampled, num_rejected, query_start_loc=None, draft_tokens=None
    ) -> None:
        graphs = self.decode_step_graphs
        if (
            graphs is None
            or not graphs.graphed(idx_mapping)  # (its query starts are the runner's buffer)
            or draft_tokens is not None
            or not self.is_last_pp_rank
            or sampled_tokens.shape[1] != graphs.query_len
        ):
            if graphs is not None and graphs.graphed(idx_mapping) and graphs.prepares_draft_inputs:
                raise RuntimeError(
                    "Ascend runner: the drafter's first-step inputs were left to the decode-step "
                    f"graphs, which cannot update this step (sampled tokens {tuple(sampled_tokens.shape)}, "
                    f"{graphs.query_len} tokens per request); this is a bug, please report it; "
                    "enforce_eager=True runs without graphs"
                )
            return super().postprocess_sampled(
                idx_mapping, sampled_tokens, num_sampled, num_rejected, query_start_loc, draft_tokens
            )
        graphs.replay_update(sampled_tokens, num_sampled, num_rejected, self.sampler.sampling_sources())
        # (upstream's postprocess_sampled ends so too)
        self.model_state.postprocess_state(idx_mapping, num_sampled, self.req_states.num_computed_tokens.gpu)

    # -- prefill context parallel: the attention backends plan it from the whole step and
    # shard the KV over PCP x DCP; the model call runs this rank's share (hook patch
    # ``v2-runner-let-a-hardware-runner-split-prefill-context-parallel``) --------------
    def build_pcp_manager(self):
        return None  # upstream's manager rewrites the batch first and keeps KV replicas

    def model_forward(self, model_inputs: dict):
        plain = super().model_forward
        return pcp_forward.run_model(lambda **inputs: plain(inputs), model_inputs, self.device)

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        # upstream's prompt-embeddings state copies rows through a table of device
        # pointers (a Triton kernel); ours indexes one tensor of the live requests' rows
        state = getattr(self.model_state, "prompt_embeds_state", None)
        if state is not None:
            self.model_state.prompt_embeds_state = NPUPromptEmbedsState(
                self.max_num_reqs, state.hidden_size, state.dtype, self.device
            )

    def _init_kv_zero_meta(self) -> None:
        # Hybrid models have newly allocated attention blocks zeroed each step; upstream's
        # zeroer writes through a table of raw device addresses (a Triton kernel), its CPU
        # runner's through the cache tensors' own views, which any device runs.
        from vllm.v1.worker.cpu.utils import CPUKVBlockZeroer

        self.kv_block_zeroer = CPUKVBlockZeroer(
            self.device,
            attn_groups_iter=(g for groups in self.attn_groups for g in groups),
            kernel_block_sizes=self.kernel_block_sizes,
            static_forward_context=self.compilation_config.static_forward_context,
            num_blocks=self.kv_cache_config.num_blocks,
        )

    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, **kwargs) -> None:
        refuse_plane_blind_connector(self.vllm_config, is_profiling)
        super().initialize_kv_cache(kv_cache_config, is_profiling=is_profiling, **kwargs)

    # -- memory profiling with attention (worker/profiling.py) ---------------------------
    def profile_run(self, randomize_inputs: bool = False) -> None:
        if not npu_kernels():
            return super().profile_run(randomize_inputs)
        spec = self.vllm_config.speculative_config
        profiling.init_profiling_kv_cache(
            self,
            profiling.dummy_split(
                self.max_num_tokens,
                self.max_num_reqs,
                self.speculator,
                spec.max_num_new_slots_for_drafting if spec is not None else 0,
            ),
            draft_tokens=spec.num_speculative_tokens if spec is not None else 0,
        )
        self._profiling_with_attention = True
        try:
            super().profile_run(randomize_inputs)
        finally:
            self._profiling_with_attention = False
            self._release_profiling_kv_cache()

    def _dummy_run(self, num_tokens: int, *args, skip_attn: bool = False, is_profile: bool = False, **kwargs):
        if is_profile and self._profiling_with_attention:
            skip_attn = False
        with step_cache.dummy_run():
            return super()._dummy_run(num_tokens, *args, skip_attn=skip_attn, is_profile=is_profile, **kwargs)

    def _release_profiling_kv_cache(self) -> None:
        """Drop the profiling cache before the worker sizes the real one (V2 has no
        clean-up of its own for this: upstream never profiles with a KV cache)."""
        self.device_layer.synchronize()
        self.kv_caches.clear()
        for layer in self.compilation_config.static_forward_context.values():
            if hasattr(layer, "kv_cache"):
                layer.kv_cache = torch.tensor([])
        del self.kv_cache_config
        self.cache_config.num_gpu_blocks = None


def refuse_plane_blind_connector(vllm_config, is_profiling: bool) -> None:
    """A KV connector must address the Ascend cache's K/V (MLA: latent/rope) planes."""
    if (
        has_kv_transfer_group()
        and not is_profiling
        and not connector_addresses_planes(vllm_config.kv_transfer_config)
    ):
        name = type(get_kv_transfer_group()).__name__
        raise RuntimeError(
            f"KV connector {name} is not supported on Ascend: the Ascend KV cache splits each "
            "layer into K/V (MLA: latent/rope) planes, which upstream connectors do not address"
        )
