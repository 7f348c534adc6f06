"""The P2P connector's settings, read once from ``--kv-transfer-config``.

``kv_port`` is the first control port of the instance: rank ``r`` of DP replica ``d``
serves its control plane on ``kv_port + d x ranks_per_replica + r``.
``kv_connector_extra_config`` keys (docs/pd_disaggregation.md):

* ``transport``: ``"mooncake"`` (default) or ``"llmdatadist"``;
* ``host``: the address this instance binds and advertises (default ``127.0.0.1``);
* ``lease_seconds``: how long a prefill instance keeps a finished request's blocks
  without hearing from the decode side (default 30; renewed while decode waits);
* ``control_timeout``: seconds to wait for a control-plane answer (default 5);
* ``layerwise_wait_seconds``: how long a decode rank waits for a layer-wise request to be
  published by the prefill instance (and at most a lease while that instance publishes
  nothing) and, without news, for each further layer (default 120); then
  ``kv_load_failure_policy`` applies;
* ``secret_file``: a file holding the deployment's shared secret (``VLLM_ASCEND_KV_SECRET``
  wins over it; ``trust.py``); ``insecure``: true to run without one, on a trusted
  network (nothing signed or sealed);
* transport options: ``mooncake_protocol`` (``tcp`` default; ``ascend`` on NPU hosts),
  ``transfer_timeout`` (seconds, default 30), ``batch_slices`` (slices per Mooncake
  submission, default 1024), ``device_name``; for llmdatadist
  ``device_id`` and ``llmdatadist_port_offset`` (its link port is the rank's control
  port plus this, default 1000).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.ascend.context_parallel.placement import CPLayout, context_parallel_layout
from vllm.ascend.kv_transfer.trust import Trust, load_secret

if TYPE_CHECKING:  # upstream's type, for the annotations only
    from vllm.config import VllmConfig

KNOWN_KEYS = {
    "transport",
    "host",
    "lease_seconds",
    "control_timeout",
    "layerwise_wait_seconds",
    "mooncake_protocol",
    "transfer_timeout",
    "batch_slices",
    "device_name",
    "device_id",
    "llmdatadist_port_offset",
    "secret_file",
    "insecure",
}


@dataclass(frozen=True)
class P2PSettings:
    engine_id: str
    producer: bool
    consumer: bool
    transport: str
    host: str
    port: int
    lease_seconds: float
    control_timeout: float
    layout: CPLayout
    dp_rank: int
    options: dict = field(default_factory=dict)
    layerwise_wait: float = 120.0
    trust: Trust = field(default_factory=lambda: Trust(None))  # the deployment's secret (trust.py)
    max_model_len: int = 1 << 30

    @classmethod
    def from_config(cls, vllm_config: VllmConfig) -> P2PSettings:
        kv = vllm_config.kv_transfer_config
        extra = dict(kv.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - KNOWN_KEYS)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys for AscendP2PConnector: {unknown}; "
                f"known: {sorted(KNOWN_KEYS)}"
            )
        transport = str(extra.get("transport", "mooncake"))
        if transport not in ("mooncake", "llmdatadist"):
            raise ValueError(
                f"kv_connector_extra_config.transport must be 'mooncake' or 'llmdatadist', got {transport!r}"
            )
        lease = float(extra.get("lease_seconds", 30))
        if lease <= 0:
            raise ValueError(f"kv_connector_extra_config.lease_seconds must be positive, got {lease}")
        layerwise_wait = float(extra.get("layerwise_wait_seconds", 120))
        if layerwise_wait <= 0:
            raise ValueError(
                f"kv_connector_extra_config.layerwise_wait_seconds must be positive, got {layerwise_wait}"
            )
        insecure = extra.get("insecure", False)
        if not isinstance(insecure, bool):
            raise ValueError(f"kv_connector_extra_config.insecure must be true or false, got {insecure!r}")
        secret = load_secret(extra.get("secret_file"), insecure)
        return cls(
            trust=Trust(secret),
            max_model_len=vllm_config.model_config.max_model_len,
            layerwise_wait=layerwise_wait,
            engine_id=str(kv.engine_id),
            producer=kv.is_kv_producer,
            consumer=kv.is_kv_consumer,
            transport=transport,
            host=str(extra.get("host", "127.0.0.1")),
            port=int(kv.kv_port),
            lease_seconds=lease,
            control_timeout=float(extra.get("control_timeout", 5.0)),
            layout=context_parallel_layout(vllm_config),
            dp_rank=vllm_config.parallel_config.data_parallel_index,
            options=extra,
        )

    def control_port(self, dp_rank: int, rank: int) -> int:
        return self.port + dp_rank * self.layout.ranks_per_replica + rank
