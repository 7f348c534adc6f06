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
        else:
            answer = {"choices": [{"text": "decoded"}]}
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
        r = client.post("/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    (first,), (second,) = prefill.seen, decode.seen
    transfer_id = first["kv_transfer_params"]["layerwise_id"]
    assert first["max_tokens"] == 1 and first["kv_transfer_params"]["do_remote_decode"]
    assert second["max_tokens"] == 4 and second["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "layerwise_id": transfer_id,
        "remote_host": "10.0.0.7",
        "remote_port": 21100,
    }


@pytest.mark.parametrize(
    "prefill_kv, error",
    [(["h:1", "h:2"], "2 addresses for 1 prefill"), (["h"], "HOST:KV_PORT"), (["h:0"], "HOST:KV_PORT")],
)
def test_layerwise_refuses_prefill_kv_that_does_not_match(prefill_kv, error):
    with pytest.raises(ValueError, match=error):
        build_app(["http://p"], ["http://d"], prefill_kv=prefill_kv)
