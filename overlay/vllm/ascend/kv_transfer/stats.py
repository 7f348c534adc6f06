"""Transfer statistics of ``AscendP2PConnector``, through upstream's connector-stats
path: each worker hands its interval's ``P2PConnectorStats`` to vLLM
(``get_kv_connector_stats``), vLLM sums them over the workers and steps, logs
``reduce()`` with its periodic stats line and records them in Prometheus through
``P2PPromMetrics`` (``/metrics``).

What is counted: KV bytes a decode rank pulled and how long each request's pull took,
pulls that failed, leases that ran out on a prefill rank before the decode side reported
(``holds.py``), the holds a prefill rank keeps (a gauge, reported when it changes), and
refusals by reason: ``kv_transfer_params`` a decode instance would not trust or use
(``untrusted``, ``malformed``, ``another prompt``, ``mismatch``) and control frames a prefill
rank refused (``control unsealed``, ``control malformed``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

PULL_SECONDS = "pull_seconds"  # one entry per successful pull (a request on one decode rank)
PULLED_BYTES = "pulled_bytes"  # its bytes, same order
FAILED_PULLS = "failed_pulls"
LEASES_EXPIRED = "leases_expired"
HOLDS = "holds"  # global rank (str) -> requests it holds, latest report
REFUSALS = "refusals"  # reason -> count


def _empty() -> dict[str, Any]:
    return {PULL_SECONDS: [], PULLED_BYTES: [], FAILED_PULLS: 0, LEASES_EXPIRED: 0, HOLDS: {}, REFUSALS: {}}


@dataclass
class P2PConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = _empty()  # plain lists, ints and a dict: sent from workers as is

    def record_pull(self, seconds: float, num_bytes: int) -> None:
        self.data[PULL_SECONDS].append(float(seconds))
        self.data[PULLED_BYTES].append(int(num_bytes))

    def record_failed_pull(self) -> None:
        self.data[FAILED_PULLS] += 1

    def record_expired_leases(self, count: int) -> None:
        self.data[LEASES_EXPIRED] += count

    def record_holds(self, rank: int, count: int) -> None:
        self.data[HOLDS][str(rank)] = count

    def record_refusals(self, counts: dict[str, int]) -> None:
        for reason, n in counts.items():
            self.data[REFUSALS][reason] = self.data[REFUSALS].get(reason, 0) + n

    def is_empty(self) -> bool:
        d = self.data
        return not (d[PULL_SECONDS] or d[FAILED_PULLS] or d[LEASES_EXPIRED] or d[HOLDS] or d[REFUSALS])

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        theirs = other.data
        self.data[PULL_SECONDS].extend(theirs[PULL_SECONDS])
        self.data[PULLED_BYTES].extend(theirs[PULLED_BYTES])
        self.data[FAILED_PULLS] += theirs[FAILED_PULLS]
        self.data[LEASES_EXPIRED] += theirs[LEASES_EXPIRED]
        self.data[HOLDS].update(theirs[HOLDS])  # later reports of a rank replace earlier ones
        self.record_refusals(theirs.get(REFUSALS, {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = np.asarray(self.data[PULL_SECONDS], dtype=np.float64)
        mib = float(np.sum(self.data[PULLED_BYTES])) / 2**20
        summary: dict[str, int | float] = {"Pulls": len(seconds), "MiB pulled": round(mib, 3)}
        if len(seconds):
            summary.update(
                {
                    "Avg pull time (ms)": round(float(seconds.mean()) * 1e3, 3),
                    "P90 pull time (ms)": round(float(np.percentile(seconds, 90)) * 1e3, 3),
                    "Throughput (MiB/s)": round(mib / float(seconds.sum()), 3) if seconds.sum() > 0 else 0.0,
                }
            )
        summary.update(
            {
                "Failed pulls": self.data[FAILED_PULLS],
                "Leases expired": self.data[LEASES_EXPIRED],
                "Holds outstanding": sum(self.data[HOLDS].values()),
                "Refused": sum(self.data[REFUSALS].values()),
            }
        )
        return summary


class StatsInterval:
    """The statistics of the interval being recorded, from every thread of a worker (its
    pull threads, its control server's); vLLM takes them once per step."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stats = P2PConnectorStats()

    def record(self, update: Callable[[P2PConnectorStats], None]) -> None:
        with self._lock:
            update(self._stats)

    def take(self) -> P2PConnectorStats:
        """The interval's statistics; the next interval starts empty."""
        with self._lock:
            stats, self._stats = self._stats, P2PConnectorStats()
        return stats


class P2PPromMetrics(KVConnectorPromMetrics):
    """``vllm:ascend_p2p_*`` metrics, one child per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(cls, name: str, documentation: str, **kwargs):
            return create_metric_per_engine(
                cls(name=name, documentation=documentation, labelnames=labelnames, **kwargs),
                per_engine_labelvalues,
            )

        self.pull_seconds = per_engine(
            self._histogram_cls,
            "vllm:ascend_p2p_pull_seconds",
            "Time a decode rank took to pull one request's KV cache (AscendP2PConnector).",
            buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
        )
        self.pulled_bytes = per_engine(
            self._counter_cls,
            "vllm:ascend_p2p_pulled_bytes",
            "KV-cache bytes pulled by decode ranks (AscendP2PConnector).",
        )
        self.failed_pulls = per_engine(
            self._counter_cls,
            "vllm:ascend_p2p_failed_pulls",
            "Pulls of a request's KV cache that failed (AscendP2PConnector).",
        )
        self.leases_expired = per_engine(
            self._counter_cls,
            "vllm:ascend_p2p_leases_expired",
            "Requests a prefill rank freed because the decode side did not report within the lease.",
        )
        self.holds = per_engine(
            self._gauge_cls,
            "vllm:ascend_p2p_holds_outstanding",
            "Requests whose KV blocks prefill ranks hold for decode instances.",
        )
        # by reason as well as by engine: the reason's label is added per observation
        self.refusals = self._counter_cls(
            name="vllm:ascend_p2p_refusals",
            documentation="kv_transfer_params and control frames refused, by reason (AscendP2PConnector).",
            labelnames=[*labelnames, "reason"],
        )
        self._engine_labels = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for seconds in transfer_stats_data[PULL_SECONDS]:
            self.pull_seconds[engine_idx].observe(seconds)
        self.pulled_bytes[engine_idx].inc(sum(transfer_stats_data[PULLED_BYTES]))
        self.failed_pulls[engine_idx].inc(transfer_stats_data[FAILED_PULLS])
        self.leases_expired[engine_idx].inc(transfer_stats_data[LEASES_EXPIRED])
        if transfer_stats_data[HOLDS]:
            self.holds[engine_idx].set(sum(transfer_stats_data[HOLDS].values()))
        for reason, count in transfer_stats_data.get(REFUSALS, {}).items():
            self.refusals.labels(*self._engine_labels[engine_idx], reason).inc(count)
