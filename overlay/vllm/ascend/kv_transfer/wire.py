"""Control-plane messages of P2P disaggregated prefill (msgspec, msgpack on the wire).

The plan's message (``vllm.ascend.kv_transfer.plan``):

* ``DoneReading`` (decode rank -> prefill rank): the reads with these ids of one
  ``reader`` (a decode request) are over (``ok`` false: they failed). ``reads_total`` is
  how many reads the plan gives that prefill rank for the request, so it counts the
  reader done once it has heard of all of them; 0 (with no read ids) says the reader is
  done now (an unread rank, an aborted request). The blocks are freed once every reader the
  request was held for is done. The ``Reply`` says whether the blocks were held while the
  reader read them (``held``); anything else means what was read is discarded.

The connector's handshake and lease messages: ``Hello`` -> ``RankInfo`` (a prefill rank's
layout, transport address and KV regions), ``Renew`` (decode still wants these
requests: extend their leases) and ``Reply`` (the answer to anything else; to a
``DoneReading`` whose request's lease had already run out it says ``lease_expired``, to
a ``Renew`` for how long from then all its requests stay held: ``lease_seconds``).

Layer-wise transfer (``layerwise_id``): ``Progress`` (decode rank -> prefill rank: how far
are these transfers) -> ``ProgressReply``, one ``TransferProgress`` per id: unknown yet,
published (the prefill request's block tables, its token count and the layers written
so far, as indices into that rank's ``RankInfo.layers``) or failed.

Every message carries ``v`` (``WIRE_VERSION``). ``decode_message`` refuses, with a
``WireError`` naming the problem, anything over ``MAX_MESSAGE_BYTES``, not msgpack, of
an unknown type or version, or outside the field limits below; it never unpickles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import msgspec
from msgspec import Meta, Struct

from vllm.ascend.context_parallel.placement import CPLayout

if TYPE_CHECKING:
    from vllm.ascend.kv_transfer.plan import TransferPlan

# 2: every layer names its KV-cache group; 3: layer-wise progress; 4: granted leases; 5: readers;
# 6: a rank's count of published requests in ProgressReply
WIRE_VERSION = 6
MAX_MESSAGE_BYTES = 16 << 20
MAX_READS = 1 << 16  # reads in one message
MAX_READERS = 1024  # decode requests one prefill request is held for (a parallel-sampling n)

Count = Annotated[int, Meta(ge=0, lt=1 << 31)]
Address = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]  # user-space addresses fit int64
MAX_LAYERS = 4096
MAX_RENEW = 1 << 16
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
        return cls(
            layout.tp,
            layout.pcp,
            layout.dcp,
            layout.dp,
            layout.interleave,
            layout.block_size,
            layout.kv_heads,
        )

    def to_layout(self) -> CPLayout:
        return CPLayout(self.tp, self.pcp, self.dcp, self.dp, self.interleave, self.block_size, self.kv_heads)


class DoneReading(Struct, tag="done_reading", forbid_unknown_fields=True):
    v: int
    request_id: Text
    reader: Text  # the decode request that read (or will not read) it
    decode_rank: Rank
    prefill_rank: Rank
    read_ids: Annotated[list[Count], Meta(max_length=MAX_READS)]
    reads_total: Count = 0
    ok: bool = True


class Hello(Struct, tag="hello", forbid_unknown_fields=True):
    v: int
    engine_id: Text  # who asks


class PlaneSpec(Struct, array_like=True, forbid_unknown_fields=True):
    heads: Size
    head_bytes: Annotated[int, Meta(ge=1, lt=1 << 40)]  # one head's slots of one block


class LayerRegion(Struct, array_like=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=512)]
    base: Address
    num_blocks: Count
    planes: Annotated[list[PlaneSpec], Meta(max_length=8)]
    group: Annotated[int, Meta(ge=0, lt=64)] = 0  # its KV-cache group (block table)


class RankInfo(Struct, tag="rank_info", forbid_unknown_fields=True):
    v: int
    engine_id: Text
    dp_rank: Count
    rank: Rank  # inside the DP replica: pcp_rank x TP + tp_rank
    layout: Layout
    transport: Text
    address: Text  # where the transport reads from this rank
    layers: Annotated[list[LayerRegion], Meta(max_length=MAX_LAYERS)]


class Renew(Struct, tag="renew", forbid_unknown_fields=True):
    v: int
    engine_id: Text
    request_ids: Annotated[list[Text], Meta(max_length=MAX_RENEW)]


class Reply(Struct, tag="reply", forbid_unknown_fields=True):
    v: int
    ok: bool
    error: Annotated[str, Meta(max_length=2048)] = ""
    # answering DoneReading: the request's lease ran out before these reads were reported,
    # so its blocks may have been reused while they were read; the reader discards them
    lease_expired: bool = False
    # answering Renew: every named request is held for at least this long from when the
    # Renew was handled (0: one of them is not held)
    lease_seconds: Annotated[float, Meta(ge=0)] = 0.0
    # answering DoneReading: the blocks were held while this reader read them
    held: bool = False


MAX_PROGRESS = 1024  # transfers asked about in one Progress
UNKNOWN, PUBLISHED, FAILED = "unknown", "published", "failed"


class Progress(Struct, tag="progress", forbid_unknown_fields=True):
    v: int
    transfer_ids: Annotated[list[Text], Meta(min_length=1, max_length=MAX_PROGRESS)]


class TransferProgress(Struct, forbid_unknown_fields=True):
    transfer_id: Text
    state: Annotated[str, Meta(pattern="^(unknown|published|failed)$")]
    block_ids: Annotated[list[list[Count]], Meta(max_length=64)] = []  # per KV-cache group
    num_tokens: Count = 0
    backoff: Count = 0
    layers: Annotated[list[Count], Meta(max_length=MAX_LAYERS)] = []  # written so far


class ProgressReply(Struct, tag="progress_reply", forbid_unknown_fields=True):
    v: int
    transfers: Annotated[list[TransferProgress], Meta(max_length=MAX_PROGRESS)]
    published: Count = 0  # requests this rank has published since it started (its queue moves)


Message = DoneReading | Hello | RankInfo | Renew | Reply | Progress | ProgressReply
MESSAGE_TYPES = {
    "done_reading": DoneReading,
    "hello": Hello,
    "rank_info": RankInfo,
    "renew": Renew,
    "reply": Reply,
    "progress": Progress,
    "progress_reply": ProgressReply,
}


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
        raise WireError(
            f"{type(message).__name__} is {len(data)} bytes, over the {MAX_MESSAGE_BYTES}-byte "
            "limit: split the request's reads over several messages"
        )
    return data


def decode_message(data: bytes) -> Message:
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        envelope = _ENVELOPE.decode(data)
    except (msgspec.DecodeError, RecursionError) as e:  # (a deeply nested payload recurses)
        raise WireError(
            f"not a control message (need a msgpack map with 'type' and 'v'): {_short(e)}"
        ) from None
    if envelope.type not in MESSAGE_TYPES:
        raise WireError(f"unknown message type {envelope.type!r}; expected one of {sorted(MESSAGE_TYPES)}")
    if envelope.v != WIRE_VERSION:
        raise WireError(
            f"{envelope.type} has wire version {envelope.v}, this build speaks {WIRE_VERSION}: "
            "run the same vllm-ascend build on prefill and decode"
        )
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, RecursionError) as e:
        raise WireError(f"malformed {envelope.type}: {_short(e)}") from None


def _short(error: Exception) -> str:
    """An error's text for a log line: what went wrong, never the payload itself."""
    text = str(error) or type(error).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def done_messages(
    plan: TransferPlan, request_id: str, reader: str, failed: frozenset[int] = frozenset()
) -> list[DoneReading]:
    """The plan's done messages; a message whose reads include a failed one has ``ok`` False."""
    return [
        DoneReading(
            WIRE_VERSION,
            request_id,
            reader,
            m.decode_rank,
            m.prefill_rank,
            list(m.read_ids),
            reads_total=plan.reads_served.get(m.prefill_rank, 0),
            ok=not failed.intersection(m.read_ids),
        )
        for m in plan.done_messages()
    ]
