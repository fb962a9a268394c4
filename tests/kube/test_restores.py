"""Restores on Kubernetes (operator/pgherd/kube/restores.py): the record of which member's agent runs
which restore survives an operator restart (an annotation on the PostgresCluster, read back by a new
Restores), the engine's restore job comes from that member's /status, and the Restore's status gets
its progress and snapshot. Against the real API server, as the chart's ServiceAccount; the requests
counted from the audit log. The restore itself, by a real agent, is in test_operator_members.py."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from pgherd.engine.view import JobState
from pgherd.kube import names
from pgherd.kube.api import KubeApi
from pgherd.kube.observe import ClusterObjects
from pgherd.kube.restores import RestoreRecord, Restores, snapshot_to_restore
from pgherd_backup.agent.wire import Status

from .realkube import AuditLog, ChartIdentity, Kube

NS = "apps"  # of the tests without an API server
STARTED = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


def agent(**fields: Any) -> Status:
    return Status.from_dict({"member": "db-0", "cluster": "db", "fenced": True, **fields})


def restore_manifest(name: str = "r1", ns: str = NS) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": "Restore",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"cluster": {"name": "db"}, "snapshotId": "20261123T110000000Z"},
    }


def cluster_manifest(ns: str = NS) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": "PostgresCluster",
        "metadata": {"name": "db", "namespace": ns},
        "spec": {"instances": 1},
    }


def test_the_record_survives_a_restart_and_the_job_is_the_agents(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    kube.create(cluster_manifest(namespace))

    async def scenario() -> None:
        api = KubeApi(chart_operator.credentials())
        try:
            first = Restores(api, namespace, "db")
            assert first.job_views({}) == ()  # nothing taken: the engine asks for the restore
            await first.save(RestoreRecord("r1", "db-0", STARTED))
        finally:
            await api.close()

    asyncio.run(scenario())
    # A restarted operator reads it back from the cluster and follows the same restore.
    second = Restores(None, namespace, "db")  # type: ignore[arg-type]  # reading needs no API
    stored = kube.read("postgresclusters", namespace, "db")
    assert stored is not None
    second.load(stored)
    assert second.record == RestoreRecord("r1", "db-0", STARTED)
    assert second.taken("r1") and not second.taken("r2")

    running = agent(
        action="restore", actionProgress={"name": "restore", "stage": "replaying", "requestId": "r1"}
    )
    (view,) = second.job_views({"db-0": running})
    assert (view.state, view.stage, view.member) == (JobState.RUNNING, "replaying", "db-0")
    (view,) = second.job_views({"db-0": None})  # not answering: as last seen
    assert (view.state, view.stage) == (JobState.RUNNING, "replaying")
    done = agent(lastAction={"name": "restore", "ok": True, "requestId": "r1", "timeline": 3})
    (view,) = second.job_views({"db-0": done})
    assert (view.state, view.timeline) == (JobState.SUCCEEDED, 3)
    failed = agent(
        lastAction={"name": "restore", "ok": False, "requestId": "r1", "error": "checksum mismatch"}
    )
    (view,) = second.job_views({"db-0": failed})
    assert view.state is JobState.FAILED and "checksum mismatch" in view.message
    # An agent with no record of a restore it took lost its volume: the job failed.
    (view,) = second.job_views({"db-0": agent()})
    assert view.state is JobState.FAILED and "no record" in view.message


def test_a_restore_refused_before_any_agent_took_it_fails_its_job() -> None:
    restores = Restores(None, NS, "db")  # type: ignore[arg-type]
    restores.record = RestoreRecord("r1", "db-0", STARTED, error="Backup 'b1' has no completed snapshot")
    (view,) = restores.job_views({"db-0": agent()})
    assert view.state is JobState.FAILED and "b1" in view.message


def test_the_snapshot_a_restore_names() -> None:
    objects = ClusterObjects(
        cluster=cluster_manifest(),
        backups=[
            {"metadata": {"name": "done"}, "status": {"phase": "Completed", "backupId": "20261123T1"}},
            {"metadata": {"name": "running"}, "status": {"phase": "Running"}},
        ],
    )
    assert snapshot_to_restore(objects, "done", None) == "20261123T1"
    assert snapshot_to_restore(objects, None, "explicit") == "explicit"
    assert snapshot_to_restore(objects, "latest", None) == "latest"
    with pytest.raises(ValueError, match="running"):
        snapshot_to_restore(objects, "running", None)


def test_an_expired_backup_is_never_restored() -> None:
    """Its snapshot id is still in its status (what it was), but retention deleted the snapshot."""
    expired = {"phase": "Expired", "backupId": "20261120T1", "expiredAt": "2026-11-23T03:00:00Z"}
    objects = ClusterObjects(
        cluster=cluster_manifest(), backups=[{"metadata": {"name": "old"}, "status": expired}]
    )
    with pytest.raises(ValueError) as refused:
        snapshot_to_restore(objects, "old", None)
    assert str(refused.value) == (
        "Backup old is Expired (its snapshot was deleted by retention at 2026-11-23T03:00:00Z);"
        " choose another Backup"
    )


def test_progress_and_snapshot_reach_the_restore_once(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, audit: AuditLog
) -> None:
    ns = namespace
    kube.create(cluster_manifest(ns))
    kube.create(restore_manifest(ns=ns))
    progress = {
        "name": "restore",
        "stage": "restoring",
        "requestId": "r1",
        "snapshot": "20261123T110000000Z",
        "bytesDone": 100,
        "bytesTotal": 400,
    }

    async def scenario() -> None:
        api = KubeApi(chart_operator.credentials())
        try:
            restores = Restores(api, ns, "db")
            restores.record = RestoreRecord("r1", "db-0", STARTED)
            objects = ClusterObjects(cluster=cluster_manifest(ns), restores=[restore_manifest(ns=ns)])
            statuses = {"db-0": agent(action="restore", actionProgress=progress)}
            await restores.follow(objects, statuses)
            await restores.follow(objects, statuses)  # unchanged: not written again
        finally:
            await api.close()

    asyncio.run(scenario())
    restore = kube.read("restores", ns, "r1")
    assert restore is not None
    status = restore["status"]
    assert status["progress"] == {"bytesDone": 100, "bytesTotal": 400}
    assert status["snapshotId"] == "20261123T110000000Z"
    audit.fence()
    patches = [
        (e.subresource, e.code) for e in audit.of(chart_operator.user) if e.resource == "restores" and e.write
    ]
    assert patches == [("status", 200)], patches


def test_kept_data_since_the_restore_started() -> None:
    restores = Restores(None, NS, "db")  # type: ignore[arg-type]
    restores.record = RestoreRecord("r1", "db-0", STARTED)
    statuses = {
        "db-0": agent(keptAside=["/v/kept/20261123T120001000000Z", "/v/kept/20261122T120000000000Z"]),
        "db-1": agent(member="db-1", keptAside=["/v/kept/20261123T120500000000Z"]),
        "db-2": None,
    }
    assert restores.kept_data("r1", statuses) == [
        "db-0:/v/kept/20261123T120001000000Z",
        "db-1:/v/kept/20261123T120500000000Z",
    ]
    assert restores.kept_data("other", statuses) == []


def test_a_status_read_before_the_agent_took_the_restore_says_nothing_of_it(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    """The loop reads the agents while the restore order is in flight: a status read before the record
    was saved cannot know the restore, and must not fail it ("no record")."""
    kube.create(cluster_manifest(namespace))

    async def scenario() -> None:
        api = KubeApi(chart_operator.credentials())
        try:
            restores = Restores(api, namespace, "db")
            observed_at = time.monotonic()  # the tick's read starts...
            await restores.save(RestoreRecord("r1", "db-0", STARTED))  # ...the agent takes the order
            (view,) = restores.job_views({"db-0": agent()}, observed_at)
            assert (view.state, view.stage) == (JobState.RUNNING, "restoring")
            # Read after the record: the agent's word counts (here: it has no record of it).
            (view,) = restores.job_views({"db-0": agent()}, time.monotonic())
            assert view.state is JobState.FAILED
        finally:
            await api.close()

    asyncio.run(scenario())
