"""What the connector's scheduler side hands its worker side each step, and the decode
request's ``kv_transfer_params`` it is built from: both sides import it from here.

``RemotePrefill`` is the parameters of a decode request as the prefill instance returned
them (bounded in every field; the worker bounds the block ids by the prefill's cache);
``RecvSpec`` one pull the step asks for; ``P2PConnectorMetadata`` the step's sends, pulls,
layer-wise publishes and refusals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import msgspec
from msgspec import Meta

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.layerwise import Publish

MAX_RANKS = 4096  # ranks of one prefill replica, or replicas of one instance
_Port = Annotated[int, Meta(ge=1, le=65535)]
_Small = Annotated[int, Meta(ge=0, lt=MAX_RANKS)]
_Count = Annotated[int, Meta(ge=0, lt=1 << 31)]
_Text = Annotated[str, Meta(max_length=256)]


class RemotePrefill(msgspec.Struct, forbid_unknown_fields=False):
    """``kv_transfer_params`` of a decode request, as the prefill instance returned them
    (every field bounded here; the worker bounds the block ids by the prefill's cache)."""

    remote_host: Annotated[str, Meta(min_length=1, max_length=256)]
    remote_port: _Port  # layer-wise: the prefill instance's kv_port (the replica is found)
    remote_engine_id: _Text = ""
    remote_request_id: _Text = ""  # the key of its holds: the prefill's id, or layerwise_id
    remote_ranks: _Small = 0
    remote_dp_rank: _Small = 0
    # per transferred KV-cache group
    remote_block_ids: Annotated[
        list[Annotated[list[_Count], Meta(max_length=1 << 20)]], Meta(max_length=64)
    ] = []
    remote_num_tokens: _Count = 0  # tokens computed there: the prompt minus ``remote_backoff``
    remote_backoff: _Count = 0
    remote_readers: Annotated[int, Meta(ge=1, le=wire.MAX_READERS)] = 1
    remote_prompt_digest: _Text = ""
    do_remote_prefill: bool = False
    # layer-wise: the transfer's id; the blocks and token count come from the prefill rank
    layerwise_id: str | None = None

    def __post_init__(self):
        if self.layerwise_id is None and not (
            self.remote_engine_id and self.remote_request_id and self.remote_ranks > 0
        ):
            raise ValueError("remote_engine_id, remote_request_id and remote_ranks are required")
        if self.layerwise_id is not None and not 0 < len(self.layerwise_id) <= 256:
            raise ValueError("layerwise_id must be 1 to 256 characters")


@dataclass
class RecvSpec:
    request_id: str
    remote: RemotePrefill
    first_token: int  # tokens before it are cached here and are not pulled
    local_block_ids: list[list[int]]  # per transferred KV-cache group


@dataclass
class P2PConnectorMetadata(KVConnectorMetadata):
    sends: dict[str, float] = field(default_factory=dict)  # request id -> lease seconds
    recvs: list[RecvSpec] = field(default_factory=list)
    # layer-wise (prefill): the hold key of a send (its layerwise_id), the requests whose
    # last prompt tokens this step computes, and transfers that ended unpublished or failed
    send_keys: dict[str, str] = field(default_factory=dict)
    publishes: list[Publish] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    # the step schedules no tokens: upstream keeps stepping while blocks wait for a
    # delayed free or a pull, and the workers pace such steps (pacer.IdlePacer)
    idle: bool = False
    send_readers: dict[str, int] = field(default_factory=dict)  # request id -> readers it is held for
    refusals: dict[str, int] = field(default_factory=dict)  # decode: parameters refused, by reason


def parse_remote(params: dict | None) -> RemotePrefill | None:
    """The parameters as given, if they ask for a pull and are well formed (not checked for
    trust: ``P2PScheduler.remote_of`` does that)."""
    if not params or not params.get("do_remote_prefill"):
        return None
    try:
        return msgspec.convert(params, RemotePrefill)
    except msgspec.ValidationError:
        return None
