"""The Ascend sampler (worker/v2/sample.py) against upstream's own V2 sampler, both built
here on the same logits: an all-greedy batch takes the Ascend path (a pick over the
processed logits, no noise) and must choose what upstream's Gumbel sampler chooses,
ties, NaN and infinite logits and logits processors included; a batch with a random
request takes upstream's path, seeded, unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.worker.gpu.sample.sampler import Sampler
from vllm.v1.worker.gpu.states import RequestState

from vllm.ascend.platform.npu import NPUPlatform
from vllm.ascend.worker.v2.sample import NPUSampler

VOCAB = 3000  # three of the Gumbel sampler's 1024-wide blocks
REQUESTS = 6


@pytest.fixture(scope="module", autouse=True)
def _torch_forms():
    NPUPlatform.register_triton_kernel_overrides()  # upstream's Triton kernels -> torch forms (once)


def _sampler(cls, params: list[SamplingParams]):
    states = RequestState(REQUESTS, 64, 64, 0, VOCAB, torch.device("cpu"))
    sampler = cls(VllmConfig(), REQUESTS, VOCAB, torch.device("cpu"), states)
    for i, p in enumerate(params):
        sampler.add_request(i, p)
    sampler.apply_staged_writes()
    return sampler


def _sample(sampler, logits: torch.Tensor) -> torch.Tensor:
    n = logits.shape[0]
    index = torch.arange(n, dtype=torch.int32)
    sampled, _ = sampler.sample(
        logits.clone(),
        index,
        index,
        index.numpy(),
        torch.arange(n, dtype=torch.int64) + 17,  # positions (the noise's counter)
        torch.zeros(n, dtype=torch.int64),
        torch.zeros(n, dtype=torch.int64),
        np.full(n, 32, dtype=np.int32),
    )
    return sampled


def _logits() -> torch.Tensor:
    logits = torch.randn(REQUESTS, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[1, [5, 2500]] = 50.0  # a tie across blocks: the first
    logits[2, [40, 900]] = float("nan")  # NaN wins, the first one
    logits[3, 7] = float("inf")
    logits[3, 2048] = float("nan")  # NaN before an earlier +inf still wins
    logits[4, :] = -float("inf")
    logits[4, 1999] = 0.0
    return logits


GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize(
    "params",
    [
        [GREEDY] * REQUESTS,
        [SamplingParams(temperature=0.0, logit_bias={11: 100.0})] + [GREEDY] * (REQUESTS - 1),
        [SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)] * REQUESTS,
    ],
    ids=["greedy", "greedy-logit-bias", "greedy-penalties"],
)
def test_an_all_greedy_batch_picks_what_upstream_s_sampler_picks(params):
    ours, theirs = _sampler(NPUSampler, params), _sampler(Sampler, params)
    assert ours.all_greedy(np.arange(REQUESTS))
    logits = _logits()
    got, want = _sample(ours, logits), _sample(theirs, logits)
    assert got.tolist() == want.tolist()
    assert got[1] == 5 and got[2] == 40 and got[3] == 2048 and got[4] == 1999
    if params[0].logit_bias:
        assert got[0] == 11


def test_a_batch_with_a_random_request_takes_upstream_s_path_seeded():
    params = [GREEDY] * (REQUESTS - 1) + [SamplingParams(temperature=0.9, seed=5)]
    ours, theirs = _sampler(NPUSampler, params), _sampler(Sampler, params)
    assert not ours.all_greedy(np.arange(REQUESTS))
    logits = _logits()
    assert _sample(ours, logits).tolist() == _sample(theirs, logits).tolist()
