"""Layer-wise transfer without engines: what a prefill rank says is written
(``layerwise.py``), when the prefill scheduler side publishes a request (against a
simulation of chunked prefill with block growth and preemption), what it holds and what
it marks failed, and the control messages."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.ascend.context_parallel.placement import CPLayout
from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.groups import TransferGroups
from vllm.ascend.kv_transfer.layerwise import Publications, Publish, release_messages
from vllm.ascend.kv_transfer.scheduler_side import P2PScheduler
from vllm.ascend.kv_transfer.settings import P2PSettings


class StreamEvent:
    """A device event as the forward's stream completes it (a host event is always done)."""

    def __init__(self):
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_layer_is_written_once_its_event_completes_and_in_stream_order():
    pubs = Publications(num_layers=4, expiry=10)
    pubs.begin_step([Publish("t", [[3, 4]], 20)], [])
    events = [StreamEvent() for _ in range(3)]
    pubs.layer_saved(0, events[0])
    pubs.layer_saved(1, events[1])
    pubs.layer_saved(1, events[2])  # a layer reported twice in a step counts once
    (entry,) = pubs.progress(["t"])
    assert entry.state == wire.PUBLISHED and entry.layers == [] and entry.block_ids == [[3, 4]]
    events[1].done.set()  # later work cannot be done before earlier work on one stream
    assert pubs.progress(["t"])[0].layers == []
    events[0].done.set()
    assert pubs.progress(["t"])[0].layers == [0, 1]
    end = StreamEvent()
    pubs.end_step(end)  # layers 2 and 3 never passed the hook: the forward's end covers them
    assert pubs.progress(["t"])[0].layers == [0, 1]
    end.done.set()
    assert pubs.progress(["t"])[0].layers == [0, 1, 2, 3]
    assert pubs.progress(["other"])[0].state == wire.UNKNOWN


def test_layers_of_a_step_without_publications_are_not_recorded():
    pubs = Publications(num_layers=2, expiry=10)
    pubs.begin_step([Publish("t", [[1]], 4)], [])
    pubs.end_step(StreamEvent())
    assert not pubs.saving
    pubs.layer_saved(0, StreamEvent())  # the next step publishes nothing
    assert len(pubs._entries["t"].pending) == 1


def test_failed_and_retired_transfers_answer_failed_then_are_dropped():
    clock = Clock()
    pubs = Publications(num_layers=2, expiry=10, clock=clock)
    pubs.begin_step([Publish("held", [[1]], 4)], ["never"])
    assert [p.state for p in pubs.progress(["never", "held"])] == [wire.FAILED, wire.PUBLISHED]
    pubs.retire("held")  # its hold was released: its blocks may be reused now
    assert pubs.progress(["held"])[0].state == wire.FAILED
    clock.now = 11
    pubs.begin_step([], ["later"])
    assert len(pubs) == 1 and pubs.progress(["held"])[0].state == wire.UNKNOWN


def test_release_messages_reach_every_rank_of_every_replica():
    layout = CPLayout(tp=2, pcp=1, dcp=1, dp=3, interleave=1, block_size=16, kv_heads=2)
    messages = release_messages("h", 100, layout, "t", "reader")
    assert [a for a, _ in messages] == [f"h:{p}" for p in range(100, 106)]
    assert all(
        m.request_id == "t" and m.reader == "reader" and m.reads_total == 0 and not m.ok for _, m in messages
    )
    assert [m.prefill_rank for _, m in messages] == [0, 1] * 3


def test_progress_messages_round_trip_and_are_bounded():
    reply = wire.ProgressReply(
        wire.WIRE_VERSION, [wire.TransferProgress("t", wire.PUBLISHED, [[1, 2]], 17, 1, [0, 3])]
    )
    assert wire.decode_message(wire.encode_message(reply)) == reply
    ask = wire.Progress(wire.WIRE_VERSION, ["t"])
    assert wire.decode_message(wire.encode_message(ask)) == ask
    with pytest.raises(wire.WireError, match="malformed"):
        wire.decode_message(wire.encode_message(wire.Progress(wire.WIRE_VERSION, [])))
    bad = wire.ProgressReply(wire.WIRE_VERSION, [wire.TransferProgress("t", "maybe")])
    with pytest.raises(wire.WireError, match="malformed"):
        wire.decode_message(wire.encode_message(bad))


# -- the prefill scheduler side -------------------------------------------------------


def _scheduler(groups: TransferGroups) -> P2PScheduler:
    layout = CPLayout(tp=1, pcp=1, dcp=1, dp=1, interleave=1, block_size=4, kv_heads=1)
    return P2PScheduler(
        P2PSettings("p", True, False, "mooncake", "127.0.0.1", 1, 30.0, 5.0, layout, 0), groups
    )


def _request(request_id: str, prompt: int, params: dict):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return Request(request_id, list(range(10, 10 + prompt)), sampling, None)


def _output(new: list, cached: list, scheduled: dict):
    """An upstream SchedulerOutput: ``new`` (req, block ids, computed; a resumed request
    comes as a new one), ``cached`` (req id, new block ids or None, computed)."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    cached_data = CachedRequestData.make_empty()
    for req_id, block_ids, computed in cached:
        cached_data.req_ids.append(req_id)
        cached_data.new_block_ids.append(block_ids)
        cached_data.num_computed_tokens.append(computed)
        cached_data.num_output_tokens.append(0)
    return SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(
                r.request_id,
                r.prompt_token_ids,
                [],
                None,
                None,
                ids,
                computed,
                None,
                prefill_token_ids=list(r.prompt_token_ids),
            )
            for r, ids, computed in new
        ],
        scheduled_cached_reqs=cached_data,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.integers(1, 60),
    windowed=st.booleans(),
    chunks=st.lists(st.integers(1, 24), min_size=1, max_size=30),
    preempt_at=st.integers(0, 8),
)
def test_published_once_with_the_whole_table_in_the_step_of_the_last_prompt_tokens(
    prompt, windowed, chunks, preempt_at
):
    """A simulated scheduler prefills in chunks, allocating 4-token blocks as it goes
    and once preempting the request (its blocks freed, recomputed from 0 in new blocks):
    the publication must come in the step that reaches the prompt's end, once, with the
    table of that step."""
    groups = TransferGroups((0,), {}, windowed)
    sched = _scheduler(groups)
    request = _request("r", prompt, {"do_remote_decode": True, "layerwise_id": "t"})
    sched.on_new_request(request)
    tokens = request.num_prompt_tokens
    assert tokens == (prompt - 1 if windowed and prompt > 1 else prompt)
    computed, table, next_block, expected = 0, [], 100, None
    publishes = []
    for step, chunk in enumerate(chunks * 4):
        if computed >= tokens:
            break
        resumed = step == preempt_at and step > 0 and table
        if resumed:  # preempted before this step: blocks freed, prompt from the start
            computed, table = 0, []
        scheduled = min(chunk, tokens - computed)
        need = -(-(computed + scheduled) // 4) - len(table)
        new_ids = list(range(next_block, next_block + need))
        next_block += need
        table = table + new_ids
        if step == 0 or resumed:  # a resumed request is scheduled as a new one, whole table
            out = _output([(request, (list(table),), computed)], [], {"r": scheduled})
        else:
            out = _output([], [("r", (new_ids,), computed)], {"r": scheduled})
        meta = sched.build_connector_meta(out)
        publishes += meta.publishes
        if computed + scheduled >= tokens and expected is None:
            expected = (step, list(table))
        if meta.publishes:
            assert (step, meta.publishes[0].block_ids[0]) == expected
        computed += scheduled
    if computed >= tokens:
        assert len(publishes) == 1
        assert publishes[0].num_tokens == tokens and publishes[0].backoff == prompt - tokens
        assert publishes[0].transfer_id == "t"
    else:
        assert publishes == []


def _finish(sched, request, status):
    request.status = status
    return sched.request_finished(request, ([1, 2],))


def test_a_published_request_is_held_however_it_ends_and_an_unpublished_one_fails():
    from vllm.v1.request import RequestStatus

    sched = _scheduler(TransferGroups((0,), {}, False))
    done, aborted, early = (
        _request(n, 8, {"do_remote_decode": True, "layerwise_id": f"t-{n}"})
        for n in ("done", "aborted", "early")
    )
    for request in (done, aborted, early):
        sched.on_new_request(request)
    sched.build_connector_meta(
        _output(
            [(done, ([1, 2],), 0), (aborted, ([3, 4],), 0), (early, ([5],), 0)],
            [],
            {"done": 8, "aborted": 8, "early": 4},
        )
    )
    assert _finish(sched, done, RequestStatus.FINISHED_LENGTH_CAPPED) == (True, None)
    assert _finish(sched, aborted, RequestStatus.FINISHED_ABORTED) == (True, None)  # may be read
    assert _finish(sched, early, RequestStatus.FINISHED_ABORTED) == (False, None)  # never published
    meta = sched.build_connector_meta(_output([], [], {}))
    assert meta.send_keys == {"done": "t-done", "aborted": "t-aborted"}
    assert set(meta.sends) == {"done", "aborted"}
    assert sorted(meta.failed) == ["t-aborted", "t-early"]
    # a request without layerwise_id keeps the pull-after-prefill behaviour
    plain = _request("plain", 8, {"do_remote_decode": True})
    sched.on_new_request(plain)
    held, params = _finish(sched, plain, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert held and params["remote_request_id"] == "plain"


def test_a_decode_request_with_layerwise_id_expects_the_prompt_less_the_backoff():
    layout = CPLayout(tp=1, pcp=1, dcp=1, dp=1, interleave=1, block_size=4, kv_heads=1)
    settings_ = P2PSettings("d", False, True, "mooncake", "127.0.0.1", 1, 30.0, 5.0, layout, 0)
    sched = P2PScheduler(settings_, TransferGroups((0, 1), {}, True))
    try:
        params = {"do_remote_prefill": True, "layerwise_id": "t", "remote_host": "h", "remote_port": 9}
        request = _request("r", 10, params)
        assert sched.get_num_new_matched_tokens(request, 0) == (9, True)
        remote = sched.remote_of(request)
        assert remote.remote_num_tokens == 9 and remote.remote_backoff == 1
        assert remote.remote_request_id == "t" and remote.remote_block_ids == [[], []]
        assert params == {
            "do_remote_prefill": True,
            "layerwise_id": "t",
            "remote_host": "h",
            "remote_port": 9,
        }
        bad = _request("bad", 10, {"do_remote_prefill": True, "remote_host": "h", "remote_port": 9})
        assert sched.get_num_new_matched_tokens(bad, 0) == (0, False)  # not layer-wise: incomplete
    finally:
        sched.close()


@pytest.mark.parametrize("prompt", [9, 12, 13])
def test_a_backed_off_prompt_keeps_its_tokens_length_and_block_hashes_in_step(prompt):
    """The prefill side leaves the prompt's last token to the decode side (a windowed
    KV-cache group): through the request's own hook its token ids, its token list, its
    length and its prefix-cache block hashes all describe the shorter prompt (the hashes
    those of a request made with the shorter prompt), it generates one token, and a
    second call (a preempted request back) shortens nothing more."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(4, sha256)
    layout = CPLayout(tp=1, pcp=1, dcp=1, dp=1, interleave=1, block_size=4, kv_heads=1)
    sched = P2PScheduler(
        P2PSettings("p", True, False, "mooncake", "127.0.0.1", 1, 30.0, 5.0, layout, 0),
        TransferGroups((0,), {}, True),
        hash_block_size=4,
    )
    tokens = list(range(10, 10 + prompt))
    sampling = SamplingParams(max_tokens=7, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    request = Request("r", list(tokens), sampling, None, block_hasher=hasher)
    sched.on_new_request(request)
    sched.on_new_request(request)
    shorter = Request("s", tokens[:-1], SamplingParams(max_tokens=1), None, block_hasher=hasher)
    assert list(request.prompt_token_ids) == tokens[:-1] == list(request.all_token_ids)
    assert request.num_prompt_tokens == request.num_tokens == prompt - 1
    assert request.block_hashes == shorter.block_hashes and len(request.block_hashes) == (prompt - 1) // 4
    assert request.max_tokens == 1
