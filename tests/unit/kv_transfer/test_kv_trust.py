"""The P/D trust boundary (``vllm/ascend/kv_transfer/trust.py`` and where it is enforced):
signed kv_transfer_params, sealed control frames, the decode scheduler's refusals, and the
secret at start-up. Everything a forger or a confused router could send is refused,
counted, and answered by computing the prompt locally, with nothing sent anywhere."""

from __future__ import annotations

import socket
import subprocess
import sys

import msgspec
import pytest
import zmq

from vllm.ascend.context_parallel.placement import CPLayout
from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.control import ControlClient, ControlServer
from vllm.ascend.kv_transfer.groups import TransferGroups
from vllm.ascend.kv_transfer.scheduler_side import P2PScheduler
from vllm.ascend.kv_transfer.settings import P2PSettings
from vllm.ascend.kv_transfer.trust import (
    FRAME_SKEW_SECONDS,
    PULL_FIELDS,
    SECRET_ENV,
    SecretMissing,
    Trust,
    TrustError,
    load_secret,
    prompt_digest,
)

SECRET = b"s" * 32


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _params(**change) -> dict:
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-engine",
        "remote_request_id": "cmpl-1",
        "remote_host": "10.0.0.5",
        "remote_port": 21100,
        "remote_ranks": 1,
        "remote_dp_rank": 0,
        "remote_block_ids": [[1, 2]],
        "remote_num_tokens": 20,
        "remote_backoff": 0,
        "remote_readers": 1,
        "remote_prompt_digest": prompt_digest(range(20)),
    }
    params.update(change)
    return params


# -- signatures -------------------------------------------------------------------------------
def test_signed_params_verify_and_any_change_breaks_them():
    clock = Clock()
    trust = Trust(SECRET, clock=clock)
    signed = trust.sign_params(_params(), PULL_FIELDS, 90)
    assert trust.check_params(signed, PULL_FIELDS) is None
    for field, value in [
        ("remote_block_ids", [[1, 3]]),
        ("remote_host", "10.0.0.6"),
        ("remote_port", 21101),
        ("remote_request_id", "cmpl-2"),
        ("remote_ranks", 2),
        ("remote_prompt_digest", prompt_digest(range(1, 21))),
        ("remote_readers", 8),
        ("remote_expires", signed["remote_expires"] + 1000),
    ]:
        assert trust.check_params(dict(signed, **{field: value}), PULL_FIELDS) == (
            "kv_transfer_params with a bad signature"
        ), field
    assert trust.check_params(_params(), PULL_FIELDS) == "unsigned kv_transfer_params"
    assert (
        Trust(b"t" * 32, clock=clock).check_params(signed, PULL_FIELDS)
        == "kv_transfer_params with a bad signature"
    )
    clock.now += 91
    assert trust.check_params(signed, PULL_FIELDS) == "expired kv_transfer_params"


def test_signatures_survive_a_json_hop():
    """Routers pass the parameters on as JSON: ints stay ints, lists stay lists."""
    import json

    trust = Trust(SECRET, clock=Clock())
    signed = trust.sign_params(_params(), PULL_FIELDS, 90)
    assert trust.check_params(json.loads(json.dumps(signed)), PULL_FIELDS) is None


def test_insecure_trust_signs_nothing_and_takes_everything():
    trust = Trust(None)
    assert trust.sign_params(_params(), PULL_FIELDS, 90) == _params()
    assert trust.check_params(_params(), PULL_FIELDS) is None
    assert trust.open_frame(b"plain") == b"plain" == trust.seal(b"plain")


# -- frames -------------------------------------------------------------------------------------
def test_frames_open_only_with_the_secret_and_only_while_fresh():
    clock = Clock()
    trust = Trust(SECRET, clock=clock)
    frame = trust.seal(b"payload")
    assert trust.open_frame(frame) == b"payload"
    with pytest.raises(TrustError, match="not sealed"):
        trust.open_frame(b"payload")
    with pytest.raises(TrustError, match="not sealed"):
        trust.open_frame(frame[:-1] + b"X")  # altered
    with pytest.raises(TrustError, match="not sealed"):
        Trust(b"t" * 32, clock=clock).open_frame(frame)
    clock.now += FRAME_SKEW_SECONDS + 1
    with pytest.raises(TrustError, match="stale or replayed"):
        trust.open_frame(frame)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_control_plane_answers_only_sealed_frames_and_counts_the_rest():
    """A forged DoneReading (item 5) or Hello from a host without the secret is refused
    before any handler sees it; an instance of the deployment is answered as before."""
    handled, refused = [], []
    port = _port()
    trust = Trust(SECRET)

    def handle(message):
        handled.append(message)
        return wire.Reply(wire.WIRE_VERSION, True, held=True)

    server = ControlServer("127.0.0.1", port, handle, trust=trust, on_refused=refused.append)
    address = f"127.0.0.1:{port}"
    done = wire.DoneReading(wire.WIRE_VERSION, "cmpl-1", "reader", 0, 0, [], reads_total=0)
    try:
        forger = ControlClient(5.0)  # no secret
        with pytest.raises(
            (TrustError, wire.WireError)
        ):  # the refusal is sealed: unreadable without the secret
            forger.request(address, done)
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"tcp://{address}")
        raw.send_multipart([b"", trust.seal(wire.encode_message(done))[:-3] + b"abc"])  # tampered
        assert raw.poll(5000)
        raw.recv_multipart()
        raw.close()
        assert handled == [] and refused == ["unsealed", "unsealed"]
        reply = ControlClient(5.0, trust).request(address, done)
        assert reply.ok and reply.held and handled == [done]
    finally:
        server.close()


def test_a_reply_not_sealed_with_the_secret_is_not_taken():
    port = _port()
    impostor = ControlServer("127.0.0.1", port, lambda m: wire.Reply(wire.WIRE_VERSION, True, held=True))
    try:
        with pytest.raises(TrustError):
            ControlClient(5.0, Trust(SECRET)).request(f"127.0.0.1:{port}", wire.Hello(wire.WIRE_VERSION, "d"))
    finally:
        impostor.close()


def test_deeply_nested_or_malformed_messages_are_refused_not_crashed():
    """Item 11: a refusal that names the problem in a short line, never a traceback or the payload."""
    nested = b"\x91" * 100_000 + b"\x00"  # 100k nested one-element arrays
    for data in (
        nested,
        msgspec.msgpack.encode({"type": "renew", "v": wire.WIRE_VERSION, "x": [[[[1]]]] * 10}),
    ):
        with pytest.raises(wire.WireError) as info:
            wire.decode_message(data)
        assert len(str(info.value)) < 400


# -- the decode scheduler's refusals ------------------------------------------------------------
def _decode_scheduler(trust: Trust, max_model_len: int = 4096) -> P2PScheduler:
    layout = CPLayout(tp=1, pcp=1, dcp=1, dp=1, interleave=1, block_size=16, kv_heads=1)
    settings = P2PSettings(
        "decode-engine",
        False,
        True,
        "mooncake",
        "127.0.0.1",
        1,
        30.0,
        5.0,
        layout,
        0,
        trust=trust,
        max_model_len=max_model_len,
    )
    return P2PScheduler(settings, TransferGroups((0,), {}, False))


def _request(request_id: str, prompt: list[int], params: dict):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id, prompt, SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}), None
    )


@pytest.fixture
def decode_scheduler():
    """Decode schedulers made by a test, closed after it (each runs its lease-renewal thread)."""
    made = []

    def make(trust: Trust, max_model_len: int = 4096) -> P2PScheduler:
        made.append(_decode_scheduler(trust, max_model_len))
        return made[-1]

    yield make
    for sched in made:
        sched.close()


@pytest.fixture
def outbox(monkeypatch):
    """What the scheduler would send (its releases are recorded here, not sent)."""
    sent = []
    monkeypatch.setattr(
        P2PScheduler, "_release", lambda self, rid, remote: sent.append((rid, remote.remote_request_id))
    )
    return sent


@pytest.mark.parametrize(
    "change, label",
    [
        ({"remote_signature": None}, "untrusted"),  # unsigned
        ({"remote_block_ids": [[7, 8]]}, "untrusted"),  # a block id changed after signing
        ({"remote_host": "attacker.example"}, "untrusted"),  # item 7: a foreign address
        ({"remote_ranks": 10**6}, "untrusted"),  # item 8, forged: the signature catches it first
    ],
)
def test_forged_params_are_refused_counted_and_nothing_is_sent(decode_scheduler, outbox, change, label):
    trust = Trust(SECRET)
    sched = decode_scheduler(trust)
    params = dict(trust.sign_params(_params(), PULL_FIELDS, 90), **change)
    params = {k: v for k, v in params.items() if v is not None}
    request = _request("d-1", list(range(20)), params)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)  # decided once
    assert outbox == [] and sched.build_connector_meta().refusals == {label: 1}


def test_params_of_another_prompt_are_refused_without_a_release(decode_scheduler, outbox):
    """Items 1 and 4: authentic parameters on a request with other tokens (a router that gave
    a batch's first prompt's parameters to all of it, or a client planting KV under its own
    tokens) are refused; the prefill request is not released, since its own reader may be
    pulling it."""
    trust = Trust(SECRET)
    sched = decode_scheduler(trust)
    signed = trust.sign_params(_params(), PULL_FIELDS, 90)
    same_length = _request("d-2", list(range(100, 120)), signed)
    other_length = _request("d-3", list(range(30)), signed)
    assert sched.get_num_new_matched_tokens(same_length, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(other_length, 0) == (0, False)
    assert outbox == [] and sched.build_connector_meta().refusals == {"another prompt": 2}
    right = _request("d-4", list(range(20)), signed)
    assert sched.get_num_new_matched_tokens(right, 0) == (20, True)


def test_out_of_bounds_params_are_refused_even_on_a_trusted_network(decode_scheduler, outbox):
    """Item 8: without a secret every field is still bounded at the boundary."""
    sched = decode_scheduler(Trust(None), max_model_len=16)
    for i, params in enumerate((_params(remote_ranks=10**6), _params(remote_port=70000), _params())):
        # (the last: 20 tokens, over max_model_len 16)
        assert sched.get_num_new_matched_tokens(_request(f"x{i}", list(range(20)), params), 0) == (0, False)
    assert sched.build_connector_meta().refusals == {"malformed": 3}


LAYERWISE = {
    "do_remote_prefill": True,
    "layerwise_id": "cmpl-1",
    "remote_host": "10.0.0.5",
    "remote_port": 21100,
}


@pytest.mark.parametrize("mode", ["pull", "layerwise"])
def test_parallel_sampling_children_share_one_pull(decode_scheduler, outbox, mode):
    """Item 2: n children of one decode request carry the same parameters. The first pulls;
    the others wait for that pull, then compute what the prefix cache does not give them and
    report themselves readers done (the prefill request is held for n readers; layer-wise,
    the proxy's parameters say how many)."""
    from types import SimpleNamespace

    from vllm.ascend.kv_transfer.trust import LAYERWISE_FIELDS

    trust = Trust(SECRET)
    sched = decode_scheduler(trust)
    if mode == "pull":
        signed = trust.sign_params(_params(remote_readers=3), PULL_FIELDS, 90)
    else:
        signed = trust.sign_params(dict(LAYERWISE, remote_readers=3), LAYERWISE_FIELDS, 90)
    children = [_request(f"{i}_cmpl", list(range(20)), signed) for i in range(3)]
    assert sched.get_num_new_matched_tokens(children[0], 0) == (20, True)
    assert sched.get_num_new_matched_tokens(children[1], 0) == (None, False)  # ask again later
    blocks = SimpleNamespace(get_block_ids=lambda: ([5, 6],))
    sched.update_state_after_alloc(children[0], blocks, 20)
    [spec] = sched.build_connector_meta().recvs
    assert spec.request_id == "0_cmpl" and spec.remote.remote_readers == 3
    assert sched.get_num_new_matched_tokens(children[2], 0) == (None, False)
    sched.update_connector_output(SimpleNamespace(finished_recving={"0_cmpl"}))
    assert sched.get_num_new_matched_tokens(children[1], 16) == (0, False)  # the prefix cache had 16
    assert sched.get_num_new_matched_tokens(children[2], 16) == (0, False)
    assert outbox == [("1_cmpl", "cmpl-1"), ("2_cmpl", "cmpl-1")]  # readers done without reading
    assert sched.get_num_new_matched_tokens(children[0], 0) == (0, False)  # pulled once


# -- the secret at start-up ---------------------------------------------------------------------
def test_the_secret_comes_from_the_environment_or_a_file_or_insecure_on_purpose(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(SecretMissing, match="VLLM_ASCEND_KV_SECRET.*insecure"):
        load_secret(None, False)
    assert load_secret(None, True) is None
    secret_file = tmp_path / "secret"
    secret_file.write_text("f" * 40 + "\n")
    assert load_secret(str(secret_file), False) == b"f" * 40
    with pytest.raises(SecretMissing, match="cannot be read"):
        load_secret(str(tmp_path / "missing"), False)
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(SecretMissing, match="at least 32"):
        load_secret(str(secret_file), False)
    monkeypatch.setenv(SECRET_ENV, "e" * 32)
    assert load_secret(str(secret_file), True) == b"e" * 32  # the environment wins


def test_new_secret_prints_a_fresh_one():
    made = [
        subprocess.run(
            [sys.executable, "-m", "vllm.ascend.kv_transfer.trust", "new-secret"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for _ in range(2)
    ]
    assert made[0] != made[1] and all(len(m) == 64 for m in made)


def test_an_instance_without_the_secret_refuses_to_start_unless_insecure(monkeypatch, caplog):
    """The platform's start-up check, before any engine process: P/D without a secret is
    refused with what to set; ``insecure`` starts, with a warning; other connectors are
    not concerned."""
    from types import SimpleNamespace

    from vllm.ascend.errors import AscendConfigError
    from vllm.ascend.platform.checks import check_pd_trust

    def config(extra, connector="AscendP2PConnector"):
        kv = SimpleNamespace(kv_connector=connector, kv_connector_extra_config=extra)
        return SimpleNamespace(kv_transfer_config=kv)

    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(AscendConfigError, match="VLLM_ASCEND_KV_SECRET"):
        check_pd_trust(config({}))
    with pytest.raises(AscendConfigError, match="VLLM_ASCEND_KV_SECRET"):
        check_pd_trust(config({"insecure": "yes"}))  # only true is insecure
    with caplog.at_level("WARNING"):
        check_pd_trust(config({"insecure": True}))
    assert "without a shared secret" in caplog.text
    check_pd_trust(config({}, connector="NixlConnector"))
    check_pd_trust(SimpleNamespace(kv_transfer_config=None))
    monkeypatch.setenv(SECRET_ENV, "k" * 32)
    check_pd_trust(config({}))
