"""Exact host sequence lengths for a step under asynchronous scheduling with drafts.

The Ascend attention kernels take each request's sequence length from the host (the fused
attention's ``actual_seq_lengths_kv`` is a host list, and a decode graph's update takes the
same list). Model Runner V2's host copy of them (``seq_lens_cpu_upper_bound``) comes from
the scheduler's counts, which under asynchronous scheduling assume that every draft of the
step before was accepted: an upper bound, too long by that step's rejections. The device
has the exact lengths (``input_batch.seq_lens``, from its own computed-token counts, which
the step before corrected by its rejections in stream order).

``ExactHostSeqLens`` copies them over the host copy once per step, after the step's inputs
are prepared and before its attention metadata is built: one small non-blocking copy and a
wait on its event. That is the step's one wait, and it comes after the host has scheduled
and prepared the step while the device was finishing the one before.

A drafter's decode steps (MTP, EAGLE, a draft model) start from the target step's lengths,
which count every draft of the step, accepted or not; the device takes the rejected ones
off. ``draft_decode_host_seq_lens`` does the same on the host, from the rejected counts
the verification just made (one more small copy and wait, with drafts of two or more
tokens only: a single draft has no later step). Without it, those steps' attention spans
the rejected drafts' slots: the target still verifies every draft, so the output stays
exact, but the later drafts are made from the wrong context. The host arithmetic is
numpy's, on views of the host tensors: no tensor op to dispatch for a few integers.
"""

from __future__ import annotations

import torch

from vllm.utils.platform_utils import is_pin_memory_available


class ExactHostSeqLens:
    def __init__(self, max_num_reqs: int, device_layer) -> None:
        self._host = torch.zeros(max_num_reqs, dtype=torch.int32, pin_memory=is_pin_memory_available())
        self._copied = device_layer.event()

    def apply(self, input_batch) -> None:
        """Overwrite ``input_batch.seq_lens_cpu_upper_bound[:num_reqs]`` with the device's
        exact lengths (waits for them)."""
        n = input_batch.num_reqs
        if n == 0:
            return
        self._host[:n].copy_(input_batch.seq_lens[:n], non_blocking=True)
        self._copied.record()
        self._copied.synchronize()
        input_batch.seq_lens_cpu_upper_bound.numpy()[:n] = self._host.numpy()[:n]


def draft_decode_host_seq_lens(
    seq_lens_cpu_upper_bound: torch.Tensor, num_rejected: torch.Tensor, num_reqs: int, device_layer
) -> torch.Tensor:
    """The target step's host lengths less each request's rejected drafts (waits for the
    rejected counts); rows past ``num_reqs`` as they were."""
    if num_reqs == 0:
        return seq_lens_cpu_upper_bound
    rejected = torch.empty(num_reqs, dtype=num_rejected.dtype, pin_memory=is_pin_memory_available())
    rejected.copy_(num_rejected[:num_reqs], non_blocking=True)
    copied = device_layer.event()
    copied.record()
    copied.synchronize()
    exact = seq_lens_cpu_upper_bound.numpy().copy()
    exact[:num_reqs] -= rejected.numpy().astype(exact.dtype)
    return torch.from_numpy(exact)
