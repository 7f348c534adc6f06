"""A decode rank reports a pull before its done messages are answered only when the read
certainly ended inside the prefill ranks' leases: over real ZeroMQ sockets against the
prefill rank's own control handler, and in a simulation of two hosts whose clocks
differ, checked against when the lease really ran out."""

from __future__ import annotations

import socket
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.control import ControlClient, ControlServer
from vllm.ascend.kv_transfer.holds import Holds
from vllm.ascend.kv_transfer.lease_check import SAFETY, LeaseCheck
from vllm.ascend.kv_transfer.pacer import IdlePacer
from vllm.ascend.kv_transfer.prefill_side import PrefillSide
from vllm.ascend.kv_transfer.stats import StatsInterval


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prefill_rank(lease: float):
    """A prefill rank's control-plane state and handler (the worker's own prefill side),
    without the model parts it does not use for these messages."""
    return PrefillSide(Holds(lease), None, None, {}, IdlePacer(), StatsInterval(), record_event=lambda: None)


@pytest.fixture
def prefill():
    ranks, servers = [], []

    def start(lease: float, delay_renew: float = 0.0):
        rank = _prefill_rank(lease)

        def handle(message):
            if isinstance(message, wire.Renew):
                time.sleep(delay_renew)
            return rank.handle(message)

        port = _port()
        servers.append(ControlServer("127.0.0.1", port, handle))
        ranks.append(rank)
        return rank, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.close()


def _done(request_id: str, reads_total: int = 1) -> wire.DoneReading:
    return wire.DoneReading(wire.WIRE_VERSION, request_id, "reader", 0, 0, [0], reads_total=reads_total)


def test_a_read_inside_every_granted_lease_is_covered(prefill):
    (a, address_a), (b, address_b) = prefill(30.0), prefill(30.0)
    a.holds.hold("r")
    b.holds.hold("r")
    client = ControlClient(timeout=2)
    check = LeaseCheck(client, [address_a, address_b], "decode", "r")
    assert check.covers(time.monotonic(), wait=2)
    assert 29 < check.granted <= 30
    # the renewal did not count as a read: the request is held until its done message
    assert len(a.holds) == 1 and a.holds.take_finished() == set()
    assert client.request(address_a, _done("r")).ok and a.holds.take_finished() == {"r"}


def test_a_rank_that_does_not_hold_the_request_yet_or_any_more_is_not_covered(prefill):
    (a, address_a), (_, address_b) = prefill(30.0), prefill(30.0)
    a.holds.hold("r")  # b has not been handed the request yet
    client = ControlClient(timeout=2)
    check = LeaseCheck(client, [address_a, address_b], "decode", "r")
    assert not check.covers(time.monotonic(), wait=2) and check.granted == 0.0
    a.holds.done("r", "reader", [0], 1)  # released by its done messages: not held any more either
    assert a.holds.take_finished() == {"r"}
    assert not LeaseCheck(client, [address_a], "decode", "r").covers(time.monotonic(), wait=2)


def test_a_read_longer_than_half_the_grant_is_not_covered_and_an_expired_lease_is_still_caught(prefill):
    rank, address = prefill(0.4)
    rank.holds.hold("r")
    client = ControlClient(timeout=2)
    check = LeaseCheck(client, [address], "decode", "r")
    time.sleep(0.5)  # the read outlives the lease
    assert not check.covers(time.monotonic(), wait=2)
    assert rank.holds.take_finished() == {"r"}  # the prefill rank frees it: its lease ran out
    reply = client.request(address, _done("r"))  # so the done message's answer decides
    assert reply.lease_expired and not reply.ok


def test_no_answer_in_time_is_not_covered_and_its_late_reply_answers_nothing_else(prefill):
    rank, address = prefill(30.0, delay_renew=0.3)
    rank.holds.hold("r")
    client = ControlClient(timeout=2)
    started = time.monotonic()
    assert not LeaseCheck(client, [address], "decode", "r").covers(time.monotonic(), wait=0.1)
    assert time.monotonic() - started < 0.25
    abandoned = LeaseCheck(client, [address], "decode", "r")
    abandoned.abandon()  # a failed read: the renewal's answer is never read
    time.sleep(0.7)  # both late answers have arrived by now, on sockets already closed
    reply = client.request(address, _done("r"))
    assert isinstance(reply, wire.Reply) and reply.ok and reply.lease_seconds == 0.0
    assert rank.holds.take_finished() == {"r"}


def test_a_decode_rank_that_reads_nothing_needs_no_lease():
    assert LeaseCheck(ControlClient(timeout=1), [], "decode", "r").covers(time.monotonic(), wait=0)


class _SimulatedPrefill:
    """A prefill rank on another host: its clock runs at ``rate`` of the true time plus
    an offset; it was handed the request ``held_for`` true seconds before the renewal
    was sent, ran a scheduler step (which frees expired leases) just before, and handles
    the renewal ``handle_delay`` true seconds after the send."""

    def __init__(self, world, lease, held_for, rate, offset, handle_delay):
        self.world, self.rate, self.offset, self.handle_delay = world, rate, offset, handle_delay
        self.holds = Holds(lease, clock=self.clock)
        sent = world["now"]
        world["now"] = sent - held_for
        self.holds.hold("r")
        world["now"] = sent
        self.freed_before = self.holds.take_finished()

    def clock(self):
        return self.world["now"] * self.rate + self.offset


class _SimulatedClient:
    """Delivers each renewal at its rank's handling time; the answers wait to be gathered."""

    def __init__(self, ranks, world):
        self.ranks, self.world = ranks, world

    def post_all(self, requests):
        sent, replies = self.world["now"], []
        for rank in self.ranks:
            self.world["now"] = sent + rank.handle_delay
            replies.append(wire.Reply(wire.WIRE_VERSION, True, lease_seconds=rank.holds.renew(["r"])))
        self.world["now"] = sent
        return replies

    def gather(self, posted, timeout):
        return posted


@settings(max_examples=500, deadline=None)
@given(
    lease=st.floats(0.5, 60),
    ranks=st.lists(
        st.tuples(
            st.floats(0, 90),  # held this long before the renewal
            st.floats(0.95, 1.05),  # clock rate
            st.floats(-1e6, 1e6),  # clock offset
            st.floats(0, 2),  # from the send to the handling
        ),
        min_size=1,
        max_size=4,
    ),
    decode_rate=st.floats(0.95, 1.05),
    read_seconds=st.floats(0, 90),
)
def test_covered_reads_end_before_any_lease_runs_out(lease, ranks, decode_rate, read_seconds):
    world = {"now": 100.0}
    prefills = [_SimulatedPrefill(world, lease, *rank) for rank in ranks]
    check = LeaseCheck(
        _SimulatedClient(prefills, world),
        ["x"] * len(prefills),
        "d",
        "r",
        clock=lambda: world["now"] * decode_rate,
    )
    world["now"] += read_seconds
    covered = check.covers(world["now"] * decode_rate, wait=1)
    still_held = all(not rank.freed_before for rank in prefills)
    assert covered == (still_held and read_seconds * decode_rate < SAFETY * lease)
    if covered:  # at the read's end no rank frees the request: what was read is what was written
        assert all(rank.holds.take_finished() == set() for rank in prefills)
