"""Torch form of upstream's ``buffer_utils.py`` kernel: the staged writes into the
runner's persistent state tensors.
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import request_of_token


def apply_write(
    output_ptr: torch.Tensor,
    output_stride: int,
    write_indices_ptr: torch.Tensor,
    write_starts_ptr: torch.Tensor,
    write_contents_ptr: torch.Tensor,
    write_cu_lens_ptr: torch.Tensor,
    write_group_ids_ptr: torch.Tensor,
    BLOCK_SIZE: int | None = None,
    MULTI_GROUP: bool = False,
    **launch: object,
) -> None:
    if MULTI_GROUP:
        # tables of data pointers: vllm.ascend.worker.block_tables applies each group alone
        raise NotImplementedError("the multi-group staged write reads raw pointers; apply each group alone")
    num_writes = write_indices_ptr.shape[0]
    size = write_contents_ptr.shape[0]
    if num_writes == 0 or size == 0:
        return
    writes, offset, _ = request_of_token(write_cu_lens_ptr[:num_writes], size)
    col = write_starts_ptr[writes].to(torch.int64) + offset
    flat = write_indices_ptr[writes].to(torch.int64) * int(output_stride) + col
    output_ptr.view(-1).index_put_((flat,), write_contents_ptr.to(output_ptr.dtype))
