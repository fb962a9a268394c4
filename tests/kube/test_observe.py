"""What the operator makes of Pods, PVCs, the StatefulSet, Jobs and agents' /status (pure functions)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import backups
from pgherd.engine.actions import UpdateBackup
from pgherd.engine.context import Context
from pgherd.engine.status import EngineStatus
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


def test_a_member_with_an_action_awaited_is_busy_before_its_agent_says_so() -> None:
    """An action the operator sent and still awaits (Agents.busy at the pod's address) makes the member
    busy, as one its agent reports."""
    objects = ClusterObjects(
        cluster(),
        pods=[pod("db-0"), pod("db-1", "10.0.0.2")],
        pvcs=[pvc("db-0"), pvc("db-1")],
        statefulset=sts(2),
    )
    statuses = {"db-0": agent("db-0", role="primary"), "db-1": agent("db-1")}
    plain = cluster_view(objects, statuses, NOW, switchover_to=None)
    assert [m.busy for m in plain.members] == [False, False]
    sent = cluster_view(objects, statuses, NOW, switchover_to=None, busy={"db-1"})
    assert [m.busy for m in sent.members] == [False, True]
    reported = {**statuses, "db-0": agent("db-0", role="primary", action="set-sync")}
    assert [m.busy for m in cluster_view(objects, reported, NOW, switchover_to=None).members] == [True, False]


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


def _own_slice(*endpoints: tuple[str, str], managed_by: str = names.SLICE_MANAGER) -> dict[str, Any]:
    """The -rw slice as the operator's index keeps it: (pod name, address) endpoints, ready."""
    listed = [
        {"addresses": [ip], "conditions": {"ready": True}, "targetRef": {"kind": "Pod", "name": name}}
        for name, ip in endpoints
    ]
    return {"name": names.rw_slice("db"), "managedBy": managed_by, "endpoints": listed}


def test_rw_member_is_the_one_member_the_operators_slice_names_at_its_pods_address() -> None:
    def member(*slices: dict[str, Any]) -> str | None:
        # Role labels no longer route -rw: a pod labelled primary is not what the slice says.
        pods = [pod("db-0", "10.0.0.1", role="replica"), pod("db-1", "10.0.0.2", role="primary")]
        return rw_member(ClusterObjects(cluster(), pods=pods, rw_slices=list(slices)))

    assert member() is None  # no slice yet: the engine's SetPrimary writes it
    assert member(_own_slice(("db-0", "10.0.0.1"))) == "db-0"
    # The pod was made again with another address: the slice routes nowhere, the engine writes it again.
    assert member(_own_slice(("db-0", "10.0.0.9"))) is None
    assert member(_own_slice(("db-0", "10.0.0.1"), ("db-1", "10.0.0.2"))) is None  # never two
    assert member(_own_slice()) is None  # emptied (a fence by deletion)
    assert member(_own_slice(("db-9", "10.0.0.1"))) is None  # no such pod
    # A slice Kubernetes' controller made for an earlier version's selector is not the operator's.
    controllers = _own_slice(("db-0", "10.0.0.1"), managed_by="endpointslice-controller.k8s.io")
    assert member(controllers) is None


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


# -- a snapshot Job whose pod cannot start ---------------------------------------------------------


def snapshot_job(
    status: dict[str, Any] | None = None, created: str = "2026-11-23T11:50:00Z"
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "b1-snapshot",
            "creationTimestamp": created,
            "labels": {
                names.LABEL_BACKUP: "b1",
                names.LABEL_COMPONENT: names.COMPONENT_SNAPSHOT,
                names.LABEL_MEMBER: "db-1",
            },
        },
        "status": status if status is not None else {"active": 1},
    }


def snapshot_pod(
    name: str = "b1-snapshot-x1",
    *,
    created: str = "2026-11-23T11:55:00Z",
    phase: str = "Pending",
    state: dict[str, Any] | None = None,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if state is not None:
        status["containerStatuses"] = [{"name": "snapshot", "state": state}]
    if conditions is not None:
        status["conditions"] = conditions
    return {
        "metadata": {"name": name, "creationTimestamp": created, "labels": {"job-name": "b1-snapshot"}},
        "status": status,
    }


MISSING_SECRET = {
    "waiting": {"reason": "CreateContainerConfigError", "message": 'secret "backup-store" not found'}
}
UNSCHEDULABLE = [
    {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient memory.",
    }
]


def observed_job(job: dict[str, Any], *pods: dict[str, Any]) -> Any:
    objects = ClusterObjects(cluster(), jobs=[job], job_pods=list(pods), statefulset=sts(0))
    [seen] = cluster_view(objects, {}, NOW, switchover_to=None).jobs
    return seen


def test_a_snapshot_pod_that_has_not_started_is_reported_waiting_with_the_kubelets_reason() -> None:
    seen = observed_job(snapshot_job(), snapshot_pod(state=MISSING_SECRET))
    assert seen.state is JobState.RUNNING
    assert seen.waiting_since == datetime(2026, 11, 23, 11, 55, tzinfo=UTC)
    assert seen.waiting_reason == (
        'pod b1-snapshot-x1: CreateContainerConfigError: secret "backup-store" not found'
    )


def test_an_unscheduled_snapshot_pod_is_reported_waiting_with_the_schedulers_reason() -> None:
    seen = observed_job(snapshot_job(), snapshot_pod(conditions=UNSCHEDULABLE))
    assert seen.waiting_since == datetime(2026, 11, 23, 11, 55, tzinfo=UTC)
    assert seen.waiting_reason == (
        "pod b1-snapshot-x1: Unschedulable: 0/3 nodes are available: 3 Insufficient memory."
    )


def test_a_snapshot_pod_still_being_created_is_waiting_for_no_problem_yet() -> None:
    creating = {"waiting": {"reason": "ContainerCreating"}}
    seen = observed_job(snapshot_job(), snapshot_pod(state=creating))
    assert seen.waiting_since == datetime(2026, 11, 23, 11, 55, tzinfo=UTC)
    assert seen.waiting_reason == "pod b1-snapshot-x1: ContainerCreating"
    fresh = observed_job(snapshot_job(), snapshot_pod())  # Pending, nothing reported yet
    assert fresh.waiting_since is not None and fresh.waiting_reason == "pod b1-snapshot-x1: Pending"


def test_a_snapshot_pod_that_started_is_not_waiting() -> None:
    running = {"running": {"startedAt": "2026-11-23T11:55:05Z"}}
    assert observed_job(snapshot_job(), snapshot_pod(phase="Running", state=running)).waiting_since is None
    # A retry after a pod that ran and failed: the new pod's own wait counts, from its creation.
    failed = snapshot_pod(
        "b1-snapshot-x1", phase="Failed", state={"terminated": {"exitCode": 1, "reason": "Error"}}
    )
    retry = snapshot_pod("b1-snapshot-x2", created="2026-11-23T11:58:00Z", state=MISSING_SECRET)
    seen = observed_job(snapshot_job({"active": 1, "failed": 1}), failed, retry)
    assert seen.waiting_since == datetime(2026, 11, 23, 11, 58, tzinfo=UTC)
    assert "b1-snapshot-x2" in seen.waiting_reason
    # Between two attempts (no active pod, one failed): not waiting to start.
    assert observed_job(snapshot_job({"failed": 1}), failed).waiting_since is None
    # A finished Job is never waiting.
    done = snapshot_job({"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]})
    assert observed_job(done, snapshot_pod(state=MISSING_SECRET)).waiting_since is None


def test_a_snapshot_job_without_any_pod_waits_from_its_own_creation() -> None:
    """The Job controller could not create a pod (a quota, a Pod Security refusal): the Job itself
    waits. A Job whose status counts a pod that the watch has not shown yet is not judged."""
    seen = observed_job(snapshot_job({}))
    assert seen.waiting_since == datetime(2026, 11, 23, 11, 50, tzinfo=UTC)
    assert "no pod" in seen.waiting_reason and "b1-snapshot" in seen.waiting_reason
    assert observed_job(snapshot_job({"active": 1})).waiting_since is None


def test_a_snapshot_job_whose_pod_cannot_start_fails_its_backup_after_the_timeout() -> None:
    """The decision, from fabricated Job and pod objects: the adapter reports the wait, the engine fails
    the Backup once it lasted backup.jobStartTimeoutSeconds, with the kubelet's reason in the error."""
    spec = PostgresClusterSpec.model_validate(
        {
            "backup": {
                "store": {"s3": {"bucket": "bkt", "credentials": {"secretName": "backup-store"}}},
                "jobStartTimeoutSeconds": 120,
            }
        }
    )
    backup = {
        "metadata": {"name": "b1", "creationTimestamp": "2026-11-23T11:49:00Z"},
        "spec": {"cluster": {"name": "db"}},
        "status": {"phase": "Running", "sourceMember": "db-1"},
    }

    def decided(pod: dict[str, Any]) -> tuple[Any, ...]:
        objects = ClusterObjects(
            cluster(), jobs=[snapshot_job()], job_pods=[pod], backups=[backup], statefulset=sts(0)
        )
        view = cluster_view(objects, {}, NOW, switchover_to=None)
        return backups.plan(Context(spec, view, EngineStatus(), "r"), EngineStatus()).actions

    # Created 1 min 59 s before NOW: still within the timeout, nothing is decided.
    assert decided(snapshot_pod(created="2026-11-23T11:58:01Z", state=MISSING_SECRET)) == ()
    assert decided(snapshot_pod(created="2026-11-23T11:58:01Z", conditions=UNSCHEDULABLE)) == ()
    # Two minutes: the Backup fails with the kubelet's reason and message.
    [failed] = decided(snapshot_pod(created="2026-11-23T11:58:00Z", state=MISSING_SECRET))
    assert isinstance(failed, UpdateBackup) and failed.phase == "Failed" and failed.name == "b1"
    assert failed.error is not None
    assert 'CreateContainerConfigError: secret "backup-store" not found' in failed.error
    assert "120 s" in failed.error and "b1-snapshot-x1" in failed.error
    [unscheduled] = decided(snapshot_pod(created="2026-11-23T11:50:00Z", conditions=UNSCHEDULABLE))
    assert isinstance(unscheduled, UpdateBackup) and unscheduled.error is not None
    assert "Unschedulable: 0/3 nodes are available" in unscheduled.error
    # A pod that started, however long ago it was created, is never failed for it.
    running = snapshot_pod(
        created="2026-11-23T11:00:00Z", phase="Running", state={"running": {"startedAt": "x"}}
    )
    assert decided(running) == ()


def test_the_restart_request_reaches_the_view() -> None:
    asked = cluster()
    asked["metadata"]["annotations"] = {"pgherd.io/restart": "2026-01-01T12:00:00Z"}
    view = cluster_view(ClusterObjects(asked, statefulset=sts(0)), {}, NOW, switchover_to=None)
    assert view.restart == "2026-01-01T12:00:00Z"
    assert (
        cluster_view(ClusterObjects(cluster(), statefulset=sts(0)), {}, NOW, switchover_to=None).restart
        is None
    )


def test_archiving_is_what_the_primarys_archiver_says() -> None:
    """pg_stat_archiver of the primary, and why wal-push last failed (the ContinuousArchiving
    condition's message): a replica's word does not count, and nothing is known without a primary."""
    objects = ClusterObjects(
        cluster(),
        pods=[pod("db-0"), pod("db-1", "10.0.0.2")],
        pvcs=[pvc("db-0"), pvc("db-1")],
        statefulset=sts(2),
    )
    why = "the CA bundle /etc/pgherd/s3-ca/ca.crt (AWS_CA_BUNDLE) does not exist"
    failing = {
        "db-0": agent("db-0", "primary", archivingHealthy=False, archiveError=why),
        "db-1": agent("db-1", archivingHealthy=True),
    }
    view = cluster_view(objects, failing, NOW, switchover_to=None)
    assert (view.archiving_healthy, view.archiving_error) == (False, why)
    healthy = {"db-0": agent("db-0", "primary", archivingHealthy=True), "db-1": agent("db-1")}
    view = cluster_view(objects, healthy, NOW, switchover_to=None)
    assert (view.archiving_healthy, view.archiving_error) == (True, None)
    view = cluster_view(
        objects, {"db-0": None, "db-1": agent("db-1", archivingHealthy=False)}, NOW, switchover_to=None
    )
    assert (view.archiving_healthy, view.archiving_error) == (None, None)


def test_a_failed_snapshot_job_says_what_its_command_said() -> None:
    """A snapshot that fails writes no summary: its pod's termination message is its log's tail, whose
    last line (pgherd-backup's one-line error: an endpoint whose certificate the CA does not verify) is
    the Backup's error, as in the sandbox, rather than the Job controller's BackoffLimitExceeded."""
    failed_job = snapshot_job(
        {"failed": 3, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}
    )
    line = (
        "pgherd-backup: error: the S3 endpoint https://minio:9000 presented a certificate that the CA bundle"
        " /etc/pgherd/s3-ca/ca.crt (AWS_CA_BUNDLE) does not verify (unable to get local issuer certificate)"
    )
    terminated = {"terminated": {"exitCode": 1, "message": f"starting the snapshot\n{line}\n"}}
    seen = observed_job(failed_job, snapshot_pod(phase="Failed", state=terminated))
    assert seen.state is JobState.FAILED and seen.message == line
    # Without any pod's word, the Job controller's reason.
    assert observed_job(failed_job).message == "BackoffLimitExceeded"


def _slice(*endpoints: tuple[str, bool | None]) -> dict[str, Any]:
    listed = []
    for target, ready in endpoints:
        conditions = {} if ready is None else {"ready": ready}
        listed.append({"conditions": conditions, "targetRef": {"kind": "Pod", "name": target}})
    return {"name": "db-rw-abcde", "endpoints": listed}


def test_the_rw_routes_are_the_ready_endpoints_of_the_rw_slices() -> None:
    def routes(*slices: dict[str, Any]) -> frozenset[str] | None:
        objects = ClusterObjects(cluster(), pods=[pod("db-0", role=names.ROLE_PRIMARY)], statefulset=sts(1))
        objects.rw_slices = list(slices)
        return cluster_view(objects, {}, NOW, switchover_to=None).rw_routes

    assert routes() == frozenset()  # no slice yet: routes to nothing
    assert routes(_slice(("db-0", False))) == frozenset()  # listed, not ready (kubelet's readiness)
    assert routes(_slice(("db-0", None))) == {"db-0"}  # unset ready means ready (discovery.k8s.io/v1)
    assert routes(_slice(("db-0", True)), _slice(("db-1", True))) == {"db-0", "db-1"}
    unwatched = ClusterObjects(cluster(), pods=[pod("db-0")], statefulset=sts(1))
    assert cluster_view(unwatched, {}, NOW, switchover_to=None).rw_routes is None


def test_a_member_is_ready_for_its_services_when_the_kubelet_says_so() -> None:
    unready, ready = pod("db-0"), pod("db-1")
    ready["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    unready["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    objects = ClusterObjects(cluster(), pods=[unready, ready], statefulset=sts(2))
    views = members(objects, {"db-0": agent("db-0"), "db-1": agent("db-1")})
    assert [(v.ready, v.platform_ready) for v in views] == [(True, False), (True, True)]


def test_a_reachable_member_whose_pod_is_being_deleted_is_terminating_before_its_agent_says_so() -> None:
    """The deletion's watch event wakes the loop before the kubelet's SIGTERM reaches the agent: the
    engine hands the primary over at once instead of at the next poll (2 s later)."""
    deleted, kept = pod("db-0"), pod("db-1")
    deleted["metadata"]["deletionTimestamp"] = "2026-11-23T12:00:00Z"
    objects = ClusterObjects(cluster(), pods=[deleted, kept], statefulset=sts(2))
    views = members(objects, {"db-0": agent("db-0", role="primary"), "db-1": agent("db-1")})
    assert [(v.name, v.terminating) for v in views] == [("db-0", True), ("db-1", False)]
    # Not answering: nothing to hand over from (its fence is the deletion itself).
    unanswered = members(objects, {"db-1": agent("db-1")})
    assert [(v.name, v.terminating) for v in unanswered] == [("db-0", False), ("db-1", False)]
