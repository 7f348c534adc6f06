"""Torch form of upstream's ``cp_utils.py`` kernel: each request's tokens on this
decode-context-parallel rank (the placement rule of ``vllm.ascend.context_parallel``).
"""

from __future__ import annotations

import torch

from vllm.ascend.context_parallel.placement import local_count


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
