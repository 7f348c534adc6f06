"""Layer-wise transfer, prefill side: which layers of a request's KV are written (pure,
thread-safe).

A request sent with ``kv_transfer_params.layerwise_id`` is *published* in the step that
computes its last prompt tokens: the scheduler hands the workers its block tables and
token count (``P2PConnectorMetadata.publishes``). During that step's forward each
attention layer's ``save_kv_layer`` records a device event after the layer's KV writes;
a layer counts as written once its event has completed, so a decode rank may read it
while later layers still compute. At the end of the forward every layer not reported
yet is recorded too (layers whose attention does not pass the connector hook).

A request that ends before it was published (aborted, refused) is marked *failed*, so
the decode side stops waiting and computes the prompt itself. Published entries are
answered failed once the request's hold is released, and dropped ``expiry`` seconds
after they fail.
Decode ranks ask with ``wire.Progress``; ``progress`` answers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger

from vllm.ascend.context_parallel.placement import CPLayout
from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.control import ControlClient

logger = init_logger(__name__)


@dataclass(frozen=True)
class Publish:
    """What the scheduler hands the workers for one layer-wise request."""

    transfer_id: str
    block_ids: list  # per transferred KV-cache group
    num_tokens: int
    backoff: int = 0


@dataclass
class _Entry:
    publish: Publish | None  # None: failed before it was published
    written: set = field(default_factory=set)
    pending: list = field(default_factory=list)  # (event, layer indices), in stream order
    failed: bool = False
    until: float = 0.0


class Publications:
    def __init__(self, num_layers: int, expiry: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.num_layers = num_layers
        self.expiry = expiry
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._saving: list[_Entry] = []  # published in the step now running
        self._reported: set[int] = set()  # layers this step has recorded
        self.published = 0  # requests published since start: decode ranks see the queue move

    def begin_step(self, publishes: list[Publish], failed: list[str]) -> None:
        now = self._clock()
        with self._lock:
            for transfer_id in failed:
                entry = self._entries.setdefault(transfer_id, _Entry(None))
                entry.failed, entry.until = True, now + self.expiry
            self._saving = []
            self._reported = set()
            self.published += len(publishes)
            for publish in publishes:
                entry = self._entries[publish.transfer_id] = _Entry(publish)
                self._saving.append(entry)
            for transfer_id, entry in list(self._entries.items()):
                if entry.publish is None and entry.until < now:
                    del self._entries[transfer_id]

    @property
    def saving(self) -> bool:
        return bool(self._saving)

    def layer_saved(self, index: int, event: Any) -> None:
        """Layer ``index`` of this step's published requests is written once ``event``
        (recorded after its KV writes) completes."""
        with self._lock:
            if index in self._reported:
                return
            self._reported.add(index)
            for entry in self._saving:
                entry.pending.append((event, (index,)))

    def end_step(self, event: Any) -> int:
        """The forward is over: every layer not reported yet is written once ``event``
        completes. Returns how many layers had their own event."""
        with self._lock:
            rest = tuple(i for i in range(self.num_layers) if i not in self._reported)
            if rest:
                for entry in self._saving:
                    entry.pending.append((event, rest))
            self._saving = []
            return self.num_layers - len(rest)

    def retire(self, transfer_id: str) -> None:
        """The request's hold is released: a late question is answered failed (its blocks
        may be reused), for ``expiry`` seconds."""
        with self._lock:
            entry = self._entries.get(transfer_id)
            if entry is not None:
                entry.publish, entry.failed, entry.until = None, True, self._clock() + self.expiry

    def progress(self, transfer_ids: Iterable[str]) -> list[wire.TransferProgress]:
        out = []
        with self._lock:
            for transfer_id in transfer_ids:
                entry = self._entries.get(transfer_id)
                if entry is None:
                    out.append(wire.TransferProgress(transfer_id, wire.UNKNOWN))
                    continue
                if entry.failed or entry.publish is None:
                    out.append(wire.TransferProgress(transfer_id, wire.FAILED))
                    continue
                while entry.pending and entry.pending[0][0].query():  # completes in order
                    entry.written.update(entry.pending.pop(0)[1])
                publish = entry.publish
                out.append(
                    wire.TransferProgress(
                        transfer_id,
                        wire.PUBLISHED,
                        publish.block_ids,
                        publish.num_tokens,
                        publish.backoff,
                        sorted(entry.written),
                    )
                )
        return out

    def __len__(self) -> int:
        return len(self._entries)


def release_messages(
    host: str, port: int, layout: CPLayout, transfer_id: str, reader: str
) -> list[tuple[str, wire.DoneReading]]:
    """Done messages that tell every rank of every replica of the prefill instance whose
    first control port is ``port`` that ``reader`` is done with a layer-wise request (which
    replica has it is not known; where it is not held yet the message waits as an early one)."""
    ranks = layout.ranks_per_replica
    return [
        (
            f"{host}:{port + d * ranks + r}",
            wire.DoneReading(wire.WIRE_VERSION, transfer_id, reader, 0, r, [], reads_total=0, ok=False),
        )
        for d in range(layout.dp)
        for r in range(ranks)
    ]


def release(
    client: ControlClient, host: str, port: int, layout: CPLayout, transfer_id: str, reader: str
) -> None:
    """Send the ``release_messages`` of a layer-wise request; a rank that does not answer
    is logged (its lease frees the blocks anyway)."""
    requests = release_messages(host, port, layout, transfer_id, reader)
    for (address, _), reply in zip(requests, client.request_all(requests)):
        if isinstance(reply, Exception):
            logger.warning("layer-wise request %s: its release to %s failed: %s", transfer_id, address, reply)
