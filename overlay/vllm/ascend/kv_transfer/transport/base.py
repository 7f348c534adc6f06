"""The transport interface (the package's ``__init__`` picks an implementation)."""

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
