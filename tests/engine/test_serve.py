"""`vllm serve` in host emulation on 127.0.0.1: completions and chat, streaming and not,
answer with the same text as the LLM API. The server runs with the development endpoints
(VLLM_SERVER_DEV_MODE=1) and without sleep mode: ``POST /sleep`` must fail without
leaving the engine paused (the sleep cycle itself: test_sleep_mode.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.engines import run_vllm, vllm_server

PROMPT = "Once upon a time there was a small model that learned to count"
CHAT = [{"role": "user", "content": "Tell me about paged attention."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    args = ["--dtype", "float32", "--max-model-len", "512", "--seed", "0"]
    with vllm_server(tiny_models["llama"], args, log, env={"VLLM_SERVER_DEV_MODE": "1"}) as base:
        yield base, tiny_models["llama"], log


@pytest.fixture(scope="module")
def reference(server):
    _, model, _ = server
    result = run_vllm(model, [[PROMPT]], max_tokens=MAX_TOKENS, chats=[CHAT])
    return result["batches"][0][0]["text"], result["chats"][0]["text"]


def _stream(client: httpx.Client, url: str, body: dict, field) -> str:
    text = []
    with client.stream("POST", url, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk["choices"]:
                text.append(field(choice) or "")
    return "".join(text)


# endpoint, request fields, text of a whole response choice, text of a streamed choice,
# index of the LLM-API reference text
ENDPOINTS = {
    "completions": ("/v1/completions", {"prompt": PROMPT}, lambda c: c["text"], lambda c: c.get("text"), 0),
    "chat": (
        "/v1/chat/completions",
        {"messages": CHAT},
        lambda c: c["message"]["content"],
        lambda c: c.get("delta", {}).get("content"),
        1,
    ),
}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_endpoint_text_equals_llm_api(endpoint, server, reference):
    base, model, _ = server
    path, fields, whole, delta, ref = ENDPOINTS[endpoint]
    body = {"model": str(model), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **fields}
    with httpx.Client() as client:
        resp = client.post(f"{base}{path}", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        plain = whole(resp.json()["choices"][0])
        streamed = _stream(client, f"{base}{path}", body, delta)
    assert plain == reference[ref] and plain
    assert streamed == reference[ref]


def test_bad_request_does_not_kill_the_server(server):
    base, model, _ = server
    with httpx.Client() as client:
        bad = client.post(
            f"{base}/v1/completions",
            json={"model": str(model), "prompt": PROMPT, "max_tokens": -5},
            timeout=60,
        )
        assert bad.status_code == 400
        assert client.get(f"{base}/health", timeout=10).status_code == 200


def test_sleep_without_sleep_mode_fails_and_leaves_the_engine_serving(server, reference):
    base, model, log = server
    # separate connections: uvicorn closes the one whose request raised in the engine
    refused = httpx.post(f"{base}/sleep", params={"level": 1}, timeout=60)
    assert refused.status_code == 500
    assert httpx.get(f"{base}/is_sleeping", timeout=10).json() == {"is_sleeping": False}
    body = {
        "model": str(model),
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == reference[0]
    assert "start it with --enable-sleep-mode" in log.read_text()
