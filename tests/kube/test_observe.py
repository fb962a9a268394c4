"""What the operator makes of Pods, PVCs, the StatefulSet, Jobs and agents' /status (pure functions)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pgherd.engine.view import JobKind, JobState, Role
from pgherd.kube import names
from pgherd.kube.observe import ClusterObjects, cluster_view, job_state, members, process_gone, rw_member
from pgherd_backup.agent.wire import Status, WalReceiver

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


def cluster(name: str = "db", ns: str = "apps") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns, "uid": "u-1", "generation": 3}, "spec": {}}


def pod(
    name: str, ip: str | None = "10.0.0.1", *, running: bool = True, role: str | None = None
) -> dict[str, Any]:
    labels = {names.LABEL_CLUSTER: "db", names.LABEL_COMPONENT: names.COMPONENT_POSTGRES}
    if role:
        labels[names.LABEL_ROLE] = role
    state = (
        {"running": {"startedAt": "2026-11-23T11:00:00Z"}}
        if running
        else {"waiting": {"reason": "CrashLoopBackOff"}}
    )
    return {
        "metadata": {"name": name, "namespace": "apps", "labels": labels, "uid": f"uid-{name}"},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "containerStatuses": [{"name": names.CONTAINER_POSTGRES, "state": state}],
        },
    }


def pvc(member: str) -> dict[str, Any]:
    return {"metadata": {"name": names.pvc("db", member), "namespace": "apps"}}


def sts(replicas: int) -> dict[str, Any]:
    return {"metadata": {"name": "db"}, "spec": {"replicas": replicas}}


def agent(member: str, role: str = "replica", **fields: Any) -> Status:
    base: dict[str, Any] = {
        "member": member,
        "cluster": "db",
        "role": role,
        "postmaster": "running",
        "ready": True,
        "timeline": 1,
        "receivedLsn": "0/3000000",
        "replayedLsn": "0/3000000",
        "heldLsn": "0/3000000",
        "dataPresent": True,
        "fenced": False,
    }
    base.update(fields)
    return Status.from_dict({k: v for k, v in base.items()})


def test_a_member_waiting_for_its_seed_does_not_exist_and_has_no_data() -> None:
    objects = ClusterObjects(cluster(), pods=[pod("db-0")], pvcs=[pvc("db-0")], statefulset=sts(1))
    status = agent("db-0", role="unknown", postmaster="stopped", dataPresent=False, action=None)
    [view] = members(objects, {"db-0": status})
    assert not view.exists and not view.data_present and not view.reachable and view.stopped


def test_a_member_being_seeded_exists_and_is_not_stopped() -> None:
    objects = ClusterObjects(cluster(), pods=[pod("db-0")], pvcs=[pvc("db-0")], statefulset=sts(1))
    status = agent("db-0", role="unknown", postmaster="stopped", dataPresent=True, action="seed")
    [view] = members(objects, {"db-0": status})
    assert view.exists and view.data_present and not view.stopped


def test_an_unreachable_pod_that_the_kubelet_reports_running_is_not_stopped() -> None:
    """A partitioned node: the pod may still run PostgreSQL. No evidence, no promotion."""
    objects = ClusterObjects(cluster(), pods=[pod("db-0"), pod("db-1", "10.0.0.2")], statefulset=sts(2))
    views = {v.name: v for v in members(objects, {"db-0": None, "db-1": agent("db-1")})}
    assert views["db-0"].exists and not views["db-0"].reachable and not views["db-0"].stopped
    assert views["db-0"].data_present  # unreachability is never evidence of lost data


def test_a_deleted_pod_is_stopped_but_keeps_its_data() -> None:
    objects = ClusterObjects(cluster(), pods=[], pvcs=[pvc("db-0")], statefulset=sts(1))
    [view] = members(objects, {})
    assert view.exists and view.stopped and view.data_present


def test_a_container_not_running_is_gone() -> None:
    assert process_gone(None)
    assert process_gone(pod("db-0", running=False))
    assert not process_gone(pod("db-0"))
    assert process_gone({"metadata": {"name": "x"}, "status": {"phase": "Pending"}})


def test_ordinals_beyond_the_statefulset_without_pod_or_volume_do_not_exist() -> None:
    objects = ClusterObjects(cluster(), pods=[pod("db-0")], pvcs=[pvc("db-0")], statefulset=sts(3))
    views = {v.name: v for v in members(objects, {"db-0": agent("db-0", role="primary")})}
    assert set(views) == {"db-0", "db-1", "db-2"}
    assert not views["db-1"].exists and not views["db-2"].exists
    assert views["db-0"].role is Role.PRIMARY and views["db-0"].is_primary


def test_upstream_resolved_by_pod_ip_and_by_dns_name() -> None:
    objects = ClusterObjects(
        cluster(),
        pods=[pod("db-0", "10.0.0.1"), pod("db-1", "10.0.0.2"), pod("db-2", "10.0.0.3")],
        statefulset=sts(3),
    )
    by_ip = agent("db-1", walReceiver=WalReceiver(status="streaming", upstream="10.0.0.1:5432").to_dict())
    by_dns = agent(
        "db-2",
        walReceiver=WalReceiver(
            status="streaming", upstream=f"{names.member_host('db', 'db-0', 'apps')}:5432"
        ).to_dict(),
    )
    views = {
        v.name: v for v in members(objects, {"db-0": agent("db-0", "primary"), "db-1": by_ip, "db-2": by_dns})
    }
    assert views["db-1"].upstream == "db-0" and views["db-1"].streams_from("db-0")
    assert views["db-2"].upstream == "db-0"


def test_rw_member_is_the_one_pod_labelled_primary() -> None:
    one = ClusterObjects(cluster(), pods=[pod("db-0", role="primary"), pod("db-1", role="replica")])
    two = ClusterObjects(cluster(), pods=[pod("db-0", role="primary"), pod("db-1", role="primary")])
    assert rw_member(one) == "db-0"
    assert rw_member(two) is None  # the engine re-points it: never two


def test_snapshot_jobs_and_their_result() -> None:
    job = {
        "metadata": {
            "name": "b1-snapshot",
            "labels": {
                names.LABEL_BACKUP: "b1",
                names.LABEL_COMPONENT: names.COMPONENT_SNAPSHOT,
                names.LABEL_MEMBER: "db-1",
            },
        },
        "status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]},
    }
    job_pod = {
        "metadata": {"name": "b1-snapshot-x1", "labels": {"job-name": "b1-snapshot"}},
        "status": {
            "containerStatuses": [
                {
                    "name": "snapshot",
                    "state": {
                        "terminated": {
                            "exitCode": 0,
                            "message": '{"backupId": "20261123T1200", "timeline": 1}',
                        }
                    },
                }
            ]
        },
    }
    objects = ClusterObjects(cluster(), jobs=[job], job_pods=[job_pod], statefulset=sts(0))
    view = cluster_view(objects, {}, NOW, switchover_to=None)
    [seen] = view.jobs
    assert (seen.kind, seen.name, seen.state, seen.member) == (
        JobKind.SNAPSHOT,
        "b1",
        JobState.SUCCEEDED,
        "db-1",
    )
    assert seen.backup_id == "20261123T1200" and seen.timeline == 1
    failed = {
        "status": {
            "failed": 3,
            "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}],
        }
    }
    assert job_state(failed) is JobState.FAILED
    assert job_state({"status": {"active": 1}}) is JobState.RUNNING


def test_backups_and_restores_of_this_cluster_only() -> None:
    mine = {
        "metadata": {"name": "b1", "creationTimestamp": "2026-11-23T10:00:00Z"},
        "spec": {"cluster": {"name": "db"}},
    }
    other = {"metadata": {"name": "b2"}, "spec": {"cluster": {"name": "other"}}}
    restore = {
        "metadata": {"name": "r1"},
        "spec": {"cluster": {"name": "db"}, "backup": "b1", "target": {"lsn": "0/3000000"}},
        "status": {"phase": "Fencing"},
    }
    objects = ClusterObjects(cluster(), backups=[mine, other], restores=[restore], statefulset=sts(0))
    view = cluster_view(objects, {}, NOW, switchover_to=None)
    assert [b.name for b in view.backups] == ["b1"] and view.backups[0].phase == "Pending"
    assert view.restores[0].target_lsn == "0/3000000" and view.restores[0].phase == "Fencing"
    assert view.generation == 3
