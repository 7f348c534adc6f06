"""The P2P control plane: ZeroMQ request/reply carrying the msgspec messages of ``wire``.

A prefill rank runs one ``ControlServer`` (a ROUTER socket bound to the configured host
and its port) on a thread. Every request gets exactly one reply; a message that cannot
be decoded (wrong version, malformed, too large, unknown type) is logged and answered
with ``Reply(ok=False, error=...)``, and the server keeps serving. ``ControlClient``
sends one request and waits at most ``timeout`` seconds for the reply (``request_all``:
one request to each of several servers, all sent first, under one deadline; in two
halves, ``post_all`` and ``gather``, for a caller with other work while they travel).

With the deployment's secret (``trust.py``) every frame, request and reply, is sealed: the
server answers a frame it cannot open with a refusal and nothing else (``on_refused`` is
told the reason, for the statistics), and the client takes no reply it cannot open. A
refusal is logged with its size and reason, never its payload.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from vllm.logger import init_logger

from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.trust import Trust, TrustError

logger = init_logger(__name__)


class ControlTimeout(TimeoutError):
    """The peer did not answer in time (dead, or not started yet)."""


class ControlServer:
    """``on_start``: run first on the server's thread (the worker binds its device there: the
    layer-wise progress answers query device events). ``on_refused``: called with the kind
    of each refused frame ("unsealed", "malformed")."""

    def __init__(
        self,
        host: str,
        port: int,
        handle: Callable[[wire.Message], wire.Message],
        name: str = "",
        on_start: Callable[[], None] | None = None,
        trust: Trust | None = None,
        on_refused: Callable[[str], None] | None = None,
    ):
        self._handle = handle
        self._on_start = on_start
        self._trust = trust or Trust(None)
        self._on_refused = on_refused
        self._name = name or f"{host}:{port}"
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        try:
            self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self._socket.close()
            raise RuntimeError(
                f"KV control plane cannot bind {host}:{port} ({e}): is another instance "
                "using this kv_port range? Give each instance its own kv_port."
            ) from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kv-control-{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        if self._on_start is not None:
            self._on_start()
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._socket.recv_multipart()
            if len(frames) != 3 or frames[1]:
                logger.warning(
                    "KV control %s: dropped a message with %d frames (expected an envelope)",
                    self._name,
                    len(frames),
                )
                continue
            identity, frame = frames[0], frames[2]
            try:
                message = wire.decode_message(self._trust.open_frame(frame))
                reply = self._handle(message)
            except (TrustError, wire.WireError) as e:
                kind = "unsealed" if isinstance(e, TrustError) else "malformed"
                logger.warning(
                    "KV control %s: refused a %d-byte frame (%s): %s", self._name, len(frame), kind, e
                )
                if self._on_refused is not None:
                    self._on_refused(kind)
                reply = wire.Reply(wire.WIRE_VERSION, False, f"refused: {e}"[:2000])
            except Exception as e:  # a handler bug must not kill the control plane
                logger.exception("KV control %s: handling a message failed", self._name)
                reply = wire.Reply(wire.WIRE_VERSION, False, f"internal error: {type(e).__name__}")
            self._socket.send_multipart([identity, b"", self._trust.seal(wire.encode_message(reply))])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close()


@dataclass
class Posted:
    """Requests sent by ``ControlClient.post_all`` whose replies are not read yet."""

    requests: Sequence[tuple[str, wire.Message]]
    results: list
    sent: list  # indices of the requests sent (the rest failed to send: results says why)
    sent_at: float


class ControlClient:
    """Request/reply to control servers. Each thread keeps one DEALER socket per address
    (connecting costs more than the exchange); a socket whose request failed or timed out
    is closed, so a late reply can never answer the next request."""

    def __init__(self, timeout: float = 5.0, trust: Trust | None = None):
        self._context = zmq.Context.instance()
        self.timeout = timeout
        self._trust = trust or Trust(None)
        self._local = threading.local()

    def _socket(self, address: str):
        sockets = self._local.__dict__.setdefault("sockets", {})
        socket = sockets.get(address)
        if socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
            socket.connect(f"tcp://{address}")
            sockets[address] = socket
        return socket

    def _drop(self, address: str) -> None:
        socket = self._local.__dict__.get("sockets", {}).pop(address, None)
        if socket is not None:
            socket.close()

    def request(self, address: str, message: wire.Message, timeout: float | None = None) -> wire.Message:
        wait = self.timeout if timeout is None else timeout
        try:
            socket = self._socket(address)
            socket.send_multipart([b"", self._trust.seal(wire.encode_message(message))])
            if not socket.poll(int(wait * 1000), zmq.POLLIN):
                raise ControlTimeout(f"no answer from the KV control plane at {address} within {wait:.1f} s")
            frames = socket.recv_multipart()
            return self._open(frames[-1])
        except BaseException:
            self._drop(address)
            raise

    def request_all(
        self, requests: Sequence[tuple[str, wire.Message]], timeout: float | None = None
    ) -> list[wire.Message | Exception]:
        """One request to each of several addresses, all sent before any reply is awaited
        (a request's done messages to its prefill ranks cost one round trip, not one per
        rank); per request its reply, or the exception that request met. One deadline for
        all of them."""
        return self.gather(self.post_all(requests), timeout)

    def post_all(self, requests: Sequence[tuple[str, wire.Message]]) -> Posted:
        """``request_all``'s first half: send now, ``gather`` the replies later, on this
        thread (the sockets are this thread's) and before its next request to the same
        addresses."""
        posted = Posted(requests, [None] * len(requests), [], time.monotonic())
        last = data = None
        for i, (address, message) in enumerate(requests):
            try:
                if message is not last:  # one message to several ranks is encoded once
                    last, data = message, self._trust.seal(wire.encode_message(message))
                self._socket(address).send_multipart([b"", data])
                posted.sent.append(i)
            except Exception as e:
                self._drop(address)
                posted.results[i] = e
        return posted

    def gather(self, posted: Posted, timeout: float | None = None) -> list[wire.Message | Exception]:
        """The replies to ``post_all``'s requests, waiting at most ``timeout`` seconds from
        when they were sent; a request still unanswered is a ``ControlTimeout`` (its
        socket is closed: the late reply is never read)."""
        wait = self.timeout if timeout is None else timeout
        deadline = posted.sent_at + wait
        results = posted.results
        for i in posted.sent:
            address = posted.requests[i][0]
            try:
                socket = self._socket(address)
                left = max(0.0, deadline - time.monotonic())
                if not socket.poll(int(left * 1000), zmq.POLLIN):
                    raise ControlTimeout(
                        f"no answer from the KV control plane at {address} within {wait:.1f} s"
                    )
                results[i] = self._open(socket.recv_multipart()[-1])
            except Exception as e:
                self._drop(address)
                results[i] = e
        posted.sent = []
        return results

    def _open(self, frame: bytes) -> wire.Message:
        """A reply, if the deployment's secret sealed it (``TrustError`` otherwise)."""
        return wire.decode_message(self._trust.open_frame(frame))

    def close(self) -> None:
        """Close this thread's sockets."""
        for address in list(self._local.__dict__.get("sockets", {})):
            self._drop(address)


def hello(client: ControlClient, host: str, port: int, engine_id: str) -> wire.RankInfo:
    """The handshake: the prefill rank at ``host:port`` answers ``Hello`` with its
    ``RankInfo`` (layout, transport and its address, KV regions)."""
    reply = client.request(f"{host}:{port}", wire.Hello(wire.WIRE_VERSION, engine_id))
    if not isinstance(reply, wire.RankInfo):
        raise RuntimeError(f"the prefill rank at {host}:{port} answered Hello with {reply}")
    return reply
