"""Decode side: did a pull's read end inside the prefill ranks' leases? If so, its done
messages need not be waited for.

A prefill rank frees a request's blocks when every read of it is reported or when its
lease runs out. Only the lease can free them while a decode rank still reads, and the
done message's answer (``lease_expired``) tells the decode rank so, one round trip after
the read. ``LeaseCheck`` learns it before the read ends instead: it sends ``Renew`` to
the prefill ranks the read uses just before reading, and each answers how long from its
handling of that message it holds the request (``Reply.lease_seconds``). Handling comes
after sending, so a read that ends, counted on this side from the send, within
``SAFETY`` x the shortest grant ended before any of those leases could run out. Then the
pull is reported at once and its done messages are sent after the report. A rank that
did not hold the request yet, an answer that did not come in time, or a read that took
too long leaves the caller to wait for the done messages' answers, as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.control import ControlClient

SAFETY = 0.5  # of the granted time: room for two hosts' clocks running at different rates


class LeaseCheck:
    """One pull's check: construct it just before the read (it sends the renewals), then
    call ``covers`` (or ``abandon``) on the same thread, before that client's next
    request to those ranks."""

    def __init__(
        self,
        client: ControlClient,
        addresses: list[str],
        engine_id: str,
        request_id: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._clock = clock
        message = wire.Renew(wire.WIRE_VERSION, engine_id, [request_id])
        self._sent_at = clock()
        self._posted = client.post_all([(address, message) for address in addresses]) if addresses else None
        self.granted: float | None = None  # the shortest grant, once asked for

    def covers(self, read_end: float, wait: float) -> bool:
        """True if a read that ended at ``read_end`` (this clock) ended inside every
        prefill rank's lease; waits at most ``wait`` seconds from the send for answers."""
        if self._posted is None:
            return True  # nothing is read from any prefill rank
        replies, self._posted = self._client.gather(self._posted, wait), None
        self.granted = min(
            reply.lease_seconds if isinstance(reply, wire.Reply) and reply.ok else 0.0 for reply in replies
        )
        return read_end - self._sent_at < SAFETY * self.granted

    def abandon(self) -> None:
        """The read failed: read what has come, drop the sockets of what has not."""
        if self._posted is not None:
            self._client.gather(self._posted, 0.0)
            self._posted = None
