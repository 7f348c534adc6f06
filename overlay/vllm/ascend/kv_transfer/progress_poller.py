"""Layer-wise transfer, decode side: one ``Progress`` question per prefill rank per round
for every pull waiting on that rank (thread-safe).

Each layer-wise pull waits for the prefill instance to publish its request, then for its
layers. Asking on its own every few milliseconds, 64 pulls in flight made a prefill rank
answer thousands of questions a second on the host threads its forward needs (its prompt
throughput fell several-fold, and the last requests of a burst waited past their
publish deadline). Pulls now put their question to the prefill instance's poller: one
thread asks each rank about every transfer waiting on it in one message, at most once
per ``gap``, and hands each pull its answer. One poller per prefill instance, so an
unreachable instance holds up only the pulls from it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.control import ControlClient

Answer = wire.TransferProgress | Exception


class ProgressPoller:
    """Asks the ranks of one prefill instance about the transfers pulls wait on.

    ``ask`` blocks until the first round that starts after it has been answered; its
    thread exits after ``idle`` seconds without a question and starts again on the next."""

    def __init__(self, client: ControlClient, gap: float = 0.002, idle: float = 10.0, name: str = ""):
        self._client = client
        self.gap, self.idle = gap, idle
        self._name = name
        self._cond = threading.Condition()
        self._asked: dict[str, set[str]] = {}  # address -> transfer ids of the next round
        self._answers: dict[tuple[str, str], Answer] = {}  # (address, transfer id), until taken
        self._started = self._finished = 0  # rounds
        self._thread: threading.Thread | None = None
        self._closed = False
        self._published: dict[str, int] = {}  # address -> its count of published requests
        self.rounds = self.messages = 0  # what it sent, for tests and logs

    def ask(self, addresses: Sequence[str], transfer_id: str) -> list[Answer]:
        """Each address's answer about ``transfer_id``: its progress there, or the
        exception asking it met."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the KV connector is shutting down")
            for address in addresses:
                self._asked.setdefault(address, set()).add(transfer_id)
            answered_by = self._started + 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"kv-p2p-progress{self._name}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
            while self._finished < answered_by and not self._closed:
                self._cond.wait()
            if self._closed:
                raise RuntimeError("the KV connector is shutting down")
            return [self._answers.pop((address, transfer_id)) for address in addresses]

    def published(self, addresses: Sequence[str]) -> tuple[int, ...]:
        """How many requests each rank had published at its last answer: while it changes,
        the prefill instance is working through its queue."""
        with self._cond:
            return tuple(self._published.get(address, -1) for address in addresses)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                deadline = time.monotonic() + self.idle
                while not self._asked and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._thread = None  # the next question starts another
                        return
                    self._cond.wait(left)
                if self._closed:
                    return
            time.sleep(self.gap)  # the questions of other pulls join this round
            with self._cond:
                asked, self._asked = self._asked, {}
                self._started += 1
            try:
                answers = self._round(asked)
            except Exception as e:  # a bug here must not leave pulls waiting for ever
                answers = {(address, i): e for address, ids in asked.items() for i in ids}
            with self._cond:
                self._answers.update(answers)
                self._finished += 1
                self._cond.notify_all()

    def _round(self, asked: dict[str, set[str]]) -> dict[tuple[str, str], Answer]:
        answers: dict[tuple[str, str], Answer] = {}
        pending = {address: sorted(ids) for address, ids in asked.items()}
        while pending:  # more than MAX_PROGRESS transfers on a rank: further messages
            batch = {address: ids[: wire.MAX_PROGRESS] for address, ids in pending.items()}
            pending = {
                a: ids[wire.MAX_PROGRESS :] for a, ids in pending.items() if len(ids) > wire.MAX_PROGRESS
            }
            requests = [(address, wire.Progress(wire.WIRE_VERSION, ids)) for address, ids in batch.items()]
            self.messages += len(requests)
            try:
                replies: list = self._client.request_all(requests)
            except Exception as e:  # not one reply came back: every question gets the error
                replies = [e] * len(requests)
            for (address, ids), reply in zip(batch.items(), replies):
                answers.update(_answers_of(address, ids, reply))
                if isinstance(reply, wire.ProgressReply):
                    with self._cond:
                        self._published[address] = reply.published
        self.rounds += 1
        return answers


def _answers_of(address: str, ids: list[str], reply) -> dict[tuple[str, str], Answer]:
    if isinstance(reply, Exception):
        return {(address, i): reply for i in ids}
    if isinstance(reply, wire.ProgressReply):
        got = {t.transfer_id: t for t in reply.transfers}
        if set(got) == set(ids):
            return {(address, i): got[i] for i in ids}
    wrong = RuntimeError(f"the prefill rank at {address} answered Progress with {reply}")
    return {(address, i): wrong for i in ids}
