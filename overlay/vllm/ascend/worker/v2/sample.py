"""Upstream's V2 sampler (``vllm/v1/worker/gpu/sample/sampler.py``) with paths that cost
fewer device launches where the batch allows it.

On CUDA the Gumbel-max sampler is two Triton launches whatever the batch. Its torch form
on Ascend (``gumbel.gumbel_sample``) hashes a noise value for every vocabulary entry of
every row in some 140 device ops. Two paths avoid them:

- an all-greedy batch (the sampling states keep a host copy of each request's
  temperature) picks over the processed logits directly, by the rule the Gumbel sampler
  applies to a row without noise (``first_max_or_nan``: the first NaN, else the first
  maximum): the same tokens in a few ops. Greedy requests carry no top-k or top-p
  (``SamplingParams`` resets them), so the processed logits are upstream's too;
- with decode graphs on, a random batch of up to the largest captured request count
  replays the sampler from a graph (``gumbel_graphs.py``): the same form, the same tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.config.compilation import CUDAGraphMode
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.worker.gpu.sample.sampler import Sampler

from vllm.ascend.worker.v2.gumbel import first_max_or_nan
from vllm.ascend.worker.v2.gumbel_graphs import GumbelGraphs
from vllm.ascend.worker.v2.step_graphs import GREEDY, SamplingSources, random_kind


class NPUSampler(Sampler):
    def __init__(
        self, vllm_config, max_num_reqs: int, vocab_size: int, device: torch.device, *args, **kwargs
    ):
        super().__init__(vllm_config, max_num_reqs, vocab_size, device, *args, **kwargs)
        self.gumbel_graphs: GumbelGraphs | None = None
        compilation = vllm_config.compilation_config
        if compilation.cudagraph_mode != CUDAGraphMode.NONE and not vllm_config.model_config.enforce_eager:
            sizes = [n for n in compilation.decode_cudagraph_capture_request_sizes or () if n <= max_num_reqs]
            self.gumbel_graphs = GumbelGraphs(sizes, vocab_size, max_num_reqs, self.use_fp64_gumbel, device)

    def capture_graphs(self, profile_only: bool) -> int:
        """Capture the sampler's graphs; the device memory they take. For the memory
        profile they are measured and dropped, as the runner's own profile captures are."""
        graphs = self.gumbel_graphs
        if graphs is None:
            return 0
        taken = graphs.capture(log=not profile_only)
        if profile_only:
            graphs.release()
        return taken

    def all_greedy(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.all(self.sampling_states.temperature.np[idx_mapping_np] == 0.0))

    def graph_sampling_kind(self, idx_mapping_np: np.ndarray) -> str | None:
        """How the decode-step graphs may sample this batch (``step_graphs.py``): when its
        output is the sampled tokens and nothing else (no logprobs, NaN counts, sampling
        masks or trace replay) and no stage of upstream's processing runs but temperature,
        top-k and top-p (each skipped here by the host check upstream's stage skips by):
        ``"greedy"`` or one of the random kinds; else None."""
        idx = idx_mapping_np
        if (
            self.get_logprobs_dims(idx) is not None
            or self.compute_nans
            or self.return_sampling_mask
            or self.trace_replay_state is not None
        ):
            return None
        if self.all_greedy(idx):
            return GREEDY if not np.any(self.needs_logits_processing[idx]) else None
        logit_bias, penalties, bad_words, *custom = self.logits_processors
        thinking = self.thinking_budget_state
        states = self.sampling_states
        if (
            custom
            or np.any(logit_bias.use_logit_bias[idx])
            or np.any(penalties.use_penalty[idx])
            or np.any(bad_words.num_bad_words.np[idx] != 0)
            or (thinking.enabled and np.any(thinking.use_thinking_budget[idx]))
            or np.any(states.min_p.np[idx] != 0.0)
            or self.use_flashinfer
            or self.use_xpu_sampler
        ):
            return None
        return random_kind(
            bool(np.any(states.top_k.np[idx] != states.vocab_size)), bool(np.any(states.top_p.np[idx] != 1.0))
        )

    def sampling_sources(self) -> SamplingSources:
        states = self.sampling_states
        return SamplingSources(states.temperature.gpu, states.seeds.gpu, states.top_k.gpu, states.top_p.gpu)

    @property
    def logits_buffer(self) -> torch.Tensor | None:
        return self.gumbel_graphs.logits_buffer if self.gumbel_graphs is not None else None

    def sample(
        self,
        logits: torch.Tensor,
        expanded_idx_mapping: torch.Tensor,
        idx_mapping: torch.Tensor,
        idx_mapping_np: np.ndarray,
        pos: torch.Tensor,
        input_ids: torch.Tensor,
        expanded_local_pos: torch.Tensor,
        seq_lens_upper_bound_np: np.ndarray,
        return_logprobs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        args = (logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, input_ids)
        if not self.all_greedy(idx_mapping_np):
            return super().sample(*args, expanded_local_pos, seq_lens_upper_bound_np, return_logprobs)
        processed = self.apply_sampling_params(*args, expanded_local_pos, seq_lens_upper_bound_np)
        return first_max_or_nan(processed), processed

    def _sample_random(
        self,
        processed_logits: torch.Tensor,
        expanded_idx_mapping: torch.Tensor,
        idx_mapping_np: np.ndarray,
        pos: torch.Tensor,
        top_k: torch.Tensor | None,
        top_p: torch.Tensor | None,
        has_topp_only_rows: bool,
        use_fused_sampler: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        graphs = self.gumbel_graphs
        if use_fused_sampler or graphs is None or not graphs.covers(processed_logits.shape[0]):
            return super()._sample_random(
                processed_logits,
                expanded_idx_mapping,
                idx_mapping_np,
                pos,
                top_k,
                top_p,
                has_topp_only_rows,
                use_fused_sampler,
            )
        processed_logits = apply_top_k_top_p(
            processed_logits, top_k, top_p, has_topp_only_rows=has_topp_only_rows
        )
        states = self.sampling_states
        sampled = graphs.sample(
            processed_logits, expanded_idx_mapping, pos, states.temperature.gpu, states.seeds.gpu
        )
        return sampled, processed_logits
