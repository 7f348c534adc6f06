"""``moe/eplb.py``: logical routes to physical replicas and the load they record, against a
brute-force reading of upstream's rule (the token's row hashed with Knuth's multiplier picks
the replica; only real rows count, and only while recording is on)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.moe_ranks import eplb_layer_state


def _brute_force(ids, physical_to_logical, unpadded, recording):
    replicas = {}
    for slot, logical in enumerate(physical_to_logical.tolist()):
        replicas.setdefault(logical, []).append(slot)
    mapped = []
    load = [0] * len(physical_to_logical)
    for row, routes in enumerate(ids.tolist()):
        out = []
        for logical in routes:
            if logical not in replicas:
                out.append(-1)
                continue
            choices = replicas[logical]
            slot = choices[((row * 2654435769) % 2**32) % len(choices)]
            out.append(slot)
            if recording and row < unpadded:
                load[slot] += 1
        mapped.append(out)
    return torch.tensor(mapped, dtype=torch.int32).reshape(ids.shape), torch.tensor(load, dtype=torch.int32)


@settings(max_examples=60, deadline=None)
@given(
    logical=st.integers(2, 9),
    redundant=st.integers(0, 6),
    tokens=st.integers(0, 40),
    top_k=st.integers(1, 2),
    padding=st.integers(0, 5),
    recording=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_map_to_physical_is_upstreams_rule(logical, redundant, tokens, top_k, padding, recording, seed):
    from vllm.ascend.moe.eplb import map_to_physical

    g = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, logical, (redundant,), generator=g)
    placement = torch.cat([torch.arange(logical), extra])[torch.randperm(logical + redundant, generator=g)]
    rows = tokens + padding
    ids = torch.rand(rows, logical, generator=g).argsort(dim=1)[:, :top_k].to(torch.int32)
    if rows:
        ids[0, 0] = -1  # a route upstream's zero-expert routers leave out: maps to -1, not counted
    state = eplb_layer_state(placement, tokens)
    state.should_record_tensor.fill_(recording)
    expected_ids, expected_load = _brute_force(ids, placement, tokens, recording)
    got = map_to_physical(ids, state)
    assert got.dtype == ids.dtype and torch.equal(got, expected_ids)
    assert torch.equal(state.expert_load_view, expected_load)


def test_the_maps_are_read_at_each_call():
    """A rearrangement rewrites the maps in place; the next call (a graph's next replay
    reads the same tensors) routes by the new placement."""
    from vllm.ascend.moe.eplb import map_to_physical

    state = eplb_layer_state(torch.tensor([0, 1, 2, 3]), 4)
    ids = torch.tensor([[0], [3]], dtype=torch.int32)
    assert map_to_physical(ids, state).flatten().tolist() == [0, 3]
    state.logical_to_physical_map.copy_(torch.tensor([[3], [2], [1], [0]]))
    assert map_to_physical(ids, state).flatten().tolist() == [3, 0]


def test_unset_maps_are_a_clear_error():
    from vllm.distributed.eplb.eplb_state import EplbLayerState

    from vllm.ascend.moe.eplb import map_to_physical

    with pytest.raises(RuntimeError, match="add_model"):
        map_to_physical(torch.zeros((1, 1), dtype=torch.int32), EplbLayerState())
