"""Transports: how a decode rank reads byte ranges out of a prefill rank's KV cache.

One small interface: ``register`` the KV planes peers may read (and this rank writes
into), ``connect`` to a peer once its planes are known, ``read`` a batch of (local
address, remote address, length) from it, ``close``. The connector never sees which
library moves the bytes. A transport that can only move whole blocks says so
(``whole_blocks``); the connector then asks it for whole blocks or refuses the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class TransferError(RuntimeError):
    """A read that did not complete; the message says which peer and why."""


@dataclass(frozen=True)
class Region:
    """One KV plane of one layer: ``num_blocks`` blocks of ``block_bytes`` from ``base``."""

    base: int
    num_blocks: int
    block_bytes: int

    @property
    def length(self) -> int:
        return self.num_blocks * self.block_bytes


class Transport:
    name = "abstract"
    whole_blocks = False  # True: every read range must be exactly one block of a region

    @property
    def address(self) -> str:
        """What a peer passes to ``connect``/``read`` to reach this rank."""
        raise NotImplementedError

    def register(self, regions: list[Region]) -> None:
        raise NotImplementedError

    def connect(self, peer: str, regions: list[Region]) -> None:
        """Called once per peer before reading from it, with the peer's regions."""

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> None:
        """Copy ``lengths[i]`` bytes from ``remote[i]`` on ``peer`` to ``local[i]``, all or raise."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def open_transport(name: str, host: str, options: dict) -> Transport:
    """The transport named in ``kv_connector_extra_config["transport"]``."""
    if name == "mooncake":
        from vllm.ascend.kv_transfer.transport.mooncake import MooncakeTransport

        return MooncakeTransport(host, options)
    if name == "llmdatadist":
        from vllm.ascend.kv_transfer.transport.llmdatadist import LLMDataDistTransport

        return LLMDataDistTransport(host, options)
    raise ValueError(f"unknown KV transport {name!r}: kv_connector_extra_config.transport must be "
                     "'mooncake' or 'llmdatadist'")
