"""Torch form of upstream's ``mm/rope.py`` kernel: the M-RoPE positions of a step."""

from __future__ import annotations

import torch

from vllm.ascend.kernels import request_of_token


def prepare_rope_positions(
    positions_ptr: torch.Tensor,
    positions_stride: int,
    prefill_positions_ptr: torch.Tensor,
    prefill_positions_stride0: int,
    prefill_positions_stride1: int,
    prefill_delta_ptr: torch.Tensor,
    idx_mapping_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    prefill_lens_ptr: torch.Tensor,
    num_computed_tokens_ptr: torch.Tensor,
    BLOCK_SIZE: int,
    NUM_DIMS: int,
    **launch: object,
) -> None:
    """Each scheduled token's position per M-RoPE channel: the model's precomputed
    prefill positions while the request is in its prompt, then the plain position plus
    the request's delta. Rows past the batch keep their values."""
    num_reqs = idx_mapping_ptr.shape[0]
    if num_reqs == 0:
        return
    qsl = query_start_loc_ptr[: num_reqs + 1].to(torch.int64)
    width = positions_ptr.shape[1]
    rows, offset, inside = request_of_token(qsl[1:], width)
    req = idx_mapping_ptr.to(torch.int64)[rows]
    computed = num_computed_tokens_ptr[req].to(torch.int64)
    position = computed + offset
    in_prompt = computed < prefill_lens_ptr[req].to(torch.int64)
    decoded = position + prefill_delta_ptr[req].to(torch.int64)
    # (the request's table row; positions out of it belong to tokens that are not used)
    column = position.clamp(max=int(prefill_positions_stride1) - 1)
    table = prefill_positions_ptr.reshape(-1)
    for dim in range(int(NUM_DIMS)):
        flat = req * int(prefill_positions_stride0) + dim * int(prefill_positions_stride1) + column
        value = torch.where(in_prompt, table[flat].to(torch.int64), decoded)
        row = positions_ptr[dim]
        row.copy_(torch.where(inside, value.to(row.dtype), row))
