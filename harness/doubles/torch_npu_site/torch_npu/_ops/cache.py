"""The contract double's CPU kernels for KV-cache writes: _npu_reshape_and_cache (ATB),
npu_scatter_nd_update_."""

from __future__ import annotations

import torch

from .._rules import require
from ._common import HALF_TYPES


# -- _npu_reshape_and_cache (ATB) --------------------------------------------------------------
def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    op = "_npu_reshape_and_cache"
    require(
        key.dim() == 3 and value.dim() == 3 and key.shape[:2] == value.shape[:2],
        op,
        "RAC.shapes",
        f"key {tuple(key.shape)} / value {tuple(value.shape)} must be [num_tokens, num_head, head_size]",
    )
    require(
        key_cache.dim() == 4
        and value_cache.dim() == 4
        and key_cache.shape[:3] == value_cache.shape[:3]
        and key_cache.shape[2:] == key.shape[1:]
        and value_cache.shape[2:] == value.shape[1:],
        op,
        "RAC.shapes",
        f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} must be "
        "[num_blocks, block_size, num_head, head_size] matching key/value",
    )
    require(
        slot_indices.dim() == 1
        and slot_indices.shape[0] == key.shape[0]
        and slot_indices.dtype == torch.int32,
        op,
        "RAC.shapes",
        f"slot_indices {tuple(slot_indices.shape)} {slot_indices.dtype}",
    )
    require(
        len({key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}) == 1
        and key.dtype in (*HALF_TYPES, torch.int8),
        op,
        "RAC.dtypes",
        f"{key.dtype}/{value.dtype}/{key_cache.dtype}/{value_cache.dtype}",
    )
    require(
        key_cache.is_contiguous() and value_cache.is_contiguous(),
        op,
        "RAC.cache_contiguous",
        "key_cache/value_cache must be contiguous",
    )
    capacity = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_indices.to(torch.int64)
    require(
        bool(((slots >= 0) & (slots < capacity)).all()),
        op,
        "PROJECT.valid_slots",
        f"slots outside [0, {capacity})",
    )
    key_cache.view(capacity, *key_cache.shape[2:])[slots] = key
    value_cache.view(capacity, *value_cache.shape[2:])[slots] = value
    return None


# -- npu_scatter_nd_update_ ----------------------------------------------------------------------
def npu_scatter_nd_update_(input, indices, updates):
    op = "npu_scatter_nd_update_"
    require(
        indices.dim() >= 2 and indices.shape[-1] <= input.dim(),
        op,
        "SNU.indices",
        f"indices {tuple(indices.shape)} for input of rank {input.dim()}",
    )
    require(
        indices.dtype in (torch.int32, torch.int64), op, "SNU.indices_dtype", f"indices are {indices.dtype}"
    )
    depth = indices.shape[-1]
    require(
        tuple(updates.shape) == tuple(indices.shape[:-1]) + tuple(input.shape[depth:]),
        op,
        "SNU.updates_shape",
        f"updates {tuple(updates.shape)} for indices {tuple(indices.shape)} into {tuple(input.shape)}",
    )
    require(
        updates.dtype == input.dtype and 1 <= input.dim() <= 8,
        op,
        "SNU.dtype",
        f"input {input.dtype} rank {input.dim()}, updates {updates.dtype}",
    )
    require(input.is_contiguous(), op, "PROJECT.no_hidden_cache_copy", "the updated tensor is not contiguous")
    flat = indices.reshape(-1, depth).to(torch.int64)
    bounds = torch.tensor(input.shape[:depth])
    require(bool(((flat >= 0) & (flat < bounds)).all()), op, "SNU.indices_dtype", "an index is out of range")
    input[tuple(flat.unbind(1))] = updates.reshape(-1, *input.shape[depth:])
    return input
