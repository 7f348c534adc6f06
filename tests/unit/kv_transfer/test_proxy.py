"""The xPyD proxy against real HTTP servers on 127.0.0.1 (the end-to-end runs with vLLM
instances are in tests/engine/test_pd_serving.py): a connection the instance resets
before answering is retried, not answered with an error."""

from __future__ import annotations

import json
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fastapi.testclient import TestClient

from vllm.ascend.kv_transfer.proxy import build_app


class _Instance(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    resets_left = 0  # per server: how many requests get a TCP reset instead of an answer

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)
        if self.server.resets_left > 0:
            self.server.resets_left -= 1
            # SO_LINGER 0: close() sends RST, as a host does for data on a socket it closed
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            answer = {"choices": [{"text": "x"}], "kv_transfer_params": {"remote_block_ids": [1]}}
        else:  # as upstream answers: n choices of the prompt, usage
            text = "decoded" if body.get("prompt") in ("p", None) else f"decoded {body['prompt']}"
            answer = {
                "id": "cmpl-x",
                "choices": [{"index": j, "text": text} for j in range(body.get("n", 1))],
                "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
            }
        if body.get("stream"):
            chunks = [{"id": "cmpl-x", "choices": [c], "usage": None} for c in answer["choices"]]
            if body.get("stream_options", {}).get("include_usage"):
                chunks.append({"id": "cmpl-x", "choices": [], "usage": answer["usage"]})
            data = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def instance():
    servers = []

    def start(resets: int = 0):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Instance)
        server.seen, server.resets_left = [], resets
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_reset_connection_is_retried(instance, role, caplog):
    prefill, prefill_url = instance(resets=1 if role == "prefill" else 0)
    decode, decode_url = instance(resets=1 if role == "decode" else 0)
    with TestClient(build_app([prefill_url], [decode_url])) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "decoded"
    reset = prefill if role == "prefill" else decode
    assert len(reset.seen) == 2 and reset.seen[0] == reset.seen[1]  # the same request, sent again
    assert decode.seen[-1]["kv_transfer_params"] == {"remote_block_ids": [1]}
    assert "dropped the connection" in caplog.text


def test_an_instance_that_keeps_resetting_gets_a_503(instance):
    _, prefill_url = instance(resets=100)
    _, decode_url = instance()
    with TestClient(build_app([prefill_url], [decode_url])) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 4})
    assert r.status_code == 503 and "no prefill instance" in r.json()["error"]["message"]


def test_layerwise_sends_both_at_once_with_one_transfer_id(instance):
    prefill, prefill_url = instance()
    decode, decode_url = instance()
    with TestClient(build_app([prefill_url], [decode_url], prefill_kv=["10.0.0.7:21100"])) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 4, "n": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    (first,), (second,) = prefill.seen, decode.seen
    transfer_id = first["kv_transfer_params"]["layerwise_id"]
    assert first["max_tokens"] == 1 and first["kv_transfer_params"]["do_remote_decode"]
    assert first["n"] == 1 and first["kv_transfer_params"]["readers"] == 3
    # the decode side knows how many of its requests the transfer is held for
    assert second["max_tokens"] == 4 and second["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "layerwise_id": transfer_id,
        "remote_host": "10.0.0.7",
        "remote_port": 21100,
        "remote_readers": 3,
    }


def test_layerwise_params_are_signed_with_the_deployments_secret(instance):
    from vllm.ascend.kv_transfer.trust import LAYERWISE_FIELDS, Trust

    trust = Trust(b"k" * 32)
    _, prefill_url = instance()
    decode, decode_url = instance()
    with TestClient(
        build_app([prefill_url], [decode_url], prefill_kv=["10.0.0.7:21100"], trust=trust)
    ) as client:
        assert client.post("/v1/completions", json={"model": "m", "prompt": "p"}).status_code == 200
    params = decode.seen[0]["kv_transfer_params"]
    assert trust.check_params(params, LAYERWISE_FIELDS) is None
    assert (
        Trust(b"x" * 32).check_params(params, LAYERWISE_FIELDS) == "kv_transfer_params with a bad signature"
    )


def test_parallel_sampling_prefills_one_sequence_for_n_readers(instance):
    """Item 2: the prefill instance computes the prompt once (n=1) and holds it for the n
    decode requests upstream makes of the client's request."""
    prefill, prefill_url = instance()
    decode, decode_url = instance()
    with TestClient(build_app([prefill_url], [decode_url])) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "p", "n": 4, "best_of": 6})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    assert prefill.seen[0]["n"] == 1 and "best_of" not in prefill.seen[0]
    assert prefill.seen[0]["kv_transfer_params"] == {"do_remote_decode": True, "readers": 6}
    assert decode.seen[0]["n"] == 4 and decode.seen[0]["best_of"] == 6


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_goes_through_as_one_request_per_prompt(instance, stream):
    """Item 1: each prompt of a batch gets its own prefill and its own KV parameters; the
    answers come back as one, numbered as upstream numbers a batch's choices."""
    prefill, prefill_url = instance()
    decode, decode_url = instance()
    body = {"model": "m", "prompt": ["a", "b", "c"], "n": 2, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    with TestClient(build_app([prefill_url], [decode_url])) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if stream:
            lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
            chunks = [json.loads(line[6:]) for line in lines[:-1]]
            usage = [c["usage"] for c in chunks if not c["choices"]]
            choices = [c for chunk in chunks for c in chunk["choices"]]
            assert usage == [{"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}]
        else:
            choices = r.json()["choices"]
            assert r.json()["usage"] == {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}
    assert sorted(p["prompt"] for p in prefill.seen) == ["a", "b", "c"]
    assert sorted(d["prompt"] for d in decode.seen) == ["a", "b", "c"]
    assert all(d["kv_transfer_params"] == {"remote_block_ids": [1]} for d in decode.seen)
    by_index = {c["index"]: c["text"] for c in choices}
    assert by_index == {
        0: "decoded a",
        1: "decoded a",
        2: "decoded b",
        3: "decoded b",
        4: "decoded c",
        5: "decoded c",
    }


def test_a_batch_of_token_id_prompts_is_split_too_and_one_token_list_is_one_prompt(instance):
    prefill, prefill_url = instance()
    _, decode_url = instance()
    with TestClient(build_app([prefill_url], [decode_url])) as client:
        assert client.post("/v1/completions", json={"model": "m", "prompt": [[1, 2], [3]]}).status_code == 200
        assert client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3]}).status_code == 200
    assert [p["prompt"] for p in prefill.seen[:2]] in ([[1, 2], [3]], [[3], [1, 2]])
    assert prefill.seen[2]["prompt"] == [1, 2, 3]


@pytest.mark.parametrize(
    "data, error",
    [
        (b'{"model": "m", "prompt": "p", "temperature": NaN}', "NaN is not JSON"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests too deep"),
        (b"[1, 2]", "JSON object"),
        (b"{nope", "must be JSON"),
    ],
)
def test_bodies_that_are_not_strict_json_get_400(instance, data, error):
    """Item 11: a clear refusal, no traceback, nothing sent on."""
    prefill, prefill_url = instance()
    _, decode_url = instance()
    with TestClient(build_app([prefill_url], [decode_url])) as client:
        r = client.post("/v1/completions", content=data, headers={"content-type": "application/json"})
    assert r.status_code == 400 and error in r.json()["error"]["message"] and prefill.seen == []


@pytest.mark.parametrize(
    "prefill_kv, error",
    [(["h:1", "h:2"], "2 addresses for 1 prefill"), (["h"], "HOST:KV_PORT"), (["h:0"], "HOST:KV_PORT")],
)
def test_layerwise_refuses_prefill_kv_that_does_not_match(prefill_kv, error):
    with pytest.raises(ValueError, match=error):
        build_app(["http://p"], ["http://d"], prefill_kv=prefill_kv)
