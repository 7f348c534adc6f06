"""The Mooncake TransferEngine transport (``mooncake.engine``).

Host emulation and CI: the wheel's ``mooncake-host`` extra
(``mooncake-transfer-engine-non-cuda``) over TCP; it needs the system libraries
``libibverbs1`` and ``libnuma1``. Ascend hosts: the ``mooncake`` extra
(``mooncake-transfer-engine-npu``), protocol ``ascend`` (NPU-unverified). Peers find
each other without a metadata server (``P2PHANDSHAKE``): a rank's address is
``host:rpc_port``.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from vllm.ascend.kv_transfer.transport.base import Region, TransferError, Transport


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self, host: str, options: dict):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise RuntimeError(
                "the mooncake transport needs Mooncake's TransferEngine: install the wheel's 'mooncake' "
                "extra on Ascend hosts, or its 'mooncake-host' extra on CPU hosts (which also need "
                f"apt-get install libibverbs1 libnuma1) ({e})"
            ) from None
        # the data socket binds where the control plane does; the engine reads its timeout
        # and log level from the environment when it is built
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(int(options.get("transfer_timeout", 30))))
        self._engine = TransferEngine()
        protocol = str(options.get("mooncake_protocol", "tcp"))
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, str(options.get("device_name", "")))
        if rc != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}"
            )
        self._address = f"{host}:{self._engine.get_rpc_port()}"
        # The engine cuts ranges into slices (MC_SLICE_SIZE bytes) and its TCP lanes queue a
        # bounded number per peer, refusing a batch beyond that: a read is submitted in
        # chunks of at most ``batch_slices`` slices.
        self._slice_bytes = int(os.environ.get("MC_SLICE_SIZE", 65536))
        self._batch_slices = int(options.get("batch_slices", 1024))
        self._regions: list[int] = []
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return self._address

    def register(self, regions: list[Region]) -> None:
        spans: list[list[int]] = []  # touching or shared planes become one registration
        for region in sorted(regions, key=lambda r: r.base):
            if spans and region.base <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], region.base + region.length)
            else:
                spans.append([region.base, region.base + region.length])
        bases, lengths = [b for b, _ in spans], [e - b for b, e in spans]
        rc = self._engine.batch_register_memory(bases, lengths)
        if rc != 0:
            raise RuntimeError(f"Mooncake batch_register_memory of {len(regions)} regions returned {rc}")
        self._regions += bases

    def chunks(self, lengths: np.ndarray) -> list[slice]:
        """The read's ranges cut into submissions of at most ``batch_slices`` slices each (a
        range larger than that alone)."""
        slices = np.cumsum(-(-np.asarray(lengths, dtype=np.int64) // self._slice_bytes))
        bounds, start = [], 0
        while start < len(slices):
            base = slices[start - 1] if start else 0
            end = max(start + 1, int(np.searchsorted(slices, base + self._batch_slices, side="right")))
            bounds.append(slice(start, end))
            start = end
        return bounds

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> None:
        if len(lengths) == 0:
            return
        for part in self.chunks(lengths):
            self._read_chunk(peer, local[part], remote[part], lengths[part])

    def _read_chunk(self, peer: str, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> None:
        args = (peer, local.tolist(), remote.tolist(), lengths.tolist())
        for attempt in (1, 2):  # a TCP session the engine had to drop is re-opened once
            if attempt == 2:
                time.sleep(0.5)  # outside the lock: other pulls go on meanwhile
            with self._lock:  # one batch at a time: the engine's waits spin a core each
                rc = self._engine.batch_transfer_sync_read(*args)
            if rc == 0:
                return
        raise TransferError(
            f"Mooncake read of {len(lengths)} ranges ({int(lengths.sum())} bytes) from {peer} returned {rc}"
        )

    def close(self) -> None:
        if self._engine is None:
            return
        if self._regions:
            self._engine.batch_unregister_memory(self._regions)
            self._regions = []
        self._engine = None
