"""The Ascend rejection sampler (worker/v2/rejection_sampler.py) against upstream's own,
both built here on the same verification batch: an all-greedy batch takes the Ascend path
(one pick per row, a walk over the drafts) and must emit upstream's tokens and counts
(every draft accepted, the first only, none, a placeholder draft, a request without
drafts, ties across vocab blocks, NaN rows); a batch with a random request, or synthetic
acceptance, takes upstream's path."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.worker.gpu.sample.sampler import Sampler
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler
from vllm.v1.worker.gpu.states import RequestState

from vllm.ascend.platform.npu import NPUPlatform
from vllm.ascend.worker.v2.rejection_sampler import NPURejectionSampler

VOCAB = 20000  # three of the verified rows' 8192-wide blocks
K = 2
# request -> how many drafts the target accepts (K + 1: a request with no drafts at all)
ACCEPTS = [2, 1, 0, 0, 2, None]


@pytest.fixture(scope="module", autouse=True)
def _torch_forms():
    NPUPlatform.register_triton_kernel_overrides()  # upstream's Triton kernels -> torch forms (once)


def _spec(method="standard", rates=None):
    return SimpleNamespace(
        num_speculative_tokens=K,
        enable_adaptive_verification=False,
        rejection_sample_method=method,
        synthetic_acceptance_rates=rates,
        fly_window_size=None,
        fly_entropy_threshold=0.3,
        fly_entropy_top_k=3,
    )


def _samplers(cls, params, spec):
    states = RequestState(len(params), 64, 64, K, VOCAB, torch.device("cpu"))
    sampler = Sampler(VllmConfig(), len(params), VOCAB, torch.device("cpu"), states, num_speculative_tokens=K)
    for i, p in enumerate(params):
        sampler.add_request(i, p)
    sampler.apply_staged_writes()
    return cls(sampler, spec, torch.device("cpu"))


def _batch():
    """Logits and drafts: request r has K + 1 rows (the last has one), its drafts equal to
    the target's greedy picks for the first ACCEPTS[r] steps, then a different token."""
    gen = torch.Generator().manual_seed(1)
    counts = [1 if a is None else K + 1 for a in ACCEPTS]
    rows = sum(counts)
    logits = torch.randn(rows, VOCAB, generator=gen)
    logits[0, [100, 9000]] = 40.0  # a tie across blocks: the first
    # NaN rows, where the block widths matter: a verified row (8192-wide blocks: the NaN
    # takes the 60 out with it) and a bonus row (1024-wide: the 60 is in the next block)
    logits[4, [5, 2000]] = torch.tensor([float("nan"), 60.0])
    logits[2, [17000, 17500]] = torch.tensor([float("nan"), 60.0])
    cu = torch.tensor([0, *np.cumsum(counts).tolist()], dtype=torch.int32)
    local = torch.cat([torch.arange(c) for c in counts])
    expanded = torch.cat([torch.full((c,), r) for r, c in enumerate(counts)]).to(torch.int32)
    return logits, cu, local, expanded


def _drafts(logits, cu, accepts, upstream_picks):
    """draft_sampled: row i + 1 holds row i's draft (row 0 of a request: its last sampled)."""
    drafts = torch.zeros(logits.shape[0], dtype=torch.int64)
    for r, a in enumerate(accepts):
        start = int(cu[r])
        for j in range(0 if a is None else K):
            pick = int(upstream_picks[start + j])
            drafts[start + j + 1] = pick if j < a else (pick + 1) % VOCAB
    drafts[int(cu[3]) + 1] = -1  # a placeholder draft
    return drafts


def _verify(sampler, logits, drafts, cu, local, expanded):
    n = len(ACCEPTS)
    idx = torch.arange(n, dtype=torch.int32)
    _, sampled, num_sampled = sampler._verify(
        logits.clone(),
        None,
        drafts,
        torch.arange(logits.shape[0], dtype=torch.int64) + 9,
        cu,
        idx,
        idx.numpy(),
        expanded,
        local,
        np.full(n, 40, dtype=np.int32),
    )
    counts = num_sampled.tolist()
    return counts, [sampled[r, : counts[r]].tolist() for r in range(n)]


def _picks(logits):
    """Upstream's greedy pick per row from its own sampler run with no drafts accepted."""
    picks = []
    for row in logits:
        finite = torch.where(torch.isnan(row), -float("inf"), row)
        picks.append(int(finite.argmax()))
    return picks


@pytest.mark.parametrize("temperature", [0.0])
def test_an_all_greedy_batch_verifies_as_upstream_s_rejection_sampler(temperature):
    params = [SamplingParams(temperature=temperature)] * len(ACCEPTS)
    ours, theirs = (
        _samplers(NPURejectionSampler, params, _spec()),
        _samplers(RejectionSampler, params, _spec()),
    )
    assert ours.greedy_path(np.arange(len(ACCEPTS)))
    logits, cu, local, expanded = _batch()
    drafts = _drafts(logits, cu, ACCEPTS, _picks(logits))
    want = _verify(theirs, logits, drafts, cu, local, expanded)
    got = _verify(ours, logits, drafts, cu, local, expanded)
    assert got == want
    counts, tokens = got
    assert counts == [3, 2, 1, 1, 3, 1]  # the acceptance the drafts were built for
    assert tokens[0][:1] == [100] and tokens[0][2] == 17500  # first of a tie; the bonus row
    assert tokens[1][1] != 2000  # the verified row's NaN block takes its 60 out


@pytest.mark.parametrize(
    "params, spec",
    [
        ([SamplingParams(temperature=0.0)] * 5 + [SamplingParams(temperature=0.8, seed=3)], _spec()),
        ([SamplingParams(temperature=0.0, seed=11)] * 6, _spec("synthetic", [1.0, 0.5])),
    ],
    ids=["a-random-request", "synthetic"],
)
def test_other_batches_take_upstream_s_path(params, spec):
    ours, theirs = _samplers(NPURejectionSampler, params, spec), _samplers(RejectionSampler, params, spec)
    assert not ours.greedy_path(np.arange(len(ACCEPTS)))
    logits, cu, local, expanded = _batch()
    drafts = _drafts(logits, cu, ACCEPTS, _picks(logits))
    assert _verify(ours, logits, drafts, cu, local, expanded) == _verify(
        theirs, logits, drafts, cu, local, expanded
    )
