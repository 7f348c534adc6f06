"""Data parallelism served end to end in host emulation (gloo): `vllm serve
--data-parallel-size 2` with the tiny DeepSeek-V3 (MoE + MLA, expert parallelism over the
two ranks, MTP k = 2) and with the tiny Qwen2 (dense), against Hugging Face transformers' greedy
tokens (which test_oracle and test_mtp hold DP = 1 to).

Every worker of the DeepSeek instance runs under the collective recorder
(``harness/doubles/collective_recorder``): the last test reads back what each rank issued and checks one
DP metadata collective per engine step (the drafter's steps included: Model Runner V2's
speculator does not coordinate again), and identical
collective sequences on both ranks, the idle rank's dummy steps included.

Both instances start once for the module, side by side.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.support import dp_collectives
from tests.support.engines import RUNNER_LINE, VllmServer, greedy_completion
from tests.support.oracle import hf_greedy
from tests.support.prompts import PROMPTS

MAX_TOKENS = 12
SINGLE_REQUEST_BOUND = 90  # seconds for one 12-token request; a DP hang never answers
IDLE_STEPS = 100
COMMON = ["--dtype", "float32", "--max-model-len", "512", "--seed", "0", "--data-parallel-size", "2"]
MTP_K = 2


@pytest.fixture(scope="module")
def servers(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    moe = [
        *COMMON,
        "--enable-expert-parallel",
        "--speculative-config",
        f'{{"method": "deepseek_mtp", "num_speculative_tokens": {MTP_K}}}',
    ]
    recorded = root / "collectives"
    started = {
        "moe": VllmServer(
            tiny_models["deepseek_v3"], moe, root / "moe.log", dp_collectives.recorder_env(recorded)
        )
    }
    started["moe"].recorded, started["moe"].model = recorded, tiny_models["deepseek_v3"]
    started["dense"] = VllmServer(tiny_models["qwen2"], COMMON, root / "dense.log")
    started["dense"].model = tiny_models["qwen2"]
    try:
        deadline = time.monotonic() + 900
        for server in started.values():
            server.wait(deadline)
        yield started
    finally:
        for server in started.values():
            server.stop()
    for name, server in started.items():
        # up to the shutdown: with DP, an API server may log EngineDeadError while the
        # process manager stops the engine cores (upstream's shutdown order, not a fault)
        text = server.log.read_text().split("[shutdown]", 1)[0]
        assert "Traceback" not in text, f"{name}:\n{text[-4000:]}"


def _complete(server, prompt: str, max_tokens: int = MAX_TOKENS, timeout: float = 600) -> list[int]:
    return greedy_completion(server.url, server.model, prompt, max_tokens, timeout)


def test_each_instance_runs_the_ascend_runner(servers):
    for kind in ("moe", "dense"):
        text = servers[kind].log.read_text()
        assert RUNNER_LINE in text, kind
        # async with MTP too (worker/v2/seq_lens.py)
        assert "Ascend model runner scheduling: async\n" in text, kind


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_a_single_request_completes_within_a_bound(servers, kind):
    """Fewer requests than DP ranks: the idle rank must not hold the busy one up."""
    server = servers[kind]
    started = time.monotonic()
    try:
        got = _complete(server, PROMPTS[1], timeout=SINGLE_REQUEST_BOUND)
    except httpx.TimeoutException:
        pytest.fail(f"{kind}: one request on DP = 2 did not finish within {SINGLE_REQUEST_BOUND} s")
    print(f"DP=2 {kind}: one {MAX_TOKENS}-token request in {time.monotonic() - started:.1f} s")
    assert got == hf_greedy(server.model, PROMPTS[1:2], MAX_TOKENS)[0]


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_dp2_equals_transformers_for_concurrent_requests(servers, kind):
    server = servers[kind]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: _complete(server, p), PROMPTS))
    assert got == hf_greedy(server.model, PROMPTS, MAX_TOKENS)


def test_one_rank_idles_for_100_steps_while_the_other_serves(servers):
    """One long request: one rank decodes it, the other runs dummy steps all along. Both
    must take the same number of steps (lock step), at least 100, and the output must be
    right."""
    server = servers["moe"]
    dp_collectives.settle(server.recorded)
    before = dp_collectives.step_counts(server.recorded, 2)
    tokens = IDLE_STEPS + 20  # the tiny model's random MTP layer has its drafts mostly rejected
    got = _complete(server, PROMPTS[0], max_tokens=tokens)
    dp_collectives.settle(server.recorded)  # the ranks' last steps may still be being written
    after = dp_collectives.step_counts(server.recorded, 2)
    taken = {rank: after[rank] - before.get(rank, 0) for rank in after}
    print(f"DP=2 MoE + MTP k={MTP_K}: {tokens} tokens of one request took {taken} steps per rank")
    assert len(taken) == 2 and len(set(taken.values())) == 1, taken
    assert min(taken.values()) >= IDLE_STEPS, taken
    # every busy step emits at least one token of the request (and a wave ends with a few
    # idle steps): two metadata collectives per step would count twice the tokens
    assert max(taken.values()) < 2 * tokens, taken
    assert got == hf_greedy(server.model, PROMPTS[:1], tokens)[0]


def test_one_metadata_collective_per_step_and_identical_sequences(servers):
    """Runs after the others (module order): checks everything the instance did so far."""
    server = servers["moe"]
    _complete(server, PROMPTS[2])  # at least one step with the drafter after start-up
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    drafts = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode_num_drafts_total")
    )
    assert drafts > 0, "the drafter never ran: the check below would not cover its coordination"
    dp_collectives.settle(server.recorded)
    steps = dp_collectives.check(server.recorded, 2)
    print(f"DP=2 MoE + MTP k={MTP_K}: {steps} steps per rank, one DP metadata collective each")
