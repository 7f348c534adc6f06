"""The Ascend V1 model runner, for what the default runner (``model_runner_v2.py``) does
not run yet or ``VLLM_USE_V2_MODEL_RUNNER=0``: upstream's V1 GPU model runner with device
calls routed to vllm.ascend.device. Upstream's Triton kernels that have no torch fallback
(slot mapping, the speculative-decoding steps and rejection sampler) are replaced by
vllm.ascend.kernels (registered by the platform). Prefill context parallel (PCP) runs
here: each PCP rank runs its share of the step's tokens and the ranks' hidden states
are gathered back into the step's order after the model
(``vllm.ascend.context_parallel.forward``)."""

from __future__ import annotations

import torch

from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from vllm.logger import init_logger
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm.ascend import device as ascend_device
from vllm.ascend.attention.kv_layout import connector_addresses_planes
from vllm.ascend.context_parallel import forward as pcp_forward
from vllm.ascend.kernels import npu_kernels
from vllm.ascend.worker import dp_step, profiling

logger = init_logger(__name__)


class NPUModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device: torch.device) -> None:
        # the stream/event hooks below run inside upstream's constructor, before this line
        self.device_layer = ascend_device.current()
        super().__init__(vllm_config, device)
        self._use_context_parallel_slots()
        # DP: one metadata all-reduce per engine step, reused by the drafter (dp_step.py)
        self._dp_step = dp_step.install() if self.parallel_config.data_parallel_size > 1 else None

    # -- data parallel: arm one step's agreement --------------------------------------------
    def _drafter_passes(self, is_graph_capturing: bool = False) -> int:
        spec = self.speculative_config
        if spec is None:
            return 0
        if (
            spec.uses_extract_hidden_states()
            or is_graph_capturing
            or getattr(self.drafter, "parallel_drafting", False)
        ):
            return 1
        return self.num_spec_tokens if spec.use_eagle() or spec.uses_draft_model() else 0

    def execute_model(self, scheduler_output, *args, **kwargs):
        armed = False
        if self._dp_step is not None:
            counts = scheduler_output.num_scheduled_tokens
            passes = self._drafter_passes()
            # the drafter's first forward takes the step's tokens, the later ones one per request
            armed = self._dp_step.arm(
                dp_step.StepPlan(
                    has_prefill=any(n > 1 + self.num_spec_tokens for n in counts.values()),
                    drafter_passes=passes,
                    drafter_first=scheduler_output.total_num_scheduled_tokens,
                    drafter_rest=len(counts),
                )
            )
        try:
            output = super().execute_model(scheduler_output, *args, **kwargs)
        except BaseException:
            if armed:
                self._dp_step.disarm()
            raise
        if armed and output is not None:  # no sample_tokens() follows
            self._dp_step.disarm()
        return output

    def sample_tokens(self, *args, **kwargs):
        try:
            return super().sample_tokens(*args, **kwargs)
        finally:
            if self._dp_step is not None:
                self._dp_step.disarm()

    def _sync_device(self) -> None:
        self.device_layer.synchronize()

    # -- device streams and events (the stream hook patch on upstream's V1 runner) ----------
    def _new_stream(self):
        return self.device_layer.stream()

    def _new_event(self, blocking: bool = False):
        return self.device_layer.event(blocking=blocking)

    def _current_stream(self):
        return self.device_layer.current_stream()

    def _stream_context(self, stream):
        return self.device_layer.stream_context(stream)

    # -- context parallelism ------------------------------------------------------------
    def _use_context_parallel_slots(self) -> None:
        """The slot mapping places tokens over the whole PCP x DCP group (upstream's V1
        block table counts DCP only: its PCP keeps full replicas)."""
        pc = self.parallel_config
        if pc.prefill_context_parallel_size == 1:
            return
        from vllm.ascend.attention.context_parallel import rank_layout

        rank = rank_layout(pc)
        for table in self.input_batch.block_table.block_tables:
            table.dcp_world_size, table.dcp_rank = rank.cp, rank.cp_rank

    def may_reinitialize_input_batch(self, kv_cache_config) -> None:
        super().may_reinitialize_input_batch(kv_cache_config)
        self._use_context_parallel_slots()

    def _model_forward(
        self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **model_kwargs
    ):
        inputs = dict(
            input_ids=input_ids,
            positions=positions,
            intermediate_tensors=intermediate_tensors,
            inputs_embeds=inputs_embeds,
            **model_kwargs,
        )
        return pcp_forward.run_model(super()._model_forward, inputs, self.device)

    # -- seeded sampling on the host ------------------------------------------------------
    # A request whose prefill is still partial samples a token that is thrown away, and
    # upstream then steps its seeded generator back by rewinding its Philox offset (a CUDA
    # generator's; that torch_npu's generator answers the same is unverified). CPU
    # generators have no offset, so in host emulation the generator's state is saved
    # before sampling and put back instead.
    def _sample(self, *args, **kwargs):
        self._discarded_generator_states = {}
        if self.device.type == "cpu":
            mask = self.discard_request_mask.np[: self.input_batch.num_reqs]
            for i in mask.nonzero()[0].tolist():
                gen = self.input_batch.generators.get(i)
                if gen is not None:
                    self._discarded_generator_states[i] = (gen, gen.get_state())
        return super()._sample(*args, **kwargs)

    def _bookkeeping_sync(self, *args, **kwargs):
        saved = getattr(self, "_discarded_generator_states", {})
        generators = self.input_batch.generators
        for i in saved:
            del generators[i]  # upstream's rewind would ask this CPU generator for an offset
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            for i, (gen, state) in saved.items():
                gen.set_state(state)
                generators[i] = gen
            self._discarded_generator_states = {}

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        if self.device.type == "cpu":
            return sampled_token_ids.tolist()
        return super()._to_list(sampled_token_ids)

    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, **kwargs) -> None:
        refuse_plane_blind_connector(self.vllm_config, is_profiling)
        super().initialize_kv_cache(kv_cache_config, is_profiling=is_profiling, **kwargs)

    # -- memory profiling with attention -------------------------------------------------
    def profile_run(self, randomize_inputs: bool = False) -> None:
        """Upstream's profile forward with attention (``worker/profiling.py``), with the
        NPU kernels only: the reference kernels in host emulation have nothing to size."""
        if not npu_kernels():
            return super().profile_run(randomize_inputs)
        profiling.init_profiling_kv_cache(self, self._profile_split(self.max_num_tokens))
        try:
            self._profiling_with_attention = True
            super().profile_run(randomize_inputs)
        finally:
            self._profiling_with_attention = False
            self._cleanup_profiling_kv_cache()

    def _profile_split(self, num_tokens: int) -> list[int]:
        # The request split upstream's _dummy_run uses for a prefill batch.
        num_reqs = min(num_tokens, self.scheduler_config.max_num_seqs)
        split = [num_tokens // num_reqs] * num_reqs
        split[-1] += num_tokens % num_reqs
        return split

    def _dummy_run(self, num_tokens: int, *args, **kwargs):
        armed = self._dp_step is not None and self._dp_step.arm(
            dp_step.StepPlan(
                has_prefill=bool(kwargs.get("is_profile")),
                drafter_passes=self._drafter_passes(bool(kwargs.get("is_graph_capturing"))),
                drafter_first=num_tokens,
                drafter_rest=num_tokens,
            )
        )
        try:
            return self._npu_dummy_run(num_tokens, *args, **kwargs)
        finally:
            if armed:
                self._dp_step.disarm()

    def _npu_dummy_run(self, num_tokens: int, *args, **kwargs):
        if kwargs.get("is_profile") and getattr(self, "_profiling_with_attention", False):
            # Each dummy request attends over its own tokens (a prefill batch), not
            # over the whole batch length upstream uses for graph capture.
            kwargs["force_attention"] = True
            split = torch.tensor(self._profile_split(num_tokens), dtype=torch.int32)
            kwargs.setdefault("profile_seq_lens", split)
        return super()._dummy_run(num_tokens, *args, **kwargs)


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
