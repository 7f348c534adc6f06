"""Upstream's V2 sampler (``vllm/v1/worker/gpu/sample/sampler.py``) with a path that costs
fewer device launches where the batch allows it.

On CUDA the Gumbel-max sampler is two Triton launches whatever the batch. Its torch form
on Ascend (``gumbel.gumbel_sample``) hashes a noise value for every vocabulary
entry of every row (134 of a greedy step's 300 device ops in the step benchmark, NPU-path
mode) even where every request is greedy and the noise is thrown away. The host knows each
request's temperature (the sampling states keep a host copy), so an all-greedy batch picks
over the processed logits directly, by the rule the Gumbel sampler applies to a row without
noise (``first_max_or_nan``: the first NaN, else the first maximum): the same tokens in a
few ops. Greedy requests carry no top-k or top-p (``SamplingParams`` resets them), so the
processed logits are upstream's too.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.v1.worker.gpu.sample.sampler import Sampler

from vllm.ascend.worker.v2.gumbel import first_max_or_nan


class NPUSampler(Sampler):
    def all_greedy(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.all(self.sampling_states.temperature.np[idx_mapping_np] == 0.0))

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
