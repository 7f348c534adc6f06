"""P2P disaggregated prefill end to end, in host emulation, with real processes on 127.0.0.1:
``vllm serve`` prefill and decode instances with AscendP2PConnector (Mooncake over TCP),
the real proxy in front (``python -m vllm.ascend.kv_transfer.proxy``; upstream's
``vllm-router`` in front of one pair), and Hugging Face transformers' greedy generate as the
oracle. Every instance and the proxy share the deployment's secret (tests/conftest.py).

All instances start once, together, and serve every test:

* GQA (tiny Qwen2 with one KV head): prefill TP1 and PCP2, decode TP1 and TP2 x DCP2.
  Proxies over them give 2P1D (TP1 + PCP2 -> TP1), 1P2D (TP1 -> TP1 + TP2/DCP2) and the
  context-parallel pair PCP2 -> DCP2. The TP2/DCP2 decode recomputes on failed loads
  (``kv_load_failure_policy: recompute``), the TP1 decode fails them (the default).
* MLA + MoE with DeepSeek's sparse attention (tiny DeepSeek-V3.2: the latent, rope and
  indexer-key planes move; its indexer keeps fewer keys than a prompt has, so keys that
  did not arrive change the tokens): prefill TP2 + EP -> decode DP2 + EP.

Every proxy has a layer-wise twin (``-lw``: ``--layerwise``, each request sent to both
instances at once and the KV read layer by layer as the prefill writes it) over the same
instances, and the end-to-end cases run through both.

The fault cases run last: clients disconnect mid-stream (both modes); the PCP2 prefill is
killed after prefilling by hand (both decode policies) and while layer-wise requests are
in flight; then the TP1 decode instance is killed with requests of both modes in flight
(the TP1 prefill's KV-usage gauge shows its blocks coming back).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import msgspec
import pytest
import zmq

from harness.ports import free_port, free_ports
from tests.support.engines import RUNNER_LINE, VllmServer
from tests.support.models import QWEN2_KV1
from tests.support.oracle import hf_greedy

MAX_TOKENS = 12
# Twice the defaults: six instances share a 2-core CI machine, and before empty steps were
# paced (pacer.IdlePacer) prefill control planes were seen unanswered for 10-60 s
# there. Production hosts should keep the 30 s / 5 s defaults.
LEASE = 60
CONTROL_TIMEOUT = 20

GQA = {  # name -> (role, extra `vllm serve` arguments, control ports, extra kv-transfer-config keys)
    "p_tp1": ("kv_producer", [], 1, {}),
    "p_pcp2": ("kv_producer", ["--prefill-context-parallel-size", "2"], 2, {}),
    "d_tp1": ("kv_consumer", [], 1, {}),
    "d_dcp2": (
        "kv_consumer",
        ["--tensor-parallel-size", "2", "--decode-context-parallel-size", "2"],
        2,
        {"kv_load_failure_policy": "recompute"},
    ),
}
MLA = {
    "p_ds": ("kv_producer", ["--tensor-parallel-size", "2", "--enable-expert-parallel"], 2, {}),
    "d_ds": (
        "kv_consumer",
        ["--data-parallel-size", "2", "--enable-expert-parallel", "--api-server-count", "1"],
        2,
        {},
    ),
}
PROXIES = {
    "2p1d": (["p_tp1", "p_pcp2"], ["d_tp1"]),
    "1p2d": (["p_tp1"], ["d_tp1", "d_dcp2"]),
    "cp": (["p_pcp2"], ["d_dcp2"]),
    "ds": (["p_ds"], ["d_ds"]),
}
PROXIES.update({f"{name}-lw": pair for name, pair in list(PROXIES.items())})
PROXIES["1p1d-lw"] = (["p_tp1"], ["d_tp1"])


def _prompts(n: int, salt: str = "") -> list[str]:
    words = [
        "paged",
        "attention",
        "stores",
        "keys",
        "and",
        "values",
        "in",
        "blocks",
        "while",
        "decode",
        "produces",
        "one",
        "token",
        "at",
        "a",
        "time",
        "and",
        "prefill",
        "processes",
        "the",
        "whole",
        "prompt",
    ]
    return [
        f"{salt}Request {i}: " + " ".join(words[: 3 + (i * 5) % len(words)] * (1 + i % 3)) for i in range(n)
    ]


def _instance(model, name: str, spec, tmp) -> VllmServer:
    role, args, ranks, extra = spec
    kv_port = free_ports(ranks)
    config = {
        "kv_connector": "AscendP2PConnector",
        "kv_role": role,
        "kv_port": kv_port,
        "kv_connector_extra_config": {"lease_seconds": LEASE, "control_timeout": CONTROL_TIMEOUT},
        **extra,
    }
    server = VllmServer(
        model,
        [
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--seed",
            "0",
            "--block-size",
            "16",
            "--kv-transfer-config",
            json.dumps(config),
            *args,
        ],
        tmp / f"{name}.log",
    )
    server.kv_port, server.model = kv_port, model
    return server


class Proxy:
    def __init__(self, prefill: list[VllmServer], decode: list[VllmServer], log, layerwise: bool = False):
        import subprocess

        self.port, self.log = free_port(), log
        cmd = [
            sys.executable,
            "-m",
            "vllm.ascend.kv_transfer.proxy",
            "--prefill",
            *[i.url for i in prefill],
            "--decode",
            *[i.url for i in decode],
            "--port",
            str(self.port),
            "--cooldown",
            "2",
        ]
        if layerwise:
            cmd += ["--layerwise", "--prefill-kv", *[f"127.0.0.1:{i.kv_port}" for i in prefill]]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = prefill[0].model

    def wait(self) -> None:
        # its imports alone took over 60 s on 2 cores while another module started engines
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.url}/v1/models", timeout=2)
                return
            except httpx.HTTPError:
                time.sleep(0.5)
        pytest.fail(f"proxy did not start:\n{self.log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class Router(Proxy):
    """Upstream's ``vllm-router`` in its vLLM P/D mode (NIXL-style: the prefill instance's
    ``kv_transfer_params`` go to the decode instance as they are)."""

    def __init__(self, prefill: list[VllmServer], decode: list[VllmServer], log):
        import subprocess

        self.port, self.log = free_port(), log
        launch = [sys.executable, "-m", "vllm_router.launch_router"]  # the `vllm-router` command
        cmd = [*launch, "--vllm-pd-disaggregation", "--host", "127.0.0.1"]
        for server in prefill:
            cmd += ["--prefill", server.url]
        for server in decode:
            cmd += ["--decode", server.url]
        cmd += ["--port", str(self.port), "--worker-startup-check-interval", "1", "--policy", "round_robin"]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = prefill[0].model


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    servers = {}
    proxies = {}
    try:
        for model, specs in ((tiny_models[QWEN2_KV1], GQA), (tiny_models["deepseek_v32"], MLA)):
            for name, spec in specs.items():
                servers[name] = _instance(model, name, spec, tmp)
        deadline = time.monotonic() + 900
        for server in servers.values():
            server.wait(deadline)
        for name, (prefill, decode) in PROXIES.items():
            proxies[name] = Proxy(
                [servers[n] for n in prefill],
                [servers[n] for n in decode],
                tmp / f"proxy-{name}.log",
                layerwise=name.endswith("-lw"),
            )
        # the PCP2 prefill, killed by the dead-prefill case, takes what the router leaves held
        proxies["router"] = Router([servers["p_pcp2"]], [servers["d_tp1"]], tmp / "router.log")
        for proxy in proxies.values():
            proxy.wait()
        for proxy in proxies.values():  # first steps (DP MoE above all) are slow: not inside a test's lease
            asyncio.run(_complete(proxy.url, proxy.model, ["warm up"], broken_ok=True))
        yield {**servers, **proxies}
    finally:
        for proxy in proxies.values():
            proxy.stop()
        for server in servers.values():
            server.stop()


async def _complete(
    url: str,
    model,
    prompts: list[str],
    stream_every: int = 2,
    broken_ok: bool = False,
    max_tokens: int = MAX_TOKENS,
) -> list:
    """Greedy completions sent all at once (every ``stream_every``-th one streamed): the
    generated token ids of each, or (status, body) for a failed one; with ``broken_ok``
    a dropped connection is also reported as (0, error)."""
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(i, prompt):
            try:
                return await request(i, prompt)
            except httpx.TransportError as e:
                if not broken_ok:
                    raise
                return 0, repr(e)

        async def request(i, prompt):
            body = {
                "model": str(model),
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                "stream": i % stream_every == 1,
            }
            if not body["stream"]:
                r = await client.post(f"{url}/v1/completions", json=body)
                return (
                    r.json()["choices"][0]["token_ids"] if r.status_code == 200 else (r.status_code, r.text)
                )
            ids = []
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return r.status_code, (await r.aread()).decode()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        ids += json.loads(line[6:])["choices"][0]["token_ids"] or []
            return ids

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def _oracle(model, prompts: list[str]) -> list[list[int]]:
    return hf_greedy(model, prompts, MAX_TOKENS)


def _metric(server: VllmServer, name: str, reduce=sum, label: str = "") -> float:
    """A Prometheus metric of the instance, over the series whose labels contain ``label``."""
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    return reduce(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name + "{") and label in line
    )


# the connector's statistics (vllm/ascend/kv_transfer/stats.py)
PULLED_BYTES = "vllm:ascend_p2p_pulled_bytes_total"
PULLS = "vllm:ascend_p2p_pull_seconds_count"
FAILED_PULLS = "vllm:ascend_p2p_failed_pulls_total"
LEASES_EXPIRED = "vllm:ascend_p2p_leases_expired_total"
HOLDS = "vllm:ascend_p2p_holds_outstanding"
REFUSALS = "vllm:ascend_p2p_refusals_total"


def _served(server: VllmServer) -> float:
    return _metric(server, "vllm:request_success_total")


@pytest.mark.parametrize("pair", ["2p1d", "1p2d", "2p1d-lw"])
def test_xpyd_equals_transformers_for_16_concurrent_requests(cluster, pair):
    proxy = cluster[pair]
    prefill, decode = PROXIES[pair]
    prompts = _prompts(16, salt=pair + " ")
    before = {n: _served(cluster[n]) for n in prefill + decode}
    assert asyncio.run(_complete(proxy.url, proxy.model, prompts)) == _oracle(proxy.model, prompts)
    after = {n: _served(cluster[n]) for n in prefill + decode}
    # every prompt went through one prefill and one decode instance; least-loaded used them all
    assert sum(after[n] - before[n] for n in prefill) == 16
    assert sum(after[n] - before[n] for n in decode) == 16
    assert all(after[n] > before[n] for n in prefill + decode), (before, after)


def test_each_instance_runs_the_ascend_runner_with_async_scheduling(cluster):
    for name in (*GQA, *MLA):
        text = cluster[name].log.read_text()
        assert RUNNER_LINE in text, name
        # upstream's async scheduling stays on with the connector
        assert "Ascend model runner scheduling: async\n" in text, name


@pytest.mark.parametrize("pair", ["cp", "ds", "ds-lw"])  # cp-lw: in the dead-prefill test
def test_context_parallel_and_deepseek_ep_pairs_equal_transformers(cluster, pair):
    proxy = cluster[pair]
    prompts = _prompts(8, salt=pair + " ")
    assert asyncio.run(_complete(proxy.url, proxy.model, prompts)) == _oracle(proxy.model, prompts)


def _by_source(server: VllmServer, source: str) -> float:
    return _metric(server, "vllm:prompt_tokens_by_source_total", label=f'source="{source}"')


@pytest.mark.parametrize("decode", ["d_tp1", "d_dcp2"])
def test_the_decode_instance_pulls_the_prompt_instead_of_computing_it(cluster, decode):
    """vLLM's own prompt-token accounting on the decode instance: the prompt arrived by
    KV transfer, at most its last token was computed there."""
    server = cluster[decode]
    proxy = cluster["1p2d"]
    prompts = _prompts(4, salt=f"counted on {decode} " * 4)
    sources = ("external_kv_transfer", "local_compute", "local_cache_hit")
    before = {s: _by_source(server, s) for s in sources}
    pulled_bytes, pulls = _metric(server, PULLED_BYTES), _metric(server, PULLS)
    prefill = cluster["p_tp1"]
    baseline = _usage_now(prefill)

    async def direct():  # prefill by hand, then decode on this instance
        outs = []
        for prompt in prompts:
            params = _prefill_only(cluster["p_tp1"], prompt)
            r = httpx.post(
                f"{server.url}/v1/completions",
                timeout=120,
                json={
                    "model": str(server.model),
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                    "kv_transfer_params": params,
                },
            )
            outs.append(r.json()["choices"][0]["token_ids"])
        return outs

    assert asyncio.run(direct()) == _oracle(proxy.model, prompts)
    pulled, computed, hit = (_by_source(server, s) - before[s] for s in sources)
    from transformers import AutoTokenizer

    total = sum(len(AutoTokenizer.from_pretrained(server.model)(p).input_ids) for p in prompts)
    # the shared prefix of the later prompts is a local prefix-cache hit: only the rest is pulled
    assert pulled + hit >= total - len(prompts) and computed <= len(prompts), (pulled, computed, hit, total)
    assert pulled > hit > 0, (pulled, hit)
    # the connector's own statistics in /metrics: every request pulled on every decode rank
    assert _metric(server, PULLS) - pulls >= len(prompts)
    assert _metric(server, PULLED_BYTES) - pulled_bytes > 0
    # the done messages free the prefill blocks at once, long before the lease would
    deadline = time.monotonic() + LEASE / 4
    while _usage_now(prefill) > baseline and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _usage_now(prefill) == baseline, "the prefill instance still holds the pulled requests' blocks"
    assert _metric(prefill, HOLDS) == 0


def test_layerwise_pulls_every_prompt_and_frees_the_prefill_blocks(cluster):
    """Through the layer-wise 2P1D proxy: the decode instance's prompt tokens arrived by KV
    transfer (or from its own prefix cache), no pull failed, and both prefill instances
    hold nothing afterwards."""
    server, proxy = cluster["d_tp1"], cluster["2p1d-lw"]
    prompts = _prompts(6, salt="layer by layer " * 3)
    sources = ("external_kv_transfer", "local_compute", "local_cache_hit")
    before = {s: _by_source(server, s) for s in sources}
    failed = _metric(server, FAILED_PULLS)
    assert asyncio.run(_complete(proxy.url, proxy.model, prompts)) == _oracle(proxy.model, prompts)
    pulled, computed, hit = (_by_source(server, s) - before[s] for s in sources)
    from transformers import AutoTokenizer

    total = sum(len(AutoTokenizer.from_pretrained(server.model)(p).input_ids) for p in prompts)
    # the prompts share their first blocks: a later one may find them in the local prefix cache
    assert pulled + hit >= total - len(prompts) and computed <= len(prompts), (pulled, computed, hit, total)
    assert pulled > 0
    assert _metric(server, FAILED_PULLS) == failed
    for name in ("p_tp1", "p_pcp2"):
        deadline = time.monotonic() + LEASE / 4
        while _metric(cluster[name], HOLDS) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _metric(cluster[name], HOLDS) == 0, name


def test_chat_through_the_proxy_equals_the_colocated_instance(cluster):
    body = {
        "model": str(cluster["p_tp1"].model),
        "messages": [{"role": "user", "content": "Say something"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    pd = httpx.post(f"{cluster['2p1d'].url}/v1/chat/completions", json=body, timeout=120)
    local = httpx.post(f"{cluster['d_tp1'].url}/v1/chat/completions", json=body, timeout=120)
    assert pd.status_code == 200 and local.status_code == 200, (pd.text, local.text)
    assert pd.json()["choices"][0]["message"] == local.json()["choices"][0]["message"]


def test_bad_requests_get_4xx_from_the_proxy(cluster):
    url = cluster["2p1d"].url
    assert httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=30).status_code == 400
    assert httpx.post(f"{url}/v1/completions", json=[1, 2], timeout=30).status_code == 400
    # item 11: not strict JSON, or nested past the parser's depth: a refusal, not a traceback
    for body in (b'{"prompt": "x", "temperature": NaN}', b"[" * 100_000 + b"]" * 100_000):
        r = httpx.post(f"{url}/v1/completions", content=body, timeout=30)
        assert r.status_code == 400 and "Traceback" not in r.text, r.text[:200]
    assert (
        httpx.post(f"{url}/v1/completions", json={"prompt": "x", "stream": "yes"}, timeout=30).status_code
        == 400
    )
    r = httpx.post(f"{url}/v1/completions", json={"model": "no-such-model", "prompt": "x"}, timeout=30)
    assert 400 <= r.status_code < 500
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 200
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def _deployment_trust():
    import os

    from vllm.ascend.kv_transfer.trust import SECRET_ENV, Trust

    return Trust(os.environ[SECRET_ENV].encode())


def test_control_frames_without_the_secret_or_malformed_are_refused_counted_and_serving_goes_on(cluster):
    """Items 5, 10, 11: a frame not sealed with the deployment's secret (a forged DoneReading
    or Hello among them) or a sealed one that is malformed gets a refusal and nothing else,
    is counted by kind, is logged by size, never payload; ordinary traffic stays correct."""
    p1 = cluster["p_tp1"]
    trust = _deployment_trust()
    context = zmq.Context.instance()

    def dealer():
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{p1.kv_port}")
        return sock

    refused = {
        kind: _metric(p1, REFUSALS, label=f'reason="control {kind}"') for kind in ("unsealed", "malformed")
    }
    sock = dealer()
    forged = (
        b"\x00garbage",
        msgspec.msgpack.encode({"type": "hello", "v": 5, "engine_id": "x"}),
        msgspec.msgpack.encode(
            {
                "type": "done_reading",
                "v": 5,
                "request_id": "r",
                "reader": "x",
                "decode_rank": 0,
                "prefill_rank": 0,
                "read_ids": [],
            }
        ),
        b"\x91" * 200_000 + b"\x00",  # nested deep
    )
    malformed = (
        msgspec.msgpack.encode({"type": "done_reading", "v": 7}),
        msgspec.msgpack.encode({"type": "no_such_type", "v": 5}),
        b"\x91" * 200_000 + b"\x00",
    )
    for frame in (*forged, *(trust.seal(m) for m in malformed)):
        sock.send_multipart([b"", frame])
        assert sock.poll(10000), frame[:20]
        reply = msgspec.msgpack.decode(trust.open_frame(sock.recv_multipart()[-1]))
        assert reply["type"] == "reply" and reply["ok"] is False and reply["error"].startswith("refused"), (
            reply
        )
    sock.close()
    # over the 16 MiB limit: ZeroMQ drops the connection before anything is buffered
    big = dealer()
    big.send_multipart([b"", b"\x91" * (17 << 20)])
    assert not big.poll(2000)
    big.close()
    log = p1.log.read_text()
    assert log.count("refused a") >= len(forged) + len(malformed) and "garbage" not in log
    assert max(len(line) for line in log.splitlines()) < 20_000  # sizes and kinds, never payloads
    prompts = _prompts(2, salt="after garbage ")
    assert asyncio.run(_complete(cluster["2p1d"].url, p1.model, prompts)) == _oracle(p1.model, prompts)
    deadline = time.monotonic() + 30  # the counters come with the next stats interval
    while time.monotonic() < deadline:
        now = {k: _metric(p1, REFUSALS, label=f'reason="control {k}"') for k in refused}
        if now["unsealed"] - refused["unsealed"] >= len(forged) and now["malformed"] - refused[
            "malformed"
        ] >= len(malformed):
            break
        time.sleep(1)
    assert now["unsealed"] - refused["unsealed"] >= len(forged), (refused, now)
    assert now["malformed"] - refused["malformed"] >= len(malformed), (refused, now)


async def _choices(client: httpx.AsyncClient, url: str, body: dict) -> list[list[int]]:
    """The token ids of every choice of one request, by choice index (streamed or not)."""
    out: dict[int, list[int]] = {}
    if not body.get("stream"):
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            out[choice["index"]] = choice["token_ids"]
    else:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        out.setdefault(choice["index"], []).extend(choice["token_ids"] or [])
    return [out[i] for i in sorted(out)]


def _batched_and_parallel(url: str, model, salt: str):
    """Batched prompts and ``n`` > 1 (``top_k`` 1: every sequence greedy), streamed and not,
    sent together with 16 ordinary requests: each
    request's choices, the expected ones, and the ordinary answers and their oracle."""
    prompts = _prompts(7, salt=salt)
    # a batch whose second prompt has the first's token count, a third of another count
    same_count = prompts[0].replace("Request 0", "Request 9")
    requests = [
        ({"prompt": [prompts[0], same_count, prompts[1]]}, [prompts[0], same_count, prompts[1]], 1),
        ({"prompt": [prompts[2], prompts[3]], "stream": True}, [prompts[2], prompts[3]], 1),
        ({"prompt": prompts[4], "n": 4}, [prompts[4]], 4),
        ({"prompt": prompts[5], "n": 3, "stream": True}, [prompts[5]], 3),
        ({"prompt": [prompts[6], prompts[1]], "n": 2}, [prompts[6], prompts[1]], 2),
    ]
    ordinary = _prompts(16, salt=salt + "ordinary ")
    common = {
        "model": str(model),
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "top_k": 1,
        "ignore_eos": True,
        "return_token_ids": True,
    }

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            load = asyncio.ensure_future(_complete(url, model, ordinary))
            got = await asyncio.gather(
                *(_choices(client, url, {**common, **body}) for body, _, _ in requests)
            )
            return got, await load

    got, load = asyncio.run(main())
    greedy = dict(zip(prompts + [same_count], _oracle(model, prompts + [same_count])))
    expected = [[greedy[p] for p in batch for _ in range(n)] for _, batch, n in requests]
    return got, expected, load, _oracle(model, ordinary)


@pytest.mark.parametrize("pair", ["1p2d", "1p1d-lw"])
def test_batched_prompts_and_parallel_sampling_equal_transformers_under_load(cluster, pair):
    """Items 1-3: every prompt of a batch decodes from its own KV, every sequence of an
    ``n`` > 1 request from its prompt's, while ordinary requests run; nothing stays held."""
    proxy = cluster[pair]
    prefill = cluster["p_tp1"]
    decodes = [cluster[n] for n in PROXIES[pair][1]]
    failed = sum(_metric(d, FAILED_PULLS) for d in decodes)
    got, expected, load, oracle = _batched_and_parallel(proxy.url, proxy.model, f"batched {pair} ")
    assert got == expected
    assert load == oracle
    assert sum(_metric(d, FAILED_PULLS) for d in decodes) == failed
    deadline = time.monotonic() + LEASE / 4  # done messages free them, long before any lease
    while _metric(prefill, HOLDS) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _metric(prefill, HOLDS) == 0


def _decode_here(server: VllmServer, prompt: str, params: dict) -> tuple[list[int], float]:
    """A greedy completion on ``server`` with these kv_transfer_params: token ids, seconds."""
    start = time.monotonic()
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=300,
        json={
            "model": str(server.model),
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "kv_transfer_params": params,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], time.monotonic() - start


def _counted(server: VllmServer, name: str, label: str, at_least: float, timeout: float = 30) -> float:
    """The metric once it reaches ``at_least`` (counters come with the next stats interval)."""
    deadline = time.monotonic() + timeout
    while (value := _metric(server, name, label=label)) < at_least and time.monotonic() < deadline:
        time.sleep(1)
    return value


def test_forged_kv_transfer_params_are_refused_counted_and_the_prompt_computed_here(cluster):
    """Items 4, 7, 8, 9: parameters the deployment's secret does not vouch for (unsigned,
    altered, pointing elsewhere, out of bounds, a forged layer-wise transfer) and genuine
    ones sent with another prompt: the decode instance reads nothing, connects nowhere and
    computes the prompt; the rightful pull still works and the prefill holds nothing after."""
    import socket

    prefill, decode = cluster["p_tp1"], cluster["d_tp1"]
    model = decode.model
    baseline = _usage_now(prefill)
    reasons = ("untrusted", "another prompt")
    before = {r: _metric(decode, REFUSALS, label=f'reason="{r}"') for r in reasons}
    victim = _prompts(1, salt="a victim's private prompt ")[0]
    robber = victim.replace("Request 0", "Request 7")  # the same token count, other tokens
    genuine = _prefill_only(prefill, victim)
    unsigned = {k: v for k, v in genuine.items() if k != "remote_signature"}
    trap = socket.socket()  # a port the decode instance must never connect to
    trap.bind(("127.0.0.1", 0))
    trap.listen()
    trap.settimeout(2)
    forged = [
        unsigned,
        dict(genuine, remote_block_ids=[[b + 1 for b in g] for g in genuine["remote_block_ids"]]),
        dict(genuine, remote_port=trap.getsockname()[1]),
        dict(genuine, remote_ranks=10**6),
        {
            "do_remote_prefill": True,
            "layerwise_id": "lw-forged",
            "remote_host": "127.0.0.1",
            "remote_port": prefill.kv_port,
        },
    ]
    expected = _oracle(model, [robber, victim])
    for params in forged + [genuine]:  # the genuine ones with the robber's prompt last
        tokens, seconds = _decode_here(decode, robber, params)
        assert tokens == expected[0], params
        assert seconds < LEASE / 2, f"{seconds:.1f}s: a forged transfer held the request"
    with pytest.raises(socket.timeout):
        trap.accept()
    trap.close()
    # nothing planted in the prefix cache under the robber's tokens
    assert asyncio.run(_complete(decode.url, model, [robber, robber + " and more"])) == hf_greedy(
        model, [robber, robber + " and more"], MAX_TOKENS
    )
    # the rightful reader pulls what is still held for it, and the hold is freed
    pulls = _metric(decode, PULLS)
    assert _decode_here(decode, victim, genuine)[0] == expected[1]
    assert _metric(decode, PULLS) > pulls
    assert _counted(decode, REFUSALS, 'reason="untrusted"', before["untrusted"] + len(forged)) >= before[
        "untrusted"
    ] + len(forged)
    assert (
        _counted(decode, REFUSALS, 'reason="another prompt"', before["another prompt"] + 1)
        >= before["another prompt"] + 1
    )
    deadline = time.monotonic() + LEASE / 4
    while _usage_now(prefill) > baseline and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _usage_now(prefill) == baseline and _metric(prefill, HOLDS) == 0
    log = decode.log.read_text()
    assert "the deployment's secret does not vouch for them" in log and "for another prompt" in log


@pytest.mark.parametrize("pair", ["1p2d", "1p2d-lw"])
def test_64_concurrent_requests_none_lost(cluster, pair):
    proxy = cluster[pair]
    prompts = _prompts(64, salt="many ")
    got = asyncio.run(_complete(proxy.url, proxy.model, prompts, stream_every=3))
    assert got == _oracle(proxy.model, prompts)


@pytest.mark.parametrize("pair", ["1p2d", "1p1d-lw"])
def test_clients_that_disconnect_leave_nothing_held_or_running(cluster, pair):
    """Streams dropped after their first token: the decode instances stop the requests
    and the prefill instance holds no blocks; the next requests are served."""
    proxy = cluster[pair]
    prefill = cluster["p_tp1"]
    decodes = [cluster[n] for n in PROXIES[pair][1]]

    async def drop_after_first_token(prompt):
        body = {
            "model": str(proxy.model),
            "prompt": prompt,
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        async with (
            httpx.AsyncClient(timeout=120) as client,
            client.stream("POST", f"{proxy.url}/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return  # the connection closes here

    async def main():
        await asyncio.gather(*(drop_after_first_token(p) for p in _prompts(8, salt=f"gone {pair} ")))

    asyncio.run(main())
    deadline = time.monotonic() + LEASE / 2
    running = lambda: sum(_metric(d, "vllm:num_requests_running") for d in decodes)  # noqa: E731
    while (running() or _metric(prefill, HOLDS)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert running() == 0 and _metric(prefill, HOLDS) == 0
    prompts = _prompts(2, salt=f"after the drops {pair} ")
    assert asyncio.run(_complete(proxy.url, proxy.model, prompts)) == _oracle(proxy.model, prompts)


def _prefill_only(server: VllmServer, prompt: str) -> dict:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={
            "model": str(server.model),
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True},
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_batched_prompts_and_parallel_sampling_through_vllm_router_equal_transformers(cluster):
    """Upstream's router sends a batch (and an ``n`` > 1 request) to the prefill instance as
    one request and passes on the one set of parameters upstream's serving answers with:
    the prompt they were signed for is pulled, every other prompt is refused as another
    prompt's and computed on the decode instance, so every answer is right. (The prefill
    holds of the sequences whose parameters were never passed on end with their lease:
    docs/pd_disaggregation.md. The PCP2 prefill under the router dies in the next case.)"""
    router, decode = cluster["router"], cluster["d_tp1"]
    label = 'reason="another prompt"'
    refused, failed = _metric(decode, REFUSALS, label=label), _metric(decode, FAILED_PULLS)
    got, expected, load, oracle = _batched_and_parallel(router.url, router.model, "routed ")
    assert got == expected
    assert load == oracle
    assert _metric(decode, FAILED_PULLS) == failed
    # the later prompts of each batch, for each of their sequences: 2 + 1 + 1 x 2
    assert _counted(decode, REFUSALS, label, refused + 5) >= refused + 5
    print(f"prefill holds left to their lease: {_metric(cluster['p_pcp2'], HOLDS):.0f}")


def test_a_dead_prefill_fails_or_recomputes_per_policy_and_decode_keeps_serving(cluster):
    p2, d_fail, d_recompute = cluster["p_pcp2"], cluster["d_tp1"], cluster["d_dcp2"]
    model = p2.model
    failed_pulls = _metric(d_fail, FAILED_PULLS)
    prompts = _prompts(2, salt="the prefill dies ")
    params = [_prefill_only(p2, prompt) for prompt in prompts]
    # layer-wise requests in flight when it dies: the recomputing decode instance answers all
    layerwise = _prompts(8, salt="the prefill dies mid-prefill " * 6)
    recompute_failed = _metric(d_recompute, FAILED_PULLS)

    async def in_flight_then_kill():
        task = asyncio.ensure_future(_complete(cluster["cp-lw"].url, model, layerwise))
        await asyncio.sleep(0.1)
        await asyncio.to_thread(p2.kill)
        return await task

    assert asyncio.run(in_flight_then_kill()) == _oracle(model, layerwise)
    assert _metric(d_recompute, FAILED_PULLS) > recompute_failed  # some were cut off
    body = {
        "model": str(model),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    failed = httpx.post(
        f"{d_fail.url}/v1/completions",
        timeout=120,
        json={**body, "prompt": prompts[0], "kv_transfer_params": params[0]},
    )
    assert failed.status_code >= 400 or failed.json()["choices"][0]["finish_reason"] not in (
        "length",
        "stop",
    ), failed.text
    recomputed = httpx.post(
        f"{d_recompute.url}/v1/completions",
        timeout=120,
        json={**body, "prompt": prompts[1], "kv_transfer_params": params[1]},
    )
    assert recomputed.status_code == 200, recomputed.text
    assert recomputed.json()["choices"][0]["token_ids"] == _oracle(model, prompts[1:])[0]
    assert _metric(d_fail, FAILED_PULLS) > failed_pulls
    for server in (d_fail, d_recompute):
        assert "pulling its KV" in server.log.read_text()
        assert asyncio.run(_complete(server.url, model, prompts)) == _oracle(model, prompts)


def _usage_now(server: VllmServer) -> float:
    """KV usage while a one-token probe runs alone on the instance (so the gauge is fresh;
    read on a TP1 instance: with worker processes the gauge lags behind)."""
    httpx.post(
        f"{server.url}/v1/completions",
        json={"model": str(server.model), "prompt": "probe", "max_tokens": 1, "temperature": 0},
        timeout=60,
    )
    return _metric(server, "vllm:kv_cache_usage_perc", max)


def test_a_dead_decode_leaves_no_blocks_held_on_prefill(cluster):
    """Runs after the PCP2 prefill was killed: the 2P1D proxy also has to skip it."""
    prefill, decode, proxy = cluster["p_tp1"], cluster["d_tp1"], cluster["2p1d"]
    baseline = _usage_now(prefill)
    expired = _metric(prefill, LEASES_EXPIRED)
    for prompt in _prompts(6, salt="orphan "):  # their decode side never comes
        _prefill_only(prefill, prompt)
    assert _usage_now(prefill) > baseline

    async def in_flight_then_kill():
        tasks = [
            asyncio.ensure_future(
                _complete(
                    url, proxy.model, _prompts(8, salt=f"killed {url} "), broken_ok=True, max_tokens=400
                )
            )
            for url in (proxy.url, cluster["1p1d-lw"].url)
        ]
        await asyncio.sleep(1.0)
        await asyncio.to_thread(decode.kill)
        return [r for task in tasks for r in await task]

    results = asyncio.run(in_flight_then_kill())
    assert any(isinstance(r, tuple) for r in results), "the decode instance died after serving everything"
    killed_at = time.monotonic()
    while _usage_now(prefill) > baseline and time.monotonic() - killed_at < 3 * LEASE:
        time.sleep(0.5)
    freed_after = time.monotonic() - killed_at
    assert _usage_now(prefill) == baseline, (
        f"blocks still held {freed_after:.1f}s after the decode instance died"
    )
    print(
        f"prefill blocks back to baseline {freed_after:.1f}s after the decode instance was killed "
        f"(lease {LEASE}s)"
    )
    assert "no word from the decode side" in prefill.log.read_text()
    assert _metric(prefill, LEASES_EXPIRED) - expired >= 6  # the orphans at least
