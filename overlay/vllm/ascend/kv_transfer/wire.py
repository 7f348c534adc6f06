"""Control-plane messages of P2P disaggregated prefill (msgspec, msgpack on the wire).

Three messages, in the plan's vocabulary (``vllm.ascend.kv_transfer.plan``):

* ``BlocksReady`` (prefill -> decode): a request's KV is in these blocks of this prefill
  replica, laid out like this; enough for the decode side to build the plan.
* ``ReadThese``: one decode rank's reads of one request (the plan's rows for that rank),
  for the process that plans to hand to the process that reads.
* ``DoneReading`` (decode rank -> prefill rank): the reads with these ids are over
  (``ok`` false: they failed; the blocks are freed all the same). An empty ``read_ids``
  is the first decode rank telling an unread prefill rank to free.

Every message carries ``v`` (``WIRE_VERSION``). ``decode_message`` refuses, with a
``WireError`` naming the problem, anything over ``MAX_MESSAGE_BYTES``, not msgpack, of
an unknown type or version, or outside the field limits below; it never unpickles.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

from vllm.ascend.context_parallel.placement import CPLayout

WIRE_VERSION = 1
MAX_MESSAGE_BYTES = 16 << 20
MAX_BLOCKS = 1 << 20  # block-table entries of one request on one side
MAX_READS = 1 << 16  # reads in one message
MAX_RUNS = 1 << 16  # contiguous runs in one read

Count = Annotated[int, Meta(ge=0, lt=1 << 31)]
Size = Annotated[int, Meta(ge=1, le=1 << 16)]
Rank = Annotated[int, Meta(ge=0, lt=1 << 20)]
Text = Annotated[str, Meta(min_length=1, max_length=256)]


class WireError(ValueError):
    """A control message that was refused; the text says why."""


class Layout(Struct, frozen=True, forbid_unknown_fields=True):
    """A side's KV layout (``CPLayout``); ``kv_heads`` None means MLA."""

    tp: Size
    pcp: Size
    dcp: Size
    dp: Size
    interleave: Size
    block_size: Size
    kv_heads: Size | None

    @classmethod
    def of(cls, layout: CPLayout) -> Layout:
        return cls(layout.tp, layout.pcp, layout.dcp, layout.dp, layout.interleave, layout.block_size,
                   layout.kv_heads)

    def to_layout(self) -> CPLayout:
        return CPLayout(self.tp, self.pcp, self.dcp, self.dp, self.interleave, self.block_size, self.kv_heads)


class BlocksReady(Struct, tag="blocks_ready", forbid_unknown_fields=True):
    v: int
    request_id: Text
    engine_id: Text  # the prefill instance
    dp_rank: Count  # the prefill DP replica holding the request
    layout: Layout
    num_tokens: Count
    block_ids: Annotated[list[Count], Meta(max_length=MAX_BLOCKS)]


class ReadSpec(Struct, array_like=True, forbid_unknown_fields=True):
    """One read; ``runs`` rows are (position, source slot, destination slot, length)."""

    read_id: Count
    prefill_rank: Rank
    src_block: Count
    dst_block: Count
    head0: Count
    head1: Count
    runs: Annotated[list[tuple[Count, Count, Count, Count]], Meta(max_length=MAX_RUNS)]


class ReadThese(Struct, tag="read_these", forbid_unknown_fields=True):
    v: int
    request_id: Text
    decode_rank: Rank
    reads: Annotated[list[ReadSpec], Meta(max_length=MAX_READS)]


class DoneReading(Struct, tag="done_reading", forbid_unknown_fields=True):
    v: int
    request_id: Text
    decode_rank: Rank
    prefill_rank: Rank
    read_ids: Annotated[list[Count], Meta(max_length=MAX_READS)]
    ok: bool = True


Message = Union[BlocksReady, ReadThese, DoneReading]
MESSAGE_TYPES = {"blocks_ready": BlocksReady, "read_these": ReadThese, "done_reading": DoneReading}


class _Envelope(Struct):
    """Read first, so a message of another version is named as such, not as malformed."""

    type: str
    v: int


_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_DECODER = msgspec.msgpack.Decoder(Message)


def encode_message(message: Message) -> bytes:
    data = _ENCODER.encode(message)
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"{type(message).__name__} is {len(data)} bytes, over the {MAX_MESSAGE_BYTES}-byte "
                        "limit: split the request's reads over several messages")
    return data


def decode_message(data: bytes) -> Message:
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        envelope = _ENVELOPE.decode(data)
    except msgspec.DecodeError as e:
        raise WireError(f"not a control message (need a msgpack map with 'type' and 'v'): {e}") from None
    if envelope.type not in MESSAGE_TYPES:
        raise WireError(f"unknown message type {envelope.type!r}; expected one of {sorted(MESSAGE_TYPES)}")
    if envelope.v != WIRE_VERSION:
        raise WireError(f"{envelope.type} has wire version {envelope.v}, this build speaks {WIRE_VERSION}: "
                        "run the same vllm-ascend build on prefill and decode")
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError as e:
        raise WireError(f"malformed {envelope.type}: {e}") from None


def read_these(plan, decode_rank: int, request_id: str) -> ReadThese:
    """A decode rank's share of a plan as a message."""
    reads = []
    for i in plan.read_ids_of(decode_rank).tolist():
        runs = [tuple(row) for row in plan.runs(i).tolist()]
        reads.append(ReadSpec(i, int(plan.prefill_rank[i]), int(plan.src_block[i]), int(plan.dst_block[i]),
                              int(plan.head0[i]), int(plan.head1[i]), runs))
    return ReadThese(WIRE_VERSION, request_id, decode_rank, reads)


def done_messages(plan, request_id: str, failed: frozenset[int] = frozenset()) -> list[DoneReading]:
    """The plan's done messages; a message whose reads include a failed one has ``ok`` False."""
    return [DoneReading(WIRE_VERSION, request_id, m.decode_rank, m.prefill_rank, list(m.read_ids),
                        ok=not failed.intersection(m.read_ids)) for m in plan.done_messages()]
