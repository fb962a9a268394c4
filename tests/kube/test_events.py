"""An Event for every decision the engine acts on, on the PostgresCluster (`kubectl describe pgc`), against
the real API server, as the chart's ServiceAccount:

- the operator's loop posts the engine's account of a decision (engine/narrate.py) once the status is
  written, once: the ticks after it find the engine's memory as it left it and tell nothing again;
- the actuator (kube/actions.py) tells what an action did, once: the StatefulSet scaled, a Backup
  created, its Job started, its end, a prune Job, a member fenced by deleting its pod; the engine's
  own Events are never held back as repeats.

No node runs here (no kubelet): what needs members' agents (a fence they acknowledge, a promotion, a
rejoin) is the actuator's same code path with an agent's answer, and the engine's side of it is in
tests/engine/test_narrate.py."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import actions as act
from pgherd.kube import names
from pgherd.kube.actions import ActContext, apply_all
from pgherd.kube.agents import Agents
from pgherd.kube.api import KubeApi
from pgherd.kube.events import CONTROLLER, Events
from pgherd.kube.observe import ClusterObjects
from pgherd.kube.restores import Restores
from pgherd.local.ports import free_port

from .realkube import AuditLog, ChartIdentity, Kube, running_as
from .test_operator import cluster_manifest
from .waiting import eventually

JSON = dict[str, Any]


def events_of(kube: Kube, ns: str, kind: str = "PostgresCluster", name: str = "hippo") -> list[JSON]:
    found = [
        e
        for e in kube.items("events", ns)
        if (e.get("regarding") or {}).get("kind") == kind and (e.get("regarding") or {}).get("name") == name
    ]
    return sorted(found, key=lambda e: e.get("eventTime") or "")


def reasons(events: list[JSON]) -> list[str]:
    return [e["reason"] for e in events]


def _failover_promoted(kube: Kube, ns: str) -> None:
    """A new cluster whose status says its failover promoted hippo-1, which never answered."""
    kube.create(cluster_manifest(ns))
    long_ago = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    engine = {
        "initialized": True,
        "complete": True,
        "currentPrimary": "hippo-0",
        "timeline": 1,
        "voters": ["hippo-0", "hippo-1", "hippo-2"],
        "operation": {
            "kind": "Failover",
            "startedAt": long_ago,
            "step": "promote",
            "stepStartedAt": long_ago,
            "source": "hippo-0",
            "target": "hippo-1",
            "reason": "primary hippo-0 failed (a test's)",
        },
    }
    kube.merge("postgresclusters", ns, "hippo", {"status": {"engine": engine}}, subresource="status")


def test_the_loop_tells_a_decision_once_when_its_status_is_written(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    """A failover whose new primary was promoted and never answered: the engine records it as the primary
    all the same (never a second promotion beside it) and the failover ends short of a primary."""
    ns = namespace
    _failover_promoted(kube, ns)
    with running_as(chart_operator):
        eventually(
            lambda: {"Promoted", "FailoverInterrupted"} <= set(reasons(events_of(kube, ns))),
            30,
            "the failover's Events",
        )
        time.sleep(2)  # ten ticks more (steady interval 0.2 s): told once
    told = events_of(kube, ns)
    by_reason = {e["reason"]: e for e in told}
    assert reasons(told).count("Promoted") == 1 and reasons(told).count("FailoverInterrupted") == 1, told
    promoted, interrupted = by_reason["Promoted"], by_reason["FailoverInterrupted"]
    assert promoted["type"] == "Normal"
    assert promoted["note"] == (
        "hippo-1 is the primary on timeline 1, was hippo-0: failover from hippo-0 (primary hippo-0 failed (a test's))"
    )
    assert interrupted["type"] == "Warning"
    assert interrupted["note"].endswith("stopped before its end: the primary hippo-1 is not available")
    for event in (promoted, interrupted):
        assert event["reportingController"] == CONTROLLER
        assert event["regarding"]["apiVersion"] == names.API_VERSION
        assert event["regarding"]["uid"] == kube.read("postgresclusters", ns, "hippo")["metadata"]["uid"]  # type: ignore[index]
    status = (kube.read("postgresclusters", ns, "hippo") or {})["status"]
    assert status["engine"]["currentPrimary"] == "hippo-1" and "operation" not in status["engine"]


def test_a_tick_tells_its_decision_once_it_acted(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, audit: AuditLog
) -> None:
    """Each Event is a request to the API server: the tick writes its status, then acts (the owned
    objects, the actions), and only then tells. A failover's promotion on localkube waited up to 0.17 s
    behind the Events before. Here, the first tick of a cluster whose failover promoted: the StatefulSet
    it creates comes before the Events it tells (Promoted, FailoverInterrupted)."""
    ns = namespace
    mark = audit.fence()
    _failover_promoted(kube, ns)
    with running_as(chart_operator):
        eventually(lambda: "Promoted" in reasons(events_of(kube, ns)), 30, "the Promoted Event")
    audit.fence()
    creates = [
        e.resource
        for e in audit.of(chart_operator.user, mark)
        if e.verb == "create" and e.resource in ("statefulsets", "events")
    ]
    assert "statefulsets" in creates and "events" in creates, creates
    assert creates.index("statefulsets") < creates.index("events"), creates


def test_a_new_cluster_tells_its_first_member_once(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    ns = namespace
    kube.create(cluster_manifest(ns))
    with running_as(chart_operator):
        eventually(lambda: "ScaledUp" in reasons(events_of(kube, ns)), 30, "ScaledUp")
        time.sleep(2)
    (scaled,) = [e for e in events_of(kube, ns) if e["reason"] == "ScaledUp"]
    assert scaled["type"] == "Normal"
    assert scaled["note"] == (
        "creating hippo-0, to be seeded by initdb: new cluster (StatefulSet hippo: 0 -> 1 replicas)"
    )


def _sts(ns: str, replicas: int) -> JSON:
    labels = {names.LABEL_CLUSTER: "hippo"}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "hippo", "namespace": ns, "labels": labels},
        "spec": {
            "replicas": replicas,
            "serviceName": "hippo-headless",
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "postgres", "image": "pgherd:test"}]},
            },
        },
    }


def _job(ns: str, name: str) -> JSON:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": ns, "labels": {names.LABEL_CLUSTER: "hippo"}},
        "spec": {
            "template": {
                "spec": {"restartPolicy": "Never", "containers": [{"name": "job", "image": "pgherd:test"}]}
            }
        },
    }


def _backup(ns: str, name: str) -> JSON:
    return {
        "apiVersion": names.API_VERSION,
        "kind": "Backup",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"cluster": {"name": "hippo"}},
    }


def test_the_actions_tell_what_they_did(kube: Kube, namespace: str, chart_operator: ChartIdentity) -> None:
    ns = namespace
    kube.create(cluster_manifest(ns))
    kube.create(_sts(ns, 3))
    for name in ("b1", "b2"):
        kube.create(_backup(ns, name))
    # No controller makes the namespace's default ServiceAccount here; a pod's admission wants it.
    kube.create(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}}
    )
    pod = kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "hippo-0", "namespace": ns, "labels": {names.LABEL_CLUSTER: "hippo"}},
            "spec": {"containers": [{"name": names.CONTAINER_POSTGRES, "image": "pgherd:test"}]},
        }
    )
    # As the kubelet would report it: its agent started, at an address where nothing answers.
    pod["status"] = {
        "phase": "Running",
        "podIP": "127.0.0.1",
        "containerStatuses": [{"name": names.CONTAINER_POSTGRES, "state": {"running": {}}, "started": True}],
    }
    cluster = kube.read("postgresclusters", ns, "hippo")
    assert cluster is not None
    objects = ClusterObjects(
        cluster=cluster,
        pods=[pod],
        statefulset=kube.read("statefulsets", ns, "hippo"),
        backups=[b for b in (kube.read("backups", ns, n) for n in ("b1", "b2")) if b is not None],
    )

    async def scenario() -> None:
        api = KubeApi(chart_operator.credentials())
        agents = Agents("hippo", token="t", ca_pem=None, server_hostname=lambda _: None, scheme="http")
        agents.port = free_port()  # nothing listens there: the agent does not answer
        events = Events(api)
        context = ActContext(
            api=api,
            objects=objects,
            spec=PostgresClusterSpec.model_validate(cluster["spec"]),
            statuses={},
            agents=agents,
            current_primary="hippo-0",
            member_address=lambda member: f"{member}.hippo-headless:5432",
            may_act=lambda: True,
            snapshot_job=lambda backup, member, host: _job(ns, f"hippo-snapshot-{backup}"),
            prune_job=lambda action: _job(ns, "hippo-prune-1"),
            event=lambda action: events.post(cluster, action),
            event_on=events.record,
            restores=Restores(api, ns, "hippo"),
        )
        decided = act.RecordEvent("UpgradeConfirmed", "an Event of the engine's own")
        try:
            await apply_all(
                context,
                (
                    act.DeleteMember("hippo-2", reason="scale down"),
                    act.CreateBackup("hippo-202611271200", reason="schedule 0 12 * * *"),
                    act.CreateBackup("hippo-202611271200", reason="schedule 0 12 * * *"),  # made already
                    act.StartSnapshot("b1", "hippo-1", reason="Backup requested"),
                    act.StartSnapshot("b1", "hippo-1", reason="snapshot job not found"),  # its Job exists
                    act.UpdateBackup("b2", "Completed", source_member="hippo-1"),
                    act.UpdateBackup("b1", "Failed", error="the snapshot job failed"),
                    act.UpdateBackup("b1", "Failed", error="the snapshot job failed"),  # seen again
                    act.Prune(3, None, reason="after b2"),
                    decided,
                    decided,  # the engine's Events are one-off decisions: both told
                    act.Fence("hippo-0", reason="primary hippo-0 failed"),
                ),
            )
        finally:
            await agents.close()
            await api.close()

    asyncio.run(scenario())
    told = {(e["reason"], e["note"], e["type"]) for e in events_of(kube, ns)}
    assert reasons(events_of(kube, ns)).count("UpgradeConfirmed") == 2
    assert told == {
        (
            "ScaledDown",
            "removing hippo-2 (its volume kept): scale down (StatefulSet hippo: 3 -> 2 replicas)",
            "Normal",
        ),
        ("BackupCreated", "Backup hippo-202611271200: schedule 0 12 * * *", "Normal"),
        (
            "BackupStarted",
            "Backup b1: snapshot Job hippo-snapshot-b1 from hippo-1: Backup requested",
            "Normal",
        ),
        ("BackupCompleted", "Backup b2 completed, from hippo-1", "Normal"),
        ("BackupFailed", "backup b1 failed: the snapshot job failed", "Warning"),
        ("PruneStarted", "prune Job hippo-prune-1: retention keepLast 3 (after b2)", "Normal"),
        ("UpgradeConfirmed", "an Event of the engine's own", "Normal"),
        (
            "Fenced",
            "hippo-0's agent does not answer: its pod is deleted, so that nothing of it writes:"
            " primary hippo-0 failed",
            "Warning",
        ),
    }
    # The Backup's own failure on the Backup too (`kubectl describe pgbackup`).
    assert reasons(events_of(kube, ns, "Backup", "b1")) == ["BackupFailed"]
    assert (kube.read("statefulsets", ns, "hippo") or {})["spec"]["replicas"] == 2
    assert kube.read("pods", ns, "hippo-0") is None or (kube.read("pods", ns, "hippo-0") or {})[
        "metadata"
    ].get("deletionTimestamp")
