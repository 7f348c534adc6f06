"""P2P disaggregated prefill end to end, in host emulation, with real processes on 127.0.0.1:
``vllm serve`` prefill and decode instances with AscendP2PConnector (Mooncake over TCP),
the real proxy in front (``python -m vllm.ascend.kv_transfer.proxy``), and Hugging Face
transformers' greedy generate as the oracle.

All instances start once, together, and serve every test:

* GQA (tiny Qwen2 with one KV head): prefill TP1 and PCP2, decode TP1 and TP2 x DCP2.
  Proxies over them give 2P1D (TP1 + PCP2 -> TP1), 1P2D (TP1 -> TP1 + TP2/DCP2) and the
  context-parallel pair PCP2 -> DCP2. The TP2/DCP2 decode recomputes on failed loads
  (``kv_load_failure_policy: recompute``), the TP1 decode fails them (the default).
* MLA + MoE (tiny DeepSeek-V3): prefill TP2 + EP -> decode DP2 + EP.

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

from tests.support.engines import RUNNER_LINE, VllmServer
from tests.support.models import QWEN2_KV1
from tests.support.oracle import hf_greedy
from tests.support.ports import free_port, free_ports

MAX_TOKENS = 12
# Twice the defaults: six instances share a 2-core CI machine, and before empty steps were
# paced (worker_side.IdlePacer) prefill control planes were seen unanswered for 10-60 s
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


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    servers = {}
    proxies = {}
    try:
        for model, specs in ((tiny_models[QWEN2_KV1], GQA), (tiny_models["deepseek_v3"], MLA)):
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
    assert (
        httpx.post(f"{url}/v1/completions", json={"prompt": "x", "stream": "yes"}, timeout=30).status_code
        == 400
    )
    r = httpx.post(f"{url}/v1/completions", json={"model": "no-such-model", "prompt": "x"}, timeout=30)
    assert 400 <= r.status_code < 500
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 200
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_malformed_control_messages_are_refused_and_the_instance_keeps_serving(cluster):
    p1 = cluster["p_tp1"]
    context = zmq.Context.instance()

    def dealer():
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{p1.kv_port}")
        return sock

    sock = dealer()
    bad = (
        b"\x00garbage",
        msgspec.msgpack.encode({"type": "done_reading", "v": 7}),
        msgspec.msgpack.encode({"type": "renew", "v": 1, "engine_id": "x", "request_ids": [1]}),
        msgspec.msgpack.encode({"type": "no_such_type", "v": 1}),
        msgspec.msgpack.encode({"type": "hello", "v": 1, "engine_id": "x", "extra": 1}),
    )
    for payload in bad:
        sock.send_multipart([b"", payload])
        assert sock.poll(10000), payload[:20]
        reply = msgspec.msgpack.decode(sock.recv_multipart()[-1])
        assert reply["type"] == "reply" and reply["ok"] is False and reply["error"], reply
    sock.close()
    # over the 16 MiB limit: ZeroMQ drops the connection before anything is buffered
    big = dealer()
    big.send_multipart([b"", b"\x91" * (17 << 20)])
    assert not big.poll(2000)
    big.close()
    assert p1.log.read_text().count("refused a message") >= len(bad)
    prompts = _prompts(2, salt="after garbage ")
    assert asyncio.run(_complete(cluster["2p1d"].url, p1.model, prompts)) == _oracle(p1.model, prompts)


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
