"""The operator's /metrics, scraped over HTTP while it runs against the real API server: per-cluster
series from what its loop wrote, its API requests by code, reconcile latency, the Lease; and the
failover/switchover counters counting each operation once."""

from __future__ import annotations

import urllib.request
from datetime import UTC, datetime, timedelta

from prometheus_client.parser import text_string_to_metric_families

from pgherd.kube import metrics
from pgherd.local.ports import free_port

from .realkube import ChartIdentity, Kube, running_as
from .test_operator import cluster_manifest
from .waiting import eventually


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_the_operator_serves_its_metrics(kube: Kube, namespace: str, chart_operator: ChartIdentity) -> None:
    ns = namespace
    kube.create(cluster_manifest(ns))
    server = metrics.serve(free_port(), "127.0.0.1")
    try:
        with running_as(chart_operator):

            def phase() -> str | None:
                cluster = kube.read("postgresclusters", ns, "hippo") or {}
                return (cluster.get("status") or {}).get("phase")

            def scraped() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
                samples = scrape(server.server_port)
                current = phase()
                found = value(
                    samples, "pgherd_cluster_phase", namespace=ns, cluster="hippo", phase=current or ""
                )
                ticked = (value(samples, "pgherd_reconcile_duration_seconds_count") or 0) > 0
                return samples if found == 1.0 and ticked else None

            samples = eventually(scraped, what="the cluster's phase in the metrics")
            cluster = phase()
            phases = [
                key
                for key, v in samples.items()
                if key[0] == "pgherd_cluster_phase" and ("namespace", ns) in key[1]
            ]
            assert len(phases) >= 14 and sum(samples[k] for k in phases) == 1.0
            assert (
                value(samples, "pgherd_cluster_condition", namespace=ns, cluster="hippo", condition="Ready")
                == 0.0
            )
            assert value(samples, "pgherd_cluster_members", namespace=ns, cluster="hippo") is not None
            assert value(samples, "pgherd_backup_schedule_enabled", namespace=ns, cluster="hippo") == 0.0
            assert value(samples, "pgherd_backup_failures_total", namespace=ns, cluster="hippo") == 0.0
            assert value(samples, "pgherd_leader") == 1.0
            assert (value(samples, "pgherd_reconcile_duration_seconds_count") or 0) > 0
            assert (value(samples, "pgherd_api_requests_total", verb="PATCH", code="200") or 0) > 0
            assert (value(samples, "pgherd_api_requests_total", verb="POST", code="201") or 0) > 0
        # Its loop stopped with the operator: its series go with it.
        after = scrape(server.server_port)
        assert value(after, "pgherd_cluster_phase", namespace=ns, cluster="hippo", phase=cluster) is None
    finally:
        server.shutdown()


def test_each_failover_and_switchover_is_counted_once() -> None:
    ns, name = "metrics-unit", "hippo"
    began = datetime.now(UTC)
    record = {"phase": "FailingOver", "conditions": [], "instances": 3, "readyInstances": 2}
    metrics.record(ns, name, record, last_backup_at=None, schedule=False, operation=None, failed_backups=[])
    for counter in ("pgherd_failovers_total", "pgherd_switchovers_total"):  # there at 0 before the first
        assert metrics.REGISTRY.get_sample_value(counter, {"namespace": ns, "cluster": name}) == 0
    for operation in [("Failover", began), ("Failover", began), None, ("Switchover", began + timedelta(1))]:
        metrics.record(
            ns, name, record, last_backup_at=None, schedule=False, operation=operation, failed_backups=["a"]
        )
    metrics.record(
        ns, name, record, last_backup_at=None, schedule=True, operation=None, failed_backups=["a", "b"]
    )
    assert metrics.FAILOVERS.labels(ns, name)._value.get() == 1
    assert metrics.SWITCHOVERS.labels(ns, name)._value.get() == 1
    assert metrics.BACKUP_FAILURES.labels(ns, name)._value.get() == 2
    metrics.CLUSTERS.forget(ns, name)


def test_a_forgotten_clusters_counters_start_again_at_zero() -> None:
    """Each cluster's counters are looked up once (not at every tick); a cluster forgotten (its loop
    stopped) and seen again has its series again, from 0."""
    ns, name = "metrics-unit-forget", "hippo"
    began = datetime.now(UTC)
    record = {"phase": "FailingOver", "conditions": [], "instances": 3, "readyInstances": 2}
    metrics.record(
        ns,
        name,
        record,
        last_backup_at=None,
        schedule=False,
        operation=("Failover", began),
        failed_backups=[],
    )
    assert (
        metrics.REGISTRY.get_sample_value("pgherd_failovers_total", {"namespace": ns, "cluster": name}) == 1
    )
    metrics.CLUSTERS.forget(ns, name)
    assert (
        metrics.REGISTRY.get_sample_value("pgherd_failovers_total", {"namespace": ns, "cluster": name})
        is None
    )
    metrics.record(
        ns, name, record, last_backup_at=None, schedule=False, operation=None, failed_backups=["x"]
    )
    assert (
        metrics.REGISTRY.get_sample_value("pgherd_failovers_total", {"namespace": ns, "cluster": name}) == 0
    )
    assert (
        metrics.REGISTRY.get_sample_value("pgherd_backup_failures_total", {"namespace": ns, "cluster": name})
        == 1
    )
    assert metrics.CLUSTERS.figures(ns, name) is metrics.CLUSTERS.figures(ns, name)
    metrics.CLUSTERS.forget(ns, name)
