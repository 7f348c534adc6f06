"""Torch forms of upstream's ``model_states/mamba_hybrid.py`` kernels: the accepted
counts the hybrid (attention + linear attention) models' state reads.
"""

from __future__ import annotations

import torch

from vllm.ascend.worker.v2.input_batch import masked_set


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
    masked_set(num_accepted_ptr, (rows.clamp(min=0),), value, rows >= 0)


def fill_num_accepted(
    idx_mapping_ptr: torch.Tensor, num_accepted_ptr: torch.Tensor, num_sampled: int, **launch: object
) -> None:
    rows = idx_mapping_ptr.to(torch.int64)
    masked_set(num_accepted_ptr, (rows.clamp(min=0),), torch.full_like(rows, num_sampled), rows >= 0)
