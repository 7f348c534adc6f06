"""Token -> KV-cache slot mapping (upstream computes it with a Triton kernel).

Same contract as ``vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel``: for
every scheduled token, ``block_table[req, pos // block] * block + pos % block``, pad
entries past the batch set to ``PAD_ID``. Under context parallelism the block index,
the owner and the offset come from ``vllm.ascend.context_parallel.placement`` (tokens
this rank does not own get ``PAD_ID``); the runner passes the PCP x DCP group as the
"total CP" world. Written with torch tensor ops, so it runs on the NPU (as device ops)
and on the host alike.
"""

from __future__ import annotations

import torch

from vllm.ascend.context_parallel.placement import block_and_offset, owner

KERNEL = "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"


def compute_slot_mapping(
    num_tokens,
    max_num_tokens,
    query_start_loc_ptr,
    positions_ptr,
    block_table_ptr,
    block_table_stride,
    slot_mapping_ptr,
    KV_CACHE_BLOCK_SIZE,
    TOTAL_CP_WORLD_SIZE,
    TOTAL_CP_RANK,
    CP_KV_CACHE_INTERLEAVE_SIZE,
    PAD_ID,
    BLOCK_SIZE,
):
    num_tokens = int(num_tokens)
    slot_mapping_ptr[num_tokens : int(max_num_tokens)] = PAD_ID
    if num_tokens == 0:
        return
    qsl = query_start_loc_ptr.to(torch.int64)
    counts = qsl[1:] - qsl[:-1]
    req_of_token = torch.repeat_interleave(
        torch.arange(counts.numel(), device=qsl.device), counts, output_size=num_tokens
    )
    pos = positions_ptr[:num_tokens].to(torch.int64)
    cp, interleave = TOTAL_CP_WORLD_SIZE, CP_KV_CACHE_INTERLEAVE_SIZE
    is_local = owner(pos, cp, interleave) == TOTAL_CP_RANK
    block_index, local_offset = block_and_offset(pos, KV_CACHE_BLOCK_SIZE, cp, interleave)
    table = block_table_ptr.reshape(-1, int(block_table_stride))
    blocks = table[req_of_token, block_index].to(torch.int64)
    slots = blocks * KV_CACHE_BLOCK_SIZE + local_offset
    slot_mapping_ptr[:num_tokens] = torch.where(is_local, slots, torch.full_like(slots, PAD_ID))


def register_slot_mapping_override() -> None:
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({KERNEL: compute_slot_mapping})
