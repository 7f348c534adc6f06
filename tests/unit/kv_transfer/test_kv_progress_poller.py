"""The decode side's layer-wise progress poller on real ZeroMQ sockets on 127.0.0.1: many
pulls waiting on one prefill rank cost one question per round, each pull gets its own
transfer's answer, and a rank that does not answer fails only the pulls asking it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from harness.ports import free_ports
from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.control import ControlClient, ControlServer, ControlTimeout
from vllm.ascend.kv_transfer.layerwise import Publications, Publish
from vllm.ascend.kv_transfer.progress_poller import ProgressPoller


def _rank(port: int, pubs: Publications, seen: list) -> ControlServer:
    def handle(message):
        seen.append(message)
        return wire.ProgressReply(wire.WIRE_VERSION, pubs.progress(message.transfer_ids), pubs.published)

    return ControlServer("127.0.0.1", port, handle)


def test_64_waiting_pulls_cost_one_question_per_round_and_each_gets_its_own_answer():
    port = free_ports(1)
    pubs, seen = Publications(num_layers=2, expiry=10), []
    pubs.begin_step([Publish(f"t{i}", [[i]], 10 + i) for i in range(0, 64, 2)], [])  # the even ones
    server = _rank(port, pubs, seen)
    poller = ProgressPoller(ControlClient(timeout=5), gap=0.05)
    address = f"127.0.0.1:{port}"
    start = threading.Barrier(64)

    def pull(i: int):
        start.wait()
        return poller.ask([address], f"t{i}")

    try:
        with ThreadPoolExecutor(64) as pool:
            answers = list(pool.map(pull, range(64)))
    finally:
        poller.close()
        server.close()
    for i, (answer,) in enumerate(answers):
        assert answer.transfer_id == f"t{i}"
        if i % 2:
            assert answer.state == wire.UNKNOWN
        else:
            assert (answer.state, answer.block_ids, answer.num_tokens) == (wire.PUBLISHED, [[i]], 10 + i)
    # asked one by one this was 64 questions; a round gathers every question of its gap
    assert len(seen) == poller.messages == poller.rounds
    assert poller.rounds <= 4, poller.rounds
    assert sorted(t for m in seen for t in m.transfer_ids) == sorted(f"t{i}" for i in range(64))
    # the rank's count of published requests comes with every answer: its queue moves
    assert poller.published([address, "127.0.0.1:1"]) == (32, -1)


def test_an_unanswering_rank_fails_only_its_questions_and_the_next_round_is_answered():
    first = free_ports(2)
    ports = [first, first + 1]
    pubs, seen = Publications(num_layers=1, expiry=10), []
    pubs.begin_step([Publish("t", [[1]], 4)], [])
    server = _rank(ports[0], pubs, seen)  # nothing listens on the second port
    poller = ProgressPoller(ControlClient(timeout=0.3), gap=0.001)
    try:
        alive, silent = poller.ask([f"127.0.0.1:{p}" for p in ports], "t")
        assert alive.state == wire.PUBLISHED and isinstance(silent, ControlTimeout)
        (again,) = poller.ask([f"127.0.0.1:{ports[0]}"], "t")
        assert again.state == wire.PUBLISHED
    finally:
        poller.close()
        server.close()


def test_a_wrong_reply_is_an_error_naming_the_rank_and_the_idle_thread_comes_back():
    port = free_ports(1)
    server = ControlServer("127.0.0.1", port, lambda m: wire.Reply(wire.WIRE_VERSION, True))
    poller = ProgressPoller(ControlClient(timeout=5), gap=0.001, idle=0.05)
    try:
        (answer,) = poller.ask([f"127.0.0.1:{port}"], "t")
        assert isinstance(answer, RuntimeError) and f"127.0.0.1:{port}" in str(answer)
        threading.Event().wait(0.3)  # the thread has exited for want of questions
        (answer,) = poller.ask([f"127.0.0.1:{port}"], "u")
        assert isinstance(answer, RuntimeError) and poller.rounds == 2
    finally:
        poller.close()
        server.close()
