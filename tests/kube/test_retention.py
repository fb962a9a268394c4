"""Retention on Kubernetes (operator/pgherd/kube/retention.py): the Backups whose snapshot a succeeded
prune Job deleted become Expired through the status subresource, against the emulated API server (the
CRD's schema: the phase enum, expiredAt, message), once each. The prune Job itself, run by the emulated
node against a real S3 server, is in test_operator_members.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from pgherd.kube import names
from pgherd.kube.api import Credentials, KubeApi
from pgherd.kube.events import Events
from pgherd.kube.observe import ClusterObjects
from pgherd.kube.retention import Retention, deleted_snapshots

from .conftest import TOKEN, USER
from .emulator import EmulatedApiServer

NS = "apps"
pytestmark = pytest.mark.kube_emulator(namespaces=[NS])


def cluster_manifest() -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": "PostgresCluster",
        "metadata": {"name": "db", "namespace": NS},
        "spec": {"instances": 1},
    }


def backup(name: str, cluster: str = "db") -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": "Backup",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"cluster": {"name": cluster}},
    }


def prune_job(
    name: str, deleted: list[str], *, succeeded: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A prune Job as the Job controller leaves it, and its pod with the termination message."""
    job = {
        "metadata": {
            "name": name,
            "namespace": NS,
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
        "metadata": {"name": f"{name}-x", "namespace": NS, "labels": {"job-name": name}},
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


def test_the_backups_whose_snapshot_was_deleted_become_expired_once(kube_server: EmulatedApiServer) -> None:
    kube_server.create(cluster_manifest())
    for name, phase, snapshot in (
        ("b1", "Completed", "s1"),
        ("b3", "Completed", "s3"),
        ("b0", "Failed", "s2"),
    ):
        kube_server.create(backup(name))
        kube_server.merge(
            "backups", NS, name, {"status": {"phase": phase, "backupId": snapshot}}, subresource="status"
        )
    job, pod = prune_job("db-prune-1", ["s1", "s2"])
    # As the watch shows them; the second tick still sees these (the watch lags): nothing written again.
    seen = [kube_server.read("backups", NS, name) for name in ("b1", "b3", "b0")]
    objects = ClusterObjects(cluster=cluster_manifest(), jobs=[job], job_pods=[pod], backups=seen)

    async def scenario() -> list[list[str]]:
        api = KubeApi(Credentials(server=kube_server.url, token=TOKEN))
        try:
            retention = Retention(api, Events(api), NS, "db")
            return [await retention.expire(objects), await retention.expire(objects)]
        finally:
            await api.close()

    assert asyncio.run(scenario()) == [["b1"], []]
    status = kube_server.read("backups", NS, "b1")["status"]
    assert status == {
        "phase": "Expired",
        "backupId": "s1",
        "expiredAt": "2026-11-23T03:00:05Z",
        "message": "its snapshot s1 was deleted by retention (keepLast: 2, keepWithin: 7d)",
    }
    assert kube_server.read("backups", NS, "b3")["status"]["phase"] == "Completed"  # kept by retention
    assert kube_server.read("backups", NS, "b0")["status"]["phase"] == "Failed"  # never completed
    patches = [
        c for c in kube_server.calls if c.user == USER and c.resource == "backups" and c.verb == "patch"
    ]
    assert len(patches) == 1
    events = kube_server.items("events.k8s.io/v1/events", NS)
    (event,) = [e for e in events if e.get("reason") == "BackupExpired"]
    assert event["regarding"]["name"] == "b1" and event["type"] == "Normal"
    assert status["message"] in event["note"]
