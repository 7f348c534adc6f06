"""The memory profile's dummy batch (``vllm/ascend/worker/profiling.py``) against what Model
Runner V2's ``_dummy_run`` runs: the same request lengths, with and without a speculator."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.ascend.worker import profiling


@pytest.mark.parametrize(
    "tokens,reqs,speculator,slots,expected",
    [
        (8192, 16, None, 0, [512] * 16),
        (130, 4, None, 0, [32, 32, 33, 33]),
        (3, 8, None, 0, [1, 1, 1]),
        # MTP: one query per request, no extra rows
        (8192, 16, SimpleNamespace(num_query_per_req=1), 0, [512] * 16),
        # a drafter with 1 + 2 queries per request: room for two extra rows each
        (8192, 16, SimpleNamespace(num_query_per_req=3), 2, [510] * 16),
        (20, 16, SimpleNamespace(num_query_per_req=3), 2, [1, 1, 1, 1, 2, 2]),
    ],
)
def test_dummy_split_is_v2s(tokens, reqs, speculator, slots, expected):
    assert profiling.dummy_split(tokens, reqs, speculator, slots) == expected
