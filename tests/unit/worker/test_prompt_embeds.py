"""The Ascend V2 runner's prompt-embeddings state against a per-token loop.

Requests arrive as the scheduler sends them (``NewRequestData``: embeddings as a tensor,
the token-id mask of a mixed prompt as ``list[bool]``), in any slots, and steps schedule
chunks of them; the oracle walks every scheduled token in Python.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.ascend.worker.prompt_embeds import NPUPromptEmbedsState

HIDDEN = 4
MAX_REQS = 6


def _request(req_id: str, length: int, embedded: bool, mixed: list[bool] | None, seed: int):
    torch.manual_seed(seed)
    return SimpleNamespace(
        req_id=req_id,
        prompt_embeds=torch.randn(length, HIDDEN) if embedded else None,
        prompt_is_token_ids=mixed,
    )


def _oracle(new_reqs, computed, scheduled, inputs):
    out = inputs.clone()
    row = 0
    for req, done, count in zip(new_reqs, computed, scheduled, strict=True):
        for offset in range(count):
            position = done + offset
            embeds = req.prompt_embeds
            is_token = req.prompt_is_token_ids
            given = embeds is not None and position < embeds.shape[0]
            if given and (is_token is None or not is_token[position]):
                out[row] = embeds[position]
            row += 1
    return out


@st.composite
def _steps(draw):
    n = draw(st.integers(1, 4))
    slots = draw(st.permutations(range(MAX_REQS)))[:n]
    reqs, computed, scheduled = [], [], []
    for i in range(n):
        length = draw(st.integers(1, 9))
        embedded = draw(st.booleans())
        mixed = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=length, max_size=length)))
        reqs.append(_request(f"r{i}", length, embedded, mixed if embedded else None, seed=i))
        done = draw(st.integers(0, length))
        computed.append(done)
        scheduled.append(draw(st.integers(1, length - done + 2)))  # decode rows past the prompt too
    return reqs, list(slots), computed, scheduled


@settings(max_examples=60, deadline=None)
@given(_steps())
def test_the_scheduled_rows_take_the_given_embeddings_except_token_ids(step):
    reqs, slots, computed, scheduled = step
    state = NPUPromptEmbedsState(MAX_REQS, HIDDEN, torch.float32, torch.device("cpu"))
    for req, slot in zip(reqs, slots, strict=True):
        state.add_request(slot, req)
    state.apply_staged_writes()
    num_tokens = sum(scheduled)
    ends = torch.tensor(scheduled).cumsum(0)
    batch = SimpleNamespace(
        num_reqs=len(reqs),
        num_tokens=num_tokens,
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(torch.int32),
        idx_mapping=torch.tensor(slots, dtype=torch.int32),
    )
    num_computed = torch.zeros(MAX_REQS, dtype=torch.int32)
    num_computed[slots] = torch.tensor(computed, dtype=torch.int32)
    inputs = torch.full((num_tokens + 3, HIDDEN), -7.0)  # padded rows stay as they are
    expected = _oracle(reqs, computed, scheduled, inputs)
    state.apply(batch, num_computed, inputs)
    assert torch.equal(inputs, expected)


def test_a_reused_slot_forgets_the_request_it_held():
    state = NPUPromptEmbedsState(MAX_REQS, HIDDEN, torch.float32, torch.device("cpu"))
    state.add_request(2, _request("a", 3, True, [False, True, False], seed=1))
    state.add_request(2, _request("b", 3, False, None, seed=2))
    state.apply_staged_writes()
    batch = SimpleNamespace(
        num_reqs=1,
        num_tokens=3,
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        idx_mapping=torch.tensor([2], dtype=torch.int32),
    )
    inputs = torch.zeros(3, HIDDEN)
    state.apply(batch, torch.zeros(MAX_REQS, dtype=torch.int32), inputs)
    assert not inputs.any()
