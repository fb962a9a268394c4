"""Status documents of every phase, recorded from the engine's own decisions: each scenario is driven
through `decide()` and written by the Kubernetes adapter's status writer (`kube.status.cluster_status`),
exactly as the operator writes `status` on the API server. Nothing is hand-written but the scenario:
the messages, conditions, operation and engine memory are the engine's."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from engine.builders import NOW, down, later, lost_primary, make_spec, settled, with_members
from pgherd.api.cluster import Phase, PostgresClusterSpec
from pgherd.engine import BackupView, ClusterView, EngineStatus, RestoreView, decide
from pgherd.engine.plan import Decision
from pgherd.engine.status import OldMajorKept, Operation, OperationKind
from pgherd.kube.status import cluster_status
from pgherd.plugin.document import CertificateRecord, Placement, StatusDocument

JSON = dict[str, Any]
STORE = {"store": {"s3": {"bucket": "bkt", "credentials": {"secretName": "s3"}}}, "schedule": "0 3 * * *"}
IMAGE = "ghcr.io/pgherd/pgherd:0.1.0"


def _document(
    spec: PostgresClusterSpec,
    view: ClusterView,
    decision: Decision,
    *,
    name: str = "pg",
    annotations: dict[str, str] | None = None,
    backups: list[JSON] | None = None,
    restores: list[JSON] | None = None,
) -> StatusDocument:
    status = cluster_status(decision, view, {}, image=IMAGE)
    # The adapter stamps conditions with its own clock: the scenario's instead.
    for condition in status["conditions"]:
        condition["lastTransitionTime"] = (view.now - timedelta(seconds=30)).strftime("%Y-%m-%dT%H:%M:%SZ")
    status["postgresVersion"] = status.get("postgresVersion") or 16
    for member in status["members"]:
        if member["reachable"]:
            member["version"] = "16.4"
    cluster = {
        "apiVersion": "pgherd.io/v1alpha1",
        "kind": "PostgresCluster",
        "metadata": {"name": name, "namespace": "apps", "annotations": annotations or {}, "generation": 1},
        "spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True),
        "status": status,
    }
    placements = {
        m.name: Placement(node=f"node-{m.ordinal}", restarts=0, pod_phase="Running", revision=m.revision)
        for m in view.existing()
    }
    expires = (view.now + timedelta(days=400)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return StatusDocument(
        platform="kubernetes",
        namespace="apps",
        now=view.now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        cluster=cluster,
        placements=placements,
        backups=backups or [],
        restores=restores or [],
        events=[],
        certificates=[
            CertificateRecord(
                name="pg-agent tls.crt",
                subject="CN=pg-headless.apps.svc",
                not_after=expires,
                source="Secret pg-agent",
            )
        ],
        operator={
            "name": "pgherd-system/pgherd",
            "image": IMAGE,
            "version": "0.1.0",
            "ready": 1,
            "wanted": 1,
        },
        notes=[],
    )


def backup_object(name: str, phase: str, completed: datetime | None = None, **status: Any) -> JSON:
    body: JSON = {"phase": phase, **status}
    if completed is not None:
        body["completedAt"] = completed.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "pgherd.io/v1alpha1",
        "kind": "Backup",
        "metadata": {"name": name, "namespace": "apps", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"cluster": {"name": "pg"}},
        "status": body,
    }


def running() -> StatusDocument:
    spec, view, status = settled(make_spec(backup=STORE))
    decision = decide(spec, view, status)
    backups = [
        backup_object("pg-nightly-1", "Completed", NOW - timedelta(days=2), size="1.2Gi", storedSize="300Mi"),
        backup_object("pg-nightly-2", "Completed", NOW - timedelta(hours=9), size="1.3Gi", verified=True),
    ]
    return _document(spec, view, decision, backups=backups)


def pending() -> StatusDocument:
    spec = make_spec(backup=STORE, bootstrap={"fromBackup": {"backup": "nightly"}})
    view = ClusterView("pg", NOW, backups=(BackupView("nightly", phase="Running"),))
    return _document(spec, view, decide(spec, view, EngineStatus()))


def creating() -> StatusDocument:
    spec = make_spec()
    view = ClusterView("pg", NOW)
    return _document(spec, view, decide(spec, view, EngineStatus()))


def _primary_lost(seconds: float) -> tuple[PostgresClusterSpec, ClusterView, Decision]:
    spec, view, status = settled()
    lost = with_members(
        view, down(view.members[0]), lost_primary(view.members[1]), lost_primary(view.members[2])
    )
    first = decide(spec, lost, status)
    view = later(lost, seconds)
    return spec, view, decide(spec, view, first.status)


def degraded() -> StatusDocument:
    spec, view, decision = _primary_lost(2)
    return _document(spec, view, decision)


def failing_over() -> StatusDocument:
    spec, view, decision = _primary_lost(6)
    return _document(spec, view, decision)


def switching_over() -> StatusDocument:
    spec, view, status = settled()
    view = replace(view, switchover_to="pg-1")
    return _document(spec, view, decide(spec, view, status), annotations={"pgherd.io/switchover-to": "pg-1"})


def upgrading() -> StatusDocument:
    """A rolling update: a restart asked for (pgherd.io/restart), the most lagging replica first."""
    spec, view, status = settled(lsns={1: 990, 2: 900})
    view = replace(view, restart="2026-01-01T11:59:00Z")
    return _document(
        spec, view, decide(spec, view, status), annotations={"pgherd.io/restart": view.restart or ""}
    )


def upgrading_major() -> StatusDocument:
    spec, view, status = settled(make_spec(backup=STORE, postgresVersion=17))
    return _document(spec, view, decide(spec, view, replace(status, major=16)))


def old_major_kept() -> StatusDocument:
    spec, view, status = settled(make_spec(backup=STORE, postgresVersion=17))
    kept = OldMajorKept("pg-2", 16, 17, NOW - timedelta(minutes=10))
    return _document(spec, view, decide(spec, view, replace(status, major=17, kept=kept)))


def scaling() -> StatusDocument:
    spec, view, status = settled()
    spec = spec.model_copy(update={"instances": 5})
    return _document(spec, view, decide(spec, view, status))


def _quorum_lost(spec: PostgresClusterSpec, data_lost: bool) -> tuple[ClusterView, EngineStatus]:
    _, view, status = settled(spec)
    gone = [down(view.members[0]), down(view.members[1])]
    if data_lost:
        gone = [replace(m, exists=False, data_present=False) for m in gone]
    return with_members(view, *gone, lost_primary(view.members[2])), status


def quorum_lost() -> StatusDocument:
    spec = make_spec()
    view, status = _quorum_lost(spec, data_lost=False)
    first = decide(spec, view, status)
    view = later(view, 20)
    return _document(spec, view, decide(spec, view, first.status))


def recovering() -> StatusDocument:
    spec = make_spec(backup=STORE, recovery={"onQuorumLoss": "RestoreFromBackup"})
    view, status = _quorum_lost(spec, data_lost=True)
    view = replace(
        view, backups=(BackupView("pg-nightly-2", phase="Completed", completed_at=NOW - timedelta(hours=9)),)
    )
    first = decide(spec, view, status)
    view = later(view, 30)
    return _document(
        spec,
        view,
        decide(spec, view, first.status),
        backups=[backup_object("pg-nightly-2", "Completed", NOW)],
    )


def restoring() -> StatusDocument:
    spec, view, status = settled(make_spec(backup=STORE))
    view = replace(
        view,
        backups=(BackupView("b1", phase="Completed", completed_at=NOW),),
        restores=(RestoreView("r1", backup="b1", target_time="2026-01-01T11:00:00Z"),),
    )
    restore = {
        "metadata": {"name": "r1", "creationTimestamp": "2026-01-01T11:59:00Z"},
        "spec": {"cluster": {"name": "pg"}, "backup": "b1", "target": {"time": "2026-01-01T11:00:00Z"}},
        "status": {"phase": "Fencing"},
    }
    return _document(
        spec,
        view,
        decide(spec, view, status),
        backups=[backup_object("b1", "Completed", NOW)],
        restores=[restore],
    )


def paused() -> StatusDocument:
    spec, view, status = settled(make_spec(paused=True))
    view = with_members(view, down(view.members[0]))
    return _document(spec, later(view, 60), decide(spec, later(view, 60), status))


def failed() -> StatusDocument:
    """A rolling update aborted: a replica did not come back within the step's timeout."""
    spec, view, status = settled()
    started = decide(spec, replace(view, restart="2026-01-01T11:00:00Z"), status)
    operation = started.status.operation
    assert operation is not None
    aborted: Operation = replace(
        operation, failed="pg-2 was not Ready and caught up 0:10:00 after its restart"
    )
    view = replace(view, restart="2026-01-01T11:00:00Z")
    return _document(spec, view, decide(spec, view, replace(started.status, operation=None, aborted=aborted)))


def deleting() -> StatusDocument:
    spec, view, status = settled()
    view = replace(view, deleting=True)
    return _document(spec, view, decide(spec, view, status))


ALL = {
    Phase.PENDING: pending,
    Phase.CREATING: creating,
    Phase.RUNNING: running,
    Phase.DEGRADED: degraded,
    Phase.SCALING: scaling,
    Phase.UPGRADING: upgrading,
    Phase.SWITCHING_OVER: switching_over,
    Phase.FAILING_OVER: failing_over,
    Phase.QUORUM_LOST: quorum_lost,
    Phase.RECOVERING: recovering,
    Phase.RESTORING: restoring,
    Phase.PAUSED: paused,
    Phase.FAILED: failed,
    Phase.DELETING: deleting,
}

__all__ = ["ALL", "NOW", "UTC", "OperationKind"]
