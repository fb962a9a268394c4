"""Retention on Kubernetes (operator/pgherd/kube/retention.py): the Backups whose snapshot a succeeded
prune Job deleted become Expired through the status subresource, against the real API server (the
CRD's schema: the phase enum, expiredAt, message), once each: the writes counted from its audit log,
made as the chart's ServiceAccount. The prune Job itself, run by a real kubelet against a real S3
server, is in e2e/test_kube_operations.py (the localkube driver)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pgherd.kube import names
from pgherd.kube.api import KubeApi
from pgherd.kube.events import Events
from pgherd.kube.observe import ClusterObjects
from pgherd.kube.retention import Retention, deleted_snapshots

from .realkube import AuditLog, ChartIdentity, Kube

NS = "apps"  # of the test without an API server


def cluster_manifest(ns: str = NS) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": "PostgresCluster",
        "metadata": {"name": "db", "namespace": ns},
        "spec": {"instances": 1},
    }


def backup(name: str, ns: str, cluster: str = "db") -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": "Backup",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"cluster": {"name": cluster}},
    }


def prune_job(
    name: str, deleted: list[str], *, succeeded: bool = True, ns: str = NS
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A prune Job as the Job controller leaves it, and its pod with the termination message (as the
    watch gives them to the operator; not objects of the API server here)."""
    job = {
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {names.LABEL_CLUSTER: "db", names.LABEL_COMPONENT: names.COMPONENT_PRUNE},
        },
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "prune",
                            "command": ["pgherd-backup", "prune", "--keep-last", "2", "--keep-within", "7d"],
                        }
                    ]
                }
            }
        },
        "status": (
            {
                "succeeded": 1,
                "completionTime": "2026-11-23T03:00:05Z",
                "conditions": [{"type": "Complete", "status": "True"}],
            }
            if succeeded
            else {"active": 1}
        ),
    }
    summary = {"kept": ["s3", "s4"], "deleted_snapshots": deleted, "deleted_wal_files": 3}
    pod = {
        "metadata": {"name": f"{name}-x", "namespace": ns, "labels": {"job-name": name}},
        "status": {
            "containerStatuses": [
                {"name": "prune", "state": {"terminated": {"exitCode": 0, "message": json.dumps(summary)}}}
            ]
        },
    }
    return job, pod


def test_the_snapshots_succeeded_prune_jobs_deleted() -> None:
    done, done_pod = prune_job("db-prune-1", ["s1", "s2"])
    running, running_pod = prune_job("db-prune-2", ["s3"], succeeded=False)
    objects = ClusterObjects(
        cluster=cluster_manifest(), jobs=[done, running], job_pods=[done_pod, running_pod]
    )
    assert deleted_snapshots(objects) == {
        "s1": ("2026-11-23T03:00:05Z", "keepLast: 2, keepWithin: 7d"),
        "s2": ("2026-11-23T03:00:05Z", "keepLast: 2, keepWithin: 7d"),
    }


def test_the_backups_whose_snapshot_was_deleted_become_expired_once(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, audit: AuditLog
) -> None:
    ns = namespace
    kube.create(cluster_manifest(ns))
    for name, phase, snapshot in (
        ("b1", "Completed", "s1"),
        ("b3", "Completed", "s3"),
        ("b0", "Failed", "s2"),
    ):
        kube.create(backup(name, ns))
        kube.merge(
            "backups", ns, name, {"status": {"phase": phase, "backupId": snapshot}}, subresource="status"
        )
    job, pod = prune_job("db-prune-1", ["s1", "s2"], ns=ns)
    # As the watch shows them; the second tick still sees these (the watch lags): nothing written again.
    seen = [b for b in (kube.read("backups", ns, name) for name in ("b1", "b3", "b0")) if b is not None]
    objects = ClusterObjects(cluster=cluster_manifest(ns), jobs=[job], job_pods=[pod], backups=seen)

    async def scenario() -> list[list[str]]:
        api = KubeApi(chart_operator.credentials())
        try:
            retention = Retention(api, Events(api), ns, "db")
            return [await retention.expire(objects), await retention.expire(objects)]
        finally:
            await api.close()

    assert asyncio.run(scenario()) == [["b1"], []]

    def status_of(name: str) -> dict[str, Any]:
        doc = kube.read("backups", ns, name)
        assert doc is not None
        return dict(doc["status"])

    status = status_of("b1")
    assert status == {
        "phase": "Expired",
        "backupId": "s1",
        "expiredAt": "2026-11-23T03:00:05Z",
        "message": "its snapshot s1 was deleted by retention (keepLast: 2, keepWithin: 7d)",
    }
    assert status_of("b3")["phase"] == "Completed"  # kept by retention
    assert status_of("b0")["phase"] == "Failed"  # never completed
    audit.fence()
    writes = [
        (e.verb, e.name, e.subresource, e.code)
        for e in audit.of(chart_operator.user)
        if e.resource == "backups" and e.write
    ]
    assert writes == [("patch", "b1", "status", 200)], writes
    events = kube.items("events", ns)
    (event,) = [e for e in events if e.get("reason") == "BackupExpired"]
    assert event["regarding"]["name"] == "b1" and event["type"] == "Normal"
    assert status["message"] in event["note"]
