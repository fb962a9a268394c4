"""The operator's Prometheus metrics (docs/monitoring.md lists them; the alerts in
charts/pgherd/monitoring/alerts.yaml use them).

Per-cluster series are collected at scrape time from what each cluster's loop last wrote (a deleted
cluster's series go with its loop); counters of events (failovers, switchovers, Backup failures) and the
operator's own figures (reconcile latency, API requests by code, agent calls, the Lease) are kept here.
These carry their own `namespace` label: the scrape must keep it (`honor_labels`, a PodMonitor's
`honorLabels: true`).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pgherd.api.cluster import Phase
from pgherd_backup.agent.client import AgentActionError, AgentUnreachable

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILE = Histogram(
    "pgherd_reconcile_duration_seconds",
    "One tick of a cluster's loop: observe, decide, write status, act.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
    registry=REGISTRY,
)
API_REQUESTS = Counter(
    "pgherd_api_requests_total",
    "Requests the operator sent to the Kubernetes API server, by verb and HTTP status code (0: no answer).",
    ["verb", "code"],
    registry=REGISTRY,
)
AGENT_CALLS = Histogram(
    "pgherd_agent_call_duration_seconds",
    "Calls to the members' agents, by call (status or an action) and outcome (ok, refused, unreachable, error).",
    ["call", "outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 15.0),
    registry=REGISTRY,
)
LEADER = Gauge(
    "pgherd_leader", "1 on the operator replica holding the Lease, 0 on the others.", registry=REGISTRY
)
HEAP_FROZEN = Gauge(
    "pgherd_operator_heap_frozen_objects",
    "Objects frozen out of the cyclic collector's scans once the clusters settled (kube/heap.py); 0: none.",
    registry=REGISTRY,
)
HEAP_FROZEN.set_function(gc.get_freeze_count)
FAILOVERS = Counter(
    "pgherd_failovers_total", "Failovers started.", ["namespace", "cluster"], registry=REGISTRY
)
SWITCHOVERS = Counter(
    "pgherd_switchovers_total", "Switchovers started.", ["namespace", "cluster"], registry=REGISTRY
)
BACKUP_FAILURES = Counter(
    "pgherd_backup_failures_total",
    "Backups of the cluster that ended Failed.",
    ["namespace", "cluster"],
    registry=REGISTRY,
)


@dataclass
class ClusterFigures:
    """What the last tick of one cluster's loop knew."""

    phase: str | None = None
    conditions: dict[str, bool] = field(default_factory=dict)
    members: int = 0
    ready_members: int = 0
    last_backup_at: datetime | None = None
    schedule: bool = False
    certificates: dict[str, datetime] = field(default_factory=dict)
    operation: tuple[str, datetime] | None = None  # (kind, started_at) of the operation last counted
    failed_backups: set[str] = field(default_factory=set)
    # The cluster's failovers, switchovers and Backup failures counters, looked up once: `labels()` at
    # every tick of thousands of loops was a few percent of the operator's CPU.
    counters: tuple[Any, Any, Any] | None = None

    def series(self, namespace: str, name: str) -> tuple[Any, Any, Any]:
        """Its counters (each exists at 0 before the first count: increase() then sees the first)."""
        if self.counters is None:
            self.counters = (
                FAILOVERS.labels(namespace, name),
                SWITCHOVERS.labels(namespace, name),
                BACKUP_FAILURES.labels(namespace, name),
            )
        return self.counters


class ClusterCollector(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clusters: dict[tuple[str, str], ClusterFigures] = {}
        # Only the replica holding the Lease reports clusters: the others' figures are stale.
        self.active: Callable[[], bool] = lambda: True

    def figures(self, namespace: str, name: str) -> ClusterFigures:
        key = (namespace, name)
        figures = self._clusters.get(key)  # no ClusterFigures made (and dropped) at every tick of every loop
        if figures is not None:
            return figures
        with self._lock:
            return self._clusters.setdefault(key, ClusterFigures())

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._clusters.pop((namespace, name), None)
        for counter in (FAILOVERS, SWITCHOVERS, BACKUP_FAILURES):
            with contextlib.suppress(KeyError):
                counter.remove(namespace, name)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            clusters = {key: figures for key, figures in self._clusters.items() if figures.phase}
        if not self.active():
            clusters = {}
        labels = ["namespace", "cluster"]
        phase = GaugeMetricFamily(
            "pgherd_cluster_phase", "1 for the cluster's phase, 0 for the others.", labels=[*labels, "phase"]
        )
        condition = GaugeMetricFamily(
            "pgherd_cluster_condition",
            "1 when the condition is True, 0 when not.",
            labels=[*labels, "condition"],
        )
        members = GaugeMetricFamily(
            "pgherd_cluster_members", "Members the cluster has (spec.instances).", labels=labels
        )
        ready = GaugeMetricFamily(
            "pgherd_cluster_ready_members", "Members ready (status.readyInstances).", labels=labels
        )
        backup = GaugeMetricFamily(
            "pgherd_last_backup_timestamp_seconds",
            "When the cluster's last Completed Backup completed.",
            labels=labels,
        )
        schedule = GaugeMetricFamily(
            "pgherd_backup_schedule_enabled", "1 when spec.backup.schedule is set.", labels=labels
        )
        expiry = GaugeMetricFamily(
            "pgherd_certificate_expiry_timestamp_seconds",
            "When each certificate the cluster's members use expires: those the operator issued (server,"
            " replication) and the user's own (postgres, clientCA).",
            labels=[*labels, "certificate"],
        )
        for (namespace, name), figures in sorted(clusters.items()):
            for value in Phase:
                phase.add_metric([namespace, name, value.value], 1.0 if figures.phase == value.value else 0.0)
            for kind, status in sorted(figures.conditions.items()):
                condition.add_metric([namespace, name, kind], 1.0 if status else 0.0)
            members.add_metric([namespace, name], figures.members)
            ready.add_metric([namespace, name], figures.ready_members)
            if figures.last_backup_at is not None:
                backup.add_metric([namespace, name], figures.last_backup_at.timestamp())
            schedule.add_metric([namespace, name], 1.0 if figures.schedule else 0.0)
            for certificate, not_after in sorted(figures.certificates.items()):
                expiry.add_metric([namespace, name, certificate], not_after.timestamp())
        yield from (phase, condition, members, ready, backup, schedule, expiry)


CLUSTERS = ClusterCollector()
REGISTRY.register(CLUSTERS)


def record(
    namespace: str,
    name: str,
    document: Mapping[str, Any],
    *,
    last_backup_at: datetime | None,
    schedule: bool,
    operation: tuple[str, datetime] | None,
    failed_backups: Iterable[str],
    certificates: Mapping[str, datetime] | None = None,
) -> None:
    """What one tick of the cluster's loop wrote (its status document) and saw; ``certificates``: when
    each certificate its members use expires (pgherd's and the user's own)."""
    figures = CLUSTERS.figures(namespace, name)
    figures.phase = str(document.get("phase") or "") or None
    figures.conditions = {
        str(c.get("type")): c.get("status") == "True"
        for c in document.get("conditions") or []
        if c.get("type")
    }
    figures.members = int(document.get("instances") or 0)
    figures.ready_members = int(document.get("readyInstances") or 0)
    figures.last_backup_at = last_backup_at
    figures.schedule = schedule
    if certificates is not None and certificates != figures.certificates:
        figures.certificates = dict(certificates)
    _count_operation(figures, namespace, name, *(operation or (None, None)))
    _count_failed_backups(figures, namespace, name, failed_backups)


def count_operation(namespace: str, name: str, kind: str | None, started_at: datetime | None) -> None:
    """A failover or switchover is counted once, when an operation of that kind first appears."""
    _count_operation(CLUSTERS.figures(namespace, name), namespace, name, kind, started_at)


def _count_operation(
    figures: ClusterFigures, namespace: str, name: str, kind: str | None, started_at: datetime | None
) -> None:
    # Both series exist at 0 before the first one: increase() then sees the first, and dashboards show 0.
    failovers, switchovers, _ = figures.series(namespace, name)
    if kind is None or started_at is None or figures.operation == (kind, started_at):
        return
    figures.operation = (kind, started_at)
    if kind == "Failover":
        failovers.inc()
    elif kind == "Switchover":
        switchovers.inc()


def count_failed_backups(namespace: str, name: str, failed: Iterable[str]) -> None:
    """Backups (by uid) seen Failed for the first time."""
    _count_failed_backups(CLUSTERS.figures(namespace, name), namespace, name, failed)


def _count_failed_backups(figures: ClusterFigures, namespace: str, name: str, failed: Iterable[str]) -> None:
    counter = figures.series(namespace, name)[2]  # the series exists at 0 before any failure
    for uid in failed:
        if uid not in figures.failed_backups:
            figures.failed_backups.add(uid)
            counter.inc()


class CallOutcome:
    """How an agent call ended: ok unless `failed` says otherwise."""

    def __init__(self) -> None:
        self.value = "ok"

    def failed(self, exc: BaseException) -> None:
        if isinstance(exc, AgentUnreachable | OSError):
            self.value = "unreachable"
        elif isinstance(exc, AgentActionError):
            self.value = "refused"
        else:
            self.value = "error"


@contextlib.contextmanager
def agent_call(call: str) -> Iterator[CallOutcome]:
    outcome, started = CallOutcome(), time.monotonic()
    try:
        yield outcome
    finally:
        AGENT_CALLS.labels(call, outcome.value).observe(time.monotonic() - started)


def serve(port: int, address: str = "0.0.0.0") -> WSGIServer:
    """The exposition endpoint (GET /metrics) in a thread of its own; `shutdown()` stops it."""
    server, _thread = start_http_server(port, addr=address, registry=REGISTRY)
    return server
