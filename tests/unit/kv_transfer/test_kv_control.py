"""The P2P control plane on real ZeroMQ sockets on 127.0.0.1: bad messages are refused with
the reason and the server keeps serving; a silent peer is a timeout, not a hang."""

from __future__ import annotations

import socket

import msgspec
import pytest
import zmq

from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.control import ControlClient, ControlServer, ControlTimeout


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    seen = []

    def handle(message):
        seen.append(message)
        if isinstance(message, wire.Renew) and message.request_ids == ["boom"]:
            raise RuntimeError("handler bug")
        return wire.Reply(wire.WIRE_VERSION, True)

    port = _port()
    srv = ControlServer("127.0.0.1", port, handle)
    yield f"127.0.0.1:{port}", seen
    srv.close()


def _raw(address: str, payload: bytes, frames=None) -> wire.Message:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    sock.send_multipart(frames if frames is not None else [b"", payload])
    assert sock.poll(5000), "no answer"
    reply = wire.decode_message(sock.recv_multipart()[-1])
    sock.close()
    return reply


def test_bad_messages_get_a_reason_and_the_server_keeps_serving(server):
    address, seen = server
    client = ControlClient(timeout=5)
    bad = [
        (b"\xc1garbage", "not a control message"),
        (
            msgspec.msgpack.encode({"type": "renew", "v": 9, "engine_id": "e", "request_ids": []}),
            "wire version 9",
        ),
        (msgspec.msgpack.encode({"type": "drop_tables", "v": wire.WIRE_VERSION}), "unknown message type"),
        (
            msgspec.msgpack.encode(
                {"type": "renew", "v": wire.WIRE_VERSION, "engine_id": "", "request_ids": []}
            ),
            "malformed renew",
        ),
    ]
    for payload, reason in bad:
        reply = _raw(address, payload)
        assert isinstance(reply, wire.Reply) and not reply.ok and reason in reply.error
    # a handler that raises is answered, not fatal
    reply = client.request(address, wire.Renew(wire.WIRE_VERSION, "e", ["boom"]))
    assert not reply.ok and "internal error" in reply.error
    reply = client.request(address, wire.Renew(wire.WIRE_VERSION, "e", ["r1"]))
    assert reply.ok and seen[-1].request_ids == ["r1"]


def test_oversized_and_unframed_messages_do_not_stop_the_server(server):
    address, seen = server
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    sock.send_multipart([b"", b"\x00" * (wire.MAX_MESSAGE_BYTES + 10)])  # ZeroMQ drops the peer
    sock.send_multipart([b"no-envelope"])
    sock.close()
    reply = ControlClient(timeout=5).request(address, wire.Renew(wire.WIRE_VERSION, "e", ["r2"]))
    assert reply.ok and seen[-1].request_ids == ["r2"]


def test_a_silent_peer_is_a_timeout():
    listener = socket.create_server(("127.0.0.1", 0))  # accepts TCP, never speaks ZeroMQ back
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    with pytest.raises(ControlTimeout, match="within 0.5 s"):
        ControlClient().request(address, wire.Renew(wire.WIRE_VERSION, "e", ["r"]), timeout=0.5)
    listener.close()


def test_a_second_server_on_the_same_port_is_a_clear_error(server):
    address, _ = server
    with pytest.raises(RuntimeError, match="Give each instance its own kv_port"):
        ControlServer("127.0.0.1", int(address.rsplit(":", 1)[1]), lambda m: m)


def test_requests_to_several_servers_are_all_sent_before_any_reply_is_awaited():
    import threading
    import time

    gate = threading.Barrier(2, timeout=5)  # each server answers only once both have a request

    def handle(message):
        gate.wait()
        return wire.Reply(wire.WIRE_VERSION, True, message.engine_id)

    ports = [_port(), _port()]
    servers = [ControlServer("127.0.0.1", p, handle) for p in ports]
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # takes requests, never answers
    silent_port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        client = ControlClient(timeout=2)
        requests = [
            (f"127.0.0.1:{p}", wire.Renew(wire.WIRE_VERSION, f"e{i}", [])) for i, p in enumerate(ports)
        ]
        requests.append((f"127.0.0.1:{silent_port}", wire.Renew(wire.WIRE_VERSION, "e-silent", [])))
        started = time.monotonic()
        first, second, third = client.request_all(requests, timeout=1.0)
        # one after the other, the first server would wait for the second until the barrier broke
        assert (first.ok, first.error, second.error) == (True, "e0", "e1")
        assert isinstance(third, ControlTimeout)
        assert time.monotonic() - started < 3, "one deadline for all requests"
        assert silent.poll(1000), "the unanswered request was sent all the same"
    finally:
        silent.close()
        for s in servers:
            s.close()


def test_on_start_runs_on_the_servers_thread_before_any_message():
    """The worker binds its device there: progress answers query device events on it."""
    import threading

    started, handled = [], []
    port = _port()

    def handle(message):
        handled.append(threading.current_thread().name)
        return wire.Reply(wire.WIRE_VERSION, True)

    srv = ControlServer(
        "127.0.0.1", port, handle, on_start=lambda: started.append(threading.current_thread().name)
    )
    try:
        ControlClient().request(f"127.0.0.1:{port}", wire.Renew(wire.WIRE_VERSION, "e", ["a"]))
        assert started == [f"kv-control-{port}"] and handled == started
    finally:
        srv.close()
