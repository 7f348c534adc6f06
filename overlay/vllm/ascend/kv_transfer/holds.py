"""Prefill side: when may a finished request's KV blocks be freed (pure, thread-safe).

A request is *held* from the step the scheduler hands it over (``hold``) for ``readers``
decode requests (one, or the ``n`` of a parallel-sampling request: each child reads it)
until every one of them has reported all the reads the plan gives this rank
(``DoneReading.read_ids`` of that reader add up to ``reads_total``; 0 means that reader is
done now), or its lease runs out without a ``renew``. It is reported finished exactly once
(``take_finished``). Done messages that arrive before the request is held are kept
(bounded) and applied when it is.

What ``done`` answers decides whether the reader may keep what it read: ``COUNTED`` and
``EARLY`` (the blocks were held while it read), ``EXPIRED`` (its lease ran out first) and
``NOT_HELD`` (already released by other readers, or never handed over here and forgotten:
nothing vouches for the blocks). A reader that was counted before the release gets
``COUNTED`` again for a repeated message.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclass
class _Hold:
    deadline: float
    readers: int = 1
    heard: dict = field(default_factory=dict)  # reader -> read ids heard
    finished: set = field(default_factory=set)  # readers whose reads are all reported


class Done(enum.Enum):
    """What ``Holds.done`` answers about a reader's done message (the module's text)."""

    COUNTED = "counted"
    EARLY = "early"
    EXPIRED = "expired"
    DROPPED = "dropped"
    NOT_HELD = "not held"

    @property
    def held(self) -> bool:
        """The blocks were held while the reader read: it may keep its reads."""
        return self in (Done.COUNTED, Done.EARLY)


class Holds:
    def __init__(
        self,
        lease_seconds: float,
        max_early: int = 4096,
        max_expired: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lease = lease_seconds
        self._clock = clock
        self._max_early = max_early
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._early: dict[str, list] = {}
        self._early_deadline: dict[str, float] = {}
        # recently released by their readers: (until, the readers counted) for late repeats
        self._released: dict[str, tuple[float, frozenset]] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()  # released by lease expiry (bounded)
        self._max_expired = max_expired
        self._finished: set[str] = set()
        self._newly_expired = 0  # leases run out since the last take_expired_count

    def hold(self, request_id: str, lease: float | None = None, readers: int = 1) -> None:
        with self._lock:
            self._holds[request_id] = _Hold(self._clock() + (self.lease if lease is None else lease), readers)
            self._early_deadline.pop(request_id, None)
            for reader, read_ids, total in self._early.pop(request_id, ()):
                if request_id in self._holds:  # an earlier message may have released it
                    self._done(request_id, reader, read_ids, total)

    def done(self, request_id: str, reader: str, read_ids: Iterable[int], reads_total: int) -> Done:
        """Record ``reader``'s done message; what it may conclude (see the module's text)."""
        with self._lock:
            if request_id in self._expired:
                return Done.EXPIRED
            if request_id in self._holds:
                self._done(request_id, reader, read_ids, reads_total)
                return Done.COUNTED
            released = self._released.get(request_id)
            if released is not None:
                return Done.COUNTED if reader in released[1] else Done.NOT_HELD
            if sum(len(v) for v in self._early.values()) >= self._max_early:
                return Done.DROPPED
            self._early.setdefault(request_id, []).append((reader, list(read_ids), reads_total))
            self._early_deadline.setdefault(request_id, self._clock() + self.lease)
            return Done.EARLY

    def _done(self, request_id: str, reader: str, read_ids, reads_total: int) -> None:
        hold = self._holds[request_id]
        heard = hold.heard.setdefault(reader, set())
        heard.update(read_ids)
        if len(heard) >= reads_total:
            hold.finished.add(reader)
        if len(hold.finished) >= hold.readers:
            self._release(request_id)

    def renew(self, request_ids: Iterable[str]) -> float:
        """Extend the leases of those held; how long from now all of them stay held at
        least (0.0 if one is not held: not handed over yet, or already released)."""
        with self._lock:
            now = self._clock()
            deadline = now + self.lease
            remaining = float("inf")
            for request_id in request_ids:
                hold = self._holds.get(request_id)
                if hold is None:
                    remaining = 0.0
                    continue
                hold.deadline = max(hold.deadline, deadline)
                remaining = min(remaining, hold.deadline - now)
            return 0.0 if remaining == float("inf") else remaining

    def _release(self, request_id: str) -> None:
        hold = self._holds.pop(request_id)
        self._finished.add(request_id)
        self._released[request_id] = (self._clock() + self.lease, frozenset(hold.finished))

    def take_finished(self) -> set[str]:
        """Requests whose blocks may be freed now (each reported once); expires leases."""
        now = self._clock()
        with self._lock:
            for request_id, hold in list(self._holds.items()):
                if hold.deadline < now:
                    logger.warning(
                        "request %s: no word from the decode side within the %.0f s lease; freeing "
                        "its KV blocks",
                        request_id,
                        self.lease,
                    )
                    self._release(request_id)
                    self._released.pop(request_id)
                    self._expired[request_id] = None
                    self._newly_expired += 1
                    if len(self._expired) > self._max_expired:
                        self._expired.popitem(last=False)
            for request_id, (until, _) in list(self._released.items()):
                if until < now:
                    del self._released[request_id]
            for request_id, until in list(self._early_deadline.items()):
                if until < now:  # done messages for a request this rank was never given
                    del self._early_deadline[request_id]
                    self._early.pop(request_id, None)
            finished, self._finished = self._finished, set()
        return finished

    def take_expired_count(self) -> int:
        """Leases that ran out since the last call (for the connector's statistics)."""
        with self._lock:
            count, self._newly_expired = self._newly_expired, 0
        return count

    def __len__(self) -> int:
        return len(self._holds)
