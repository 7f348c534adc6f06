"""The P/D connector's transfer statistics (vllm/ascend/kv_transfer/stats.py): what the
workers record, how vLLM's aggregation across workers and steps combines it, the log
line's summary and the Prometheus series."""

from __future__ import annotations

import json
from functools import partial

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm.ascend.kv_transfer.holds import Holds
from vllm.ascend.kv_transfer.stats import P2PConnectorStats, P2PPromMetrics


def _worker(rank: int, pulls=(), failed=0, expired=0, holds=None) -> P2PConnectorStats:
    stats = P2PConnectorStats()
    for seconds, size in pulls:
        stats.record_pull(seconds, size)
    for _ in range(failed):
        stats.record_failed_pull()
    stats.record_expired_leases(expired)
    if holds is not None:
        stats.record_holds(rank, holds)
    return stats


def test_workers_and_steps_aggregate_into_one_summary():
    assert P2PConnectorStats().is_empty() and _worker(0, expired=0).is_empty()
    a = _worker(0, pulls=[(0.010, 3 << 20), (0.030, 1 << 20)], holds=2)
    b = _worker(1, failed=1, expired=2, holds=5)
    later = _worker(1, holds=1)  # rank 1 reports again: its holds are replaced, not added
    # through the wire form vLLM sends between processes
    rebuilt = P2PConnectorStats(data=json.loads(json.dumps(b.to_dict())))
    total = a.aggregate(rebuilt).aggregate(later)
    summary = total.reduce()
    assert summary["Pulls"] == 2 and summary["MiB pulled"] == 4.0
    assert summary["Avg pull time (ms)"] == pytest.approx(20.0)
    assert summary["Throughput (MiB/s)"] == pytest.approx(100.0)
    assert summary["Failed pulls"] == 1 and summary["Leases expired"] == 2
    assert summary["Holds outstanding"] == 3
    failures_only = _worker(0, failed=3).reduce()
    assert failures_only["Pulls"] == 0 and failures_only["Failed pulls"] == 3
    assert "Avg pull time (ms)" not in failures_only


def test_prometheus_series_follow_the_observations():
    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    metrics = P2PPromMetrics(_Config(), types, ["engine"], {0: ["0"], 1: ["1"]})
    metrics.observe(_worker(0, pulls=[(0.002, 4096), (0.2, 8192)], failed=1, expired=1, holds=3).to_dict(), 1)
    metrics.observe(_worker(0, pulls=[(0.004, 100)]).to_dict(), 1)

    def value(name: str, **labels) -> float | None:
        return registry.get_sample_value(name, {"engine": "1", **labels})

    assert value("vllm:ascend_p2p_pulled_bytes_total") == 4096 + 8192 + 100
    assert value("vllm:ascend_p2p_pull_seconds_count") == 3
    assert value("vllm:ascend_p2p_pull_seconds_bucket", le="0.005") == 2
    assert value("vllm:ascend_p2p_failed_pulls_total") == 1
    assert value("vllm:ascend_p2p_leases_expired_total") == 1
    assert value("vllm:ascend_p2p_holds_outstanding") == 3  # not reset by an update without holds
    assert registry.get_sample_value("vllm:ascend_p2p_pulled_bytes_total", {"engine": "0"}) == 0


def test_expired_leases_are_counted_once():
    clock = _Clock()
    holds = Holds(30, clock=clock)
    holds.hold("a")
    holds.hold("b")
    holds.hold("c")
    holds.done("c", "reader", [0], 1)
    clock.now = 31
    assert holds.take_finished() == {"a", "b", "c"}
    assert holds.take_expired_count() == 2 and holds.take_expired_count() == 0


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class _Config:
    kv_transfer_config = None
