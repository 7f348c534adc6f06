"""The P/D trust boundary: one shared secret per deployment, and what it authenticates.

Upstream's connectors trust the network. This one does not: the instances of a
deployment (and its proxy) share a secret, ``VLLM_ASCEND_KV_SECRET`` or the file named by
``kv_connector_extra_config.secret_file`` (``python -m vllm.ascend.kv_transfer.trust
new-secret`` makes one), and with it

* the prefill instance signs the ``kv_transfer_params`` it returns (``sign_params``: a MAC
  over who holds which blocks of which prompt, where, until when) and the decode instance
  checks them before it reads anything or connects anywhere (``check_params``); the proxy
  signs the layer-wise parameters it makes;
* every control-plane message travels in a sealed frame (``seal`` / ``open_frame``: a
  timestamp and a MAC over it and the message), so only an instance of the deployment is
  answered, and only recent frames are taken.

Without a secret the instances refuse to start with P/D, unless
``kv_connector_extra_config.insecure`` says the network between them is trusted (then
nothing is signed or sealed, as upstream, and the start-up log says so). Pure, no vLLM.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec

SECRET_ENV = "VLLM_ASCEND_KV_SECRET"
MIN_SECRET_BYTES = 32
FRAME_SKEW_SECONDS = 120.0  # how old (or how far ahead, between two hosts' clocks) a frame may be
_FRAME_HEAD = struct.Struct(">Q32s")  # milliseconds since the epoch, HMAC-SHA256
_ENCODE = msgspec.msgpack.Encoder()


class TrustError(ValueError):
    """Something the secret does not vouch for; the text says what and why."""


class SecretMissing(RuntimeError):
    """P/D started without a secret and without ``insecure``."""


def new_secret() -> str:
    return secrets.token_hex(32)


def load_secret(secret_file: str | None, insecure: bool) -> bytes | None:
    """The deployment's secret (None: insecure). The environment variable wins over the file."""
    text = os.environ.get(SECRET_ENV)
    where = f"${SECRET_ENV}"
    if not text and secret_file:
        try:
            text = Path(secret_file).read_text().strip()
        except OSError as e:
            raise SecretMissing(
                f"kv_connector_extra_config.secret_file {secret_file!r} cannot be read: {e}"
            ) from None
        where = secret_file
    if text:
        secret = text.encode()
        if len(secret) < MIN_SECRET_BYTES:
            raise SecretMissing(
                f"the P/D secret from {where} has {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
                "(python -m vllm.ascend.kv_transfer.trust new-secret)"
            )
        return secret
    if insecure:
        return None
    raise SecretMissing(
        "P/D disaggregation needs the deployment's shared secret on every instance and the proxy: "
        f"set {SECRET_ENV} (python -m vllm.ascend.kv_transfer.trust new-secret makes one) or "
        "kv_connector_extra_config.secret_file; or set kv_connector_extra_config.insecure to true "
        "if the network between the instances is trusted (docs/pd_disaggregation.md, Security)"
    )


def prompt_digest(token_ids: Iterable[int]) -> str:
    """What the signature binds a transfer's prompt by: SHA-256 of its token ids."""
    data = _ENCODE.encode(list(token_ids))
    return hashlib.sha256(data).hexdigest()[:32]


# the fields a signature covers, in order (absent ones count as their defaults)
PULL_FIELDS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_ranks",
    "remote_dp_rank",
    "remote_block_ids",
    "remote_num_tokens",
    "remote_backoff",
    "remote_readers",
    "remote_prompt_digest",
    "remote_expires",
)
LAYERWISE_FIELDS = ("layerwise_id", "remote_host", "remote_port", "remote_readers", "remote_expires")


class Trust:
    """The secret (None: insecure) and what it signs and seals."""

    def __init__(self, secret: bytes | None, clock: Callable[[], float] = time.time) -> None:
        self._key = secret
        self._clock = clock

    @property
    def secure(self) -> bool:
        return self._key is not None

    def _mac(self, kind: bytes, data: bytes) -> bytes:
        if self._key is None:  # every caller asks ``secure`` first
            raise RuntimeError("an insecure Trust has no key to seal or sign with")
        return hmac.new(self._key, kind + b"\0" + data, hashlib.sha256).digest()

    # -- kv_transfer_params -----------------------------------------------------------
    def sign_params(self, params: dict, fields: tuple[str, ...], valid_for: float) -> dict:
        """``params`` with ``remote_expires`` and ``remote_signature`` over ``fields`` (as is
        when insecure)."""
        if not self.secure:
            return params
        # milliseconds since the epoch: an int survives every JSON hop exactly
        signed = dict(params, remote_expires=int((self._clock() + valid_for) * 1000))
        signed["remote_signature"] = self._mac(b"params", _canonical(signed, fields)).hex()
        return signed

    def check_params(self, params: dict, fields: tuple[str, ...]) -> str | None:
        """Why ``params`` are not to be trusted (None: they are, or the deployment is insecure)."""
        if not self.secure:
            return None
        signature = params.get("remote_signature")
        if not isinstance(signature, str) or len(signature) != 64:
            return "unsigned kv_transfer_params"
        try:
            expected = self._mac(b"params", _canonical(params, fields)).hex()
        except (TypeError, ValueError, msgspec.EncodeError):
            return "malformed kv_transfer_params"
        if not hmac.compare_digest(signature, expected):
            return "kv_transfer_params with a bad signature"
        expires = params.get("remote_expires")
        if not isinstance(expires, int) or expires < self._clock() * 1000:
            return "expired kv_transfer_params"
        return None

    # -- control-plane frames -----------------------------------------------------------
    def seal(self, payload: bytes) -> bytes:
        if not self.secure:
            return payload
        millis = int(self._clock() * 1000)
        head = struct.pack(">Q", millis)
        return _FRAME_HEAD.pack(millis, self._mac(b"frame", head + payload)) + payload

    def open_frame(self, frame: bytes) -> bytes:
        """The message of a sealed frame, or a ``TrustError`` (a forged, altered or stale frame)."""
        if not self.secure:
            return frame
        if len(frame) < _FRAME_HEAD.size:
            raise TrustError(f"a frame of {len(frame)} bytes is not sealed by this deployment's secret")
        millis, mac = _FRAME_HEAD.unpack_from(frame)
        payload = frame[_FRAME_HEAD.size :]
        if not hmac.compare_digest(mac, self._mac(b"frame", frame[:8] + payload)):
            raise TrustError("a frame not sealed by this deployment's secret")
        if abs(self._clock() - millis / 1000) > FRAME_SKEW_SECONDS:
            raise TrustError(
                f"a frame sealed {self._clock() - millis / 1000:.0f} s from now (stale or replayed)"
            )
        return payload


def _canonical(params: dict, fields: tuple[str, ...]) -> bytes:
    return _ENCODE.encode([params.get(name) for name in fields])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["new-secret"]:
        print("usage: python -m vllm.ascend.kv_transfer.trust new-secret", file=sys.stderr)
        return 2
    print(new_secret())
    return 0


if __name__ == "__main__":
    sys.exit(main())
