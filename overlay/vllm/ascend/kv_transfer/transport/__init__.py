"""Transports: how a decode rank reads byte ranges out of a prefill rank's KV cache.

One small interface: ``register`` the KV planes peers may read (and this rank writes
into), ``connect`` to a peer once its planes are known, ``read`` a batch of (local
address, remote address, length) from it, ``close``. The connector never sees which
library moves the bytes. A transport that can only move whole blocks says so
(``whole_blocks``); the connector then asks it for whole blocks or refuses the layout.
"""

from __future__ import annotations

from vllm.ascend.kv_transfer.transport.base import Region, TransferError, Transport

__all__ = ["Region", "TransferError", "Transport", "open_transport"]


def open_transport(name: str, host: str, options: dict) -> Transport:
    """The transport named in ``kv_connector_extra_config["transport"]``."""
    if name == "mooncake":
        from vllm.ascend.kv_transfer.transport.mooncake import MooncakeTransport

        return MooncakeTransport(host, options)
    if name == "llmdatadist":
        from vllm.ascend.kv_transfer.transport.llmdatadist import LLMDataDistTransport

        return LLMDataDistTransport(host, options)
    raise ValueError(
        f"unknown KV transport {name!r}: kv_connector_extra_config.transport must be "
        "'mooncake' or 'llmdatadist'"
    )
