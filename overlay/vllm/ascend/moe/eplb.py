"""Expert-parallel load balancing (EPLB) on the Ascend MoE layers.

Upstream's EPLB (``vllm/distributed/eplb``) owns the state: per MoE layer a map from
each logical expert to its physical replicas, the replica counts, a load window, and the
rearrangement that moves expert weights between EP ranks in place (same parameters, new
contents, so a captured decode graph stays valid) and rewrites the maps in place. Its
router maps and records in a Triton kernel, which this platform does not have; the
Ascend methods route themselves (monolithic), so they call ``map_to_physical`` after
routing. From there every strategy and expert kernel works on physical ids, exactly as
without EPLB: the physical experts are placed over the EP ranks as the layer's expert
map says (linear by default), and the redundant replicas are simply more experts.
"""

from __future__ import annotations

import torch

from vllm.distributed.eplb.eplb_state import EplbLayerState
from vllm.v1.worker.ubatching import dbo_current_ubatch_id

# The replica a token takes: upstream's router hashes the token's row with Knuth's
# multiplier, so the rows of a batch spread over an expert's replicas.
_KNUTH = 2654435769
_LOW_32_BITS = 0xFFFFFFFF


def layer_eplb_state(vllm_config, layer_name: str) -> EplbLayerState | None:
    """The EPLB state of the MoE layer ``layer_name`` (None without EPLB). Upstream keeps it
    on the layer's router, which a monolithic method never calls; the layer's runner is
    registered under its name in the static forward context."""
    if not vllm_config.parallel_config.enable_eplb:
        return None
    runner = vllm_config.compilation_config.static_forward_context.get(layer_name)
    return getattr(runner, "eplb_state", None)


def map_to_physical(topk_ids: torch.Tensor, state: EplbLayerState) -> torch.Tensor:
    """Each routed (token, logical expert) as one of that expert's physical replicas, and,
    while EPLB records, the real tokens' routes counted in the layer's load pass.

    Plain torch ops on fixed shapes: no host read, so a decode graph captures them, and a
    rearrangement (which rewrites the maps in place) takes effect in the next replay.
    Routes outside ``[0, logical experts)`` map to -1 and are not counted."""
    to_physical = state.logical_to_physical_map  # [logical, max replicas]
    replicas = state.logical_replica_count  # [logical]
    load = state.expert_load_view  # [physical] int32
    if to_physical is None or replicas is None or load is None or state.should_record_tensor is None:
        raise RuntimeError("EPLB: the layer's maps are not set (EplbState.add_model has not run)")
    ids = topk_ids.to(torch.int64)
    valid = (ids >= 0) & (ids < replicas.shape[0])
    logical = torch.where(valid, ids, 0)
    row = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
    replica = ((row * _KNUTH) & _LOW_32_BITS) % replicas[logical]
    physical = torch.where(valid, to_physical[logical, replica], -1)

    record = valid & state.should_record_tensor
    unpadded = state.num_unpadded_tokens_tensors
    if unpadded is not None:
        record = record & (row < unpadded[dbo_current_ubatch_id()])  # graph/DP padding rows
    load.scatter_add_(0, torch.where(record, physical, 0).reshape(-1), record.reshape(-1).to(load.dtype))
    return physical.to(topk_ids.dtype)
