"""Random sampling through the runner's sampler keeps the distribution it promises: the
tokens drawn over many seeded requests against the exact temperature / top-k / top-p
distribution that transformers' own logits warpers make of a tiny transformers model's
next-token logits (an oracle that shares no code with vLLM), by a chi-square test; and the
same seed draws the same token whatever else is in the batch.

The sampler is upstream's V2 ``Sampler`` with every Triton kernel routed to this
distribution's torch forms (``worker/v2/gumbel.py``, ``worker/v2/logits_processing.py``), as the
runner builds it (``worker/v2/sample.NPUSampler``). Each test runs with fixed seeds, so it
is deterministic; a correct sampler fails the goodness-of-fit check with probability
``FALSE_ALARM`` over the choice of seeds. The same draws compared with a distribution at
a wrong temperature or without top-p must fail it, which shows the test has the power to
see such errors.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import (
    Qwen2Config,
    Qwen2ForCausalLM,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.worker.gpu.sample.sampler import Sampler
from vllm.v1.worker.gpu.spec_decode.draft_logits import DraftLogitsCache
from vllm.v1.worker.gpu.states import RequestState

from vllm.ascend.platform.npu import NPUPlatform
from vllm.ascend.worker.v2.rejection_sampler import NPURejectionSampler
from vllm.ascend.worker.v2.sample import NPUSampler

VOCAB = 1500  # two of the Gumbel sampler's 1024-wide blocks
DRAWS = 4000  # requests, one draw each, each with its own seed
TEMPERATURE, TOP_K, TOP_P = 0.8, 50, 0.8
FALSE_ALARM = 1e-3  # the p-value below which the fit is rejected
MIN_EXPECTED = 5.0  # chi-square bins with fewer expected draws are pooled


@pytest.fixture(scope="module", autouse=True)
def _torch_forms():
    NPUPlatform.register_triton_kernel_overrides()  # upstream's Triton kernels -> torch forms (once)


def tiny_qwen2_logits(prompt: list[int], rows: int, seed: int) -> torch.Tensor:
    """A tiny random Qwen2's logits at the prompt's last ``rows`` positions (weights wide
    enough that the distribution is far from uniform)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -rows:].float()


@pytest.fixture(scope="module")
def hf_logits() -> torch.Tensor:
    """The next-token logits for a short prompt."""
    return tiny_qwen2_logits([3, 141, 59, 26, 535], 1, seed=0)[0]


def exact_distribution(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None):
    """transformers' warpers, in generate's order (temperature, top-k, top-p), then softmax."""
    scores = logits[None].clone()
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p else []
    for warper in warpers:
        scores = warper(None, scores)
    return torch.softmax(scores[0].double(), dim=-1)


def fit_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit of ``counts`` to ``probs`` (bins with fewer than
    MIN_EXPECTED expected draws pooled into one); the p-value from chi2's survival function,
    the regularised upper incomplete gamma. Draws where ``probs`` is 0 give p = 0."""
    total = counts.sum().double()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs * total
    big = expected >= MIN_EXPECTED
    observed = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2.0))


def npu_sampler(params: list[SamplingParams]) -> NPUSampler:
    states = RequestState(len(params), 64, 64, 0, VOCAB, torch.device("cpu"))
    sampler = NPUSampler(VllmConfig(), len(params), VOCAB, torch.device("cpu"), states)
    for i, p in enumerate(params):
        sampler.add_request(i, p)
    sampler.apply_staged_writes()
    return sampler


def draw_tokens(
    sampler: NPUSampler, logits: torch.Tensor, requests: list[int], position: int = 9
) -> torch.Tensor:
    """One token for each of ``requests`` (state rows), every row showing ``logits``."""
    n = len(requests)
    index = torch.tensor(requests, dtype=torch.int32)
    sampled, _ = sampler.sample(
        logits[None].expand(n, -1).clone(),
        index,
        index,
        index.numpy(),
        torch.full((n,), position, dtype=torch.int64),
        torch.zeros(n, dtype=torch.int64),
        torch.zeros(n, dtype=torch.int64),
        np.full(n, 32, dtype=np.int32),
    )
    return sampled[:, 0] if sampled.dim() == 2 else sampled


def seeded_params(seed: int, **overrides) -> SamplingParams:
    return SamplingParams(
        **{"temperature": TEMPERATURE, "top_k": TOP_K, "top_p": TOP_P, "seed": seed, **overrides}
    )


@pytest.fixture(scope="module")
def draws(hf_logits) -> torch.Tensor:
    sampler = npu_sampler([seeded_params(1000 + i) for i in range(DRAWS)])
    assert not sampler.all_greedy(np.arange(DRAWS))  # upstream's random path, our torch forms
    return torch.bincount(draw_tokens(sampler, hf_logits, list(range(DRAWS))).long(), minlength=VOCAB)


def test_seeded_draws_follow_transformers_temperature_top_k_top_p_distribution(hf_logits, draws):
    want = exact_distribution(hf_logits, TEMPERATURE, TOP_K, TOP_P)
    support = int((want > 0).sum())
    assert 5 < support < TOP_K, f"top-p should cut inside top-k here, support {support}"
    assert float(want.max()) < 0.5, "the oracle distribution is too peaked to test anything"
    p = fit_p_value(draws, want)
    print(f"{DRAWS} draws over a support of {support} tokens (top {float(want.max()):.3f}): p = {p:.3f}")
    assert p > FALSE_ALARM, f"chi-square p = {p:.2e} over {DRAWS} draws, support {support}"


@pytest.mark.parametrize(
    "wrong",
    [
        {"temperature": 1.0, "top_k": TOP_K, "top_p": TOP_P},
        {"temperature": 0.6, "top_k": TOP_K, "top_p": TOP_P},
        {"temperature": TEMPERATURE, "top_k": TOP_K, "top_p": None},
    ],
    ids=["hotter", "colder", "no-top-p"],
)
def test_the_same_draws_reject_a_wrong_distribution(hf_logits, draws, wrong):
    """The power of the check: the draws above are far from what a sampler with a wrong
    temperature or a missing top-p would produce."""
    p = fit_p_value(draws, exact_distribution(hf_logits, **wrong))
    print(f"against {wrong}: p = {p:.2e}")
    assert p < FALSE_ALARM**2


def test_a_seed_draws_the_same_token_whatever_the_batch_holds(hf_logits):
    """Request 0's draw alone, first in a batch of others, last in it (other seeds, a greedy
    request, other sampling settings): the same token each time, for several seeds."""
    for seed in (7, 8, 9):
        params = [
            seeded_params(seed),
            seeded_params(seed + 100),
            SamplingParams(temperature=0.0),
            seeded_params(seed + 200, top_k=0, top_p=0.5, temperature=1.3),
        ]
        sampler = npu_sampler(params)
        alone = draw_tokens(sampler, hf_logits, [0])
        first = draw_tokens(sampler, hf_logits, [0, 1, 2, 3])
        last = draw_tokens(sampler, hf_logits, [3, 2, 1, 0])
        assert int(alone[0]) == int(first[0]) == int(last[3]), seed


# -- MTP verification with random sampling ---------------------------------------------
K = 1  # one draft per request: a verified row and a bonus row


def _rejection_sampler(params: list[SamplingParams]) -> NPURejectionSampler:
    states = RequestState(len(params), 64, 64, K, VOCAB, torch.device("cpu"))
    sampler = Sampler(VllmConfig(), len(params), VOCAB, torch.device("cpu"), states, num_speculative_tokens=K)
    for i, p in enumerate(params):
        sampler.add_request(i, p)
    sampler.apply_staged_writes()
    spec = SimpleNamespace(
        num_speculative_tokens=K,
        enable_adaptive_verification=False,
        rejection_sample_method="standard",
        synthetic_acceptance_rates=None,
        fly_window_size=None,
        fly_entropy_threshold=0.3,
        fly_entropy_top_k=3,
    )
    return NPURejectionSampler(sampler, spec, torch.device("cpu"))


@pytest.fixture(scope="module")
def verified(hf_logits_two) -> dict:
    """DRAWS requests, each with one draft drawn from a draft distribution q (the target's
    logits plus noise, at the same temperature) and its target rows (the draft's position,
    the bonus position): the tokens the rejection sampler emits."""
    target, bonus = hf_logits_two
    gen = torch.Generator().manual_seed(5)
    draft_logits = target + torch.randn(VOCAB, generator=gen) * 1.5
    q = torch.softmax(draft_logits / TEMPERATURE, dim=-1)
    drafts = torch.multinomial(q, DRAWS, replacement=True, generator=gen)
    params = [seeded_params(3000 + i, top_k=0, top_p=1.0) for i in range(DRAWS)]
    sampler = _rejection_sampler(params)
    assert not sampler.greedy_path(np.arange(DRAWS))  # upstream's random walk, our torch forms
    cache = DraftLogitsCache(DRAWS, K, VOCAB, dtype=torch.float32, fill=0.0, device="cpu")
    cache.values[:, 0] = draft_logits
    rows = 2 * DRAWS
    logits = torch.stack([target, bonus]).repeat(DRAWS, 1)
    draft_sampled = torch.zeros(rows, dtype=torch.int64)
    draft_sampled[1::2] = drafts  # row i + 1 holds row i's draft
    idx = torch.arange(DRAWS, dtype=torch.int32)
    _, sampled, num_sampled = sampler._verify(
        logits,
        cache,
        draft_sampled,
        torch.arange(rows, dtype=torch.int64) % 2 + 20,  # each request's two positions
        torch.arange(0, rows + 1, 2, dtype=torch.int32),
        idx,
        idx.numpy(),
        idx.repeat_interleave(2),
        torch.arange(rows) % 2,
        np.full(DRAWS, 40, dtype=np.int32),
    )
    return {"drafts": drafts, "sampled": sampled, "num_sampled": num_sampled}


@pytest.fixture(scope="module")
def hf_logits_two() -> tuple[torch.Tensor, torch.Tensor]:
    """The logits at the prompt's last two positions: two target rows."""
    target, bonus = tiny_qwen2_logits([3, 141, 59, 26, 535, 9], 2, seed=1)
    return target, bonus


def test_mtp_verification_keeps_the_target_distribution(hf_logits_two, verified):
    """Rejection sampling's guarantee: whatever the drafts' distribution, the first token
    emitted follows the target's, and a bonus token (after an accepted draft) follows the
    bonus row's; the draft distribution itself is rejected by the same check."""
    target, bonus = hf_logits_two
    first = verified["sampled"][:, 0].long()
    accepted = (first == verified["drafts"]) & (verified["num_sampled"] == 2)
    rate = float(accepted.double().mean())
    assert 0.2 < rate < 0.9, f"acceptance {rate:.2f}: both branches of the walk should run"
    want = exact_distribution(target, TEMPERATURE, None, None)
    p_first = fit_p_value(torch.bincount(first, minlength=VOCAB), want)
    bonus_tokens = verified["sampled"][accepted, 1].long()
    p_bonus = fit_p_value(
        torch.bincount(bonus_tokens, minlength=VOCAB), exact_distribution(bonus, TEMPERATURE, None, None)
    )
    p_drafts = fit_p_value(torch.bincount(verified["drafts"], minlength=VOCAB), want)
    print(
        f"acceptance {rate:.3f}; p first = {p_first:.3f}, bonus = {p_bonus:.3f} ({len(bonus_tokens)} draws), "
        f"drafts vs target = {p_drafts:.2e}"
    )
    assert p_first > FALSE_ALARM
    assert p_bonus > FALSE_ALARM
    assert p_drafts < FALSE_ALARM**2  # the drafts alone do not follow the target: verification did the work
