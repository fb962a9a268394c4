"""Scaling, bootstrap, majority failure and restore, backups, pause and deletion."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

from pgherd.api.cluster import Phase, PostgresClusterSpec
from pgherd.engine import (
    BackupView,
    ClusterView,
    EngineStatus,
    JobKind,
    JobState,
    JobView,
    RestoreView,
    decide,
)
from pgherd.engine import actions as A
from pgherd.engine.plan import Decision
from pgherd.engine.quorum import SyncConfig

from .builders import CLUSTER, NOW, down, later, lost_primary, make_spec, replica, settled, with_members

STORE = {"store": {"s3": {"bucket": "bkt", "credentials": {"secretName": "s3"}}}}


def test_new_cluster_initdb_then_first_primary() -> None:
    spec = make_spec()
    d1 = decide(spec, ClusterView(CLUSTER, NOW), EngineStatus())
    assert d1.phase is Phase.CREATING
    assert [type(a) for a in d1.actions] == [A.CreateMember]
    assert d1.actions[0].seed is A.Seed.INITDB  # type: ignore[union-attr]


def test_bootstrap_from_a_backup_not_yet_completed_is_pending() -> None:
    spec = make_spec(bootstrap={"fromBackup": {"backup": "nightly"}})
    view = ClusterView(CLUSTER, NOW, backups=(BackupView("nightly", phase="Running"),))
    decision = decide(spec, view, EngineStatus())
    assert decision.phase is Phase.PENDING and decision.actions == ()


def test_bootstrap_from_a_backup_names_the_backup_or_the_snapshot_id_apart() -> None:
    """The platform gives the agent a snapshot id: a Backup's (its backupId) or the one named."""
    for source, expected in (
        ({"backup": "nightly"}, ("nightly", None)),
        ({"snapshotId": "20261205T080000Z"}, (None, "20261205T080000Z")),
    ):
        spec = make_spec(backup=STORE, bootstrap={"fromBackup": {**source, "target": {"immediate": True}}})
        view = ClusterView(CLUSTER, NOW, backups=(BackupView("nightly", phase="Completed"),))
        (create,) = decide(spec, view, EngineStatus()).actions
        assert isinstance(create, A.CreateMember) and create.seed is A.Seed.SNAPSHOT
        assert (create.source, create.snapshot_id, create.target) == (*expected, "immediate")


def test_scale_up_creates_members_and_admits_them_through_safe_sync_steps() -> None:
    spec, view, status = settled()
    spec = make_spec(instances=5)
    d1 = decide(spec, view, status)
    assert d1.phase is Phase.SCALING
    created = [a.member for a in d1.actions if isinstance(a, A.CreateMember)]
    assert created == ["pg-3", "pg-4"]
    view = with_members(view, replica(3, spec), replica(4, spec))
    d2 = decide(spec, view, d1.status)
    sync = [a for a in d2.actions if isinstance(a, A.SetSynchronousStandbys)]
    assert sync and sync[0].config == SyncConfig(2, frozenset({"pg-1", "pg-2", "pg-3"}))
    assert "pg-3" not in d2.status.voters  # raise k and widen first, count the member after


def _run(
    spec: PostgresClusterSpec,
    view: ClusterView,
    status: EngineStatus,
    steps: int = 20,
    stop: Callable[[Decision], bool] | None = None,
) -> tuple[list[A.Action], EngineStatus]:
    """Drive decide() with a primary that applies sync changes and members that get deleted."""
    seen: list[A.Action] = []
    for step in range(steps):
        d = decide(spec, later(view, step), status)
        seen += d.actions
        status = d.status
        primary = view.member(status.current_primary)
        if status.sync_pending is not None and primary is not None:
            view = with_members(view, replace(primary, sync=status.sync_pending))
        gone = {a.member for a in d.actions if isinstance(a, A.DeleteMember)}
        view = replace(view, members=tuple(m for m in view.members if m.name not in gone))
        if stop is not None and stop(d):
            break
    return seen, status


def test_scale_down_removes_highest_ordinals_after_quorum_steps_and_drops_slots() -> None:
    _, view, status = settled(make_spec(instances=5))
    seen, status = _run(make_spec(instances=3), view, status)
    deleted = [a.member for a in seen if isinstance(a, A.DeleteMember)]
    dropped = [a.slot for a in seen if isinstance(a, A.DropReplicationSlot)]
    assert deleted == ["pg-4", "pg-3"] and dropped == ["pg-4", "pg-3"]
    assert status.voters == {"pg-0", "pg-1", "pg-2"}
    assert status.sync == SyncConfig(1, frozenset({"pg-1", "pg-2"}))


def test_scale_down_switches_over_first_when_the_primary_is_removed() -> None:
    _, view, status = settled(make_spec(instances=5), primary_ordinal=4)
    seen, status = _run(
        make_spec(instances=3),
        view,
        status,
        stop=lambda d: any(isinstance(a, A.Fence) for a in d.actions),
    )
    assert not [a for a in seen if isinstance(a, A.DeleteMember) and a.member == "pg-4"]
    assert A.Fence("pg-4", reason="switchover") in seen


def _quorum_lost(
    spec_fields: dict[str, object], data_lost: bool = False
) -> tuple[PostgresClusterSpec, ClusterView, EngineStatus]:
    """pg-0 (the primary) and pg-1 unreachable; with ``data_lost`` the platform also reports their
    volumes gone (the evidence an automatic restore needs)."""
    spec, view, status = settled(make_spec(**spec_fields))
    gone = [down(view.members[0]), down(view.members[1])]
    if data_lost:
        gone = [replace(m, exists=False, data_present=False) for m in gone]
    members = [*gone, lost_primary(view.members[2])]
    return spec, with_members(view, *members), status


def test_quorum_lost_waits_and_never_promotes() -> None:
    spec, view, status = _quorum_lost({})
    d = decide(spec, view, status)
    for seconds in (10, 100, 1000):
        d = decide(spec, later(view, seconds), d.status)
        assert d.phase is Phase.QUORUM_LOST
        assert not [a for a in d.actions if isinstance(a, A.Promote | A.StartRestore | A.Fence)]


def test_quorum_loss_restores_from_latest_backup_when_asked() -> None:
    spec, view, status = _quorum_lost(
        {"backup": STORE, "recovery": {"onQuorumLoss": "RestoreFromBackup"}}, data_lost=True
    )
    view = replace(
        view,
        backups=(
            BackupView("old", phase="Completed", completed_at=NOW - timedelta(days=2)),
            BackupView("new", phase="Completed", completed_at=NOW - timedelta(days=1)),
        ),
    )
    d = decide(spec, view, status)
    assert d.phase is Phase.QUORUM_LOST and "restoring from backup in" in d.message
    d = decide(spec, later(view, 30), d.status)
    assert d.phase is Phase.RECOVERING
    # pg-0 and pg-1 are gone with their volumes: only pg-2 is left to fence.
    assert {a.member for a in d.actions if isinstance(a, A.Fence)} == {"pg-2"}
    fenced = with_members(later(view, 31), *[replace(m, fenced=True, stopped=True) for m in view.members])
    d = decide(spec, fenced, d.status)
    restore = [a for a in d.actions if isinstance(a, A.StartRestore)]
    assert len(restore) == 1 and restore[0].backup == "new" and restore[0].member == "pg-0"


def test_restore_object_drives_its_phases() -> None:
    spec, view, status = settled(make_spec(backup=STORE))
    view = replace(
        view,
        backups=(BackupView("b1", phase="Completed", completed_at=NOW),),
        restores=(RestoreView("r1", backup="b1"),),
    )
    d = decide(spec, view, status)
    assert d.phase is Phase.RESTORING
    assert A.UpdateRestore("r1", "Fencing") in d.actions
    fenced = with_members(view, *[replace(down(m), fenced=True, stopped=True) for m in view.members])
    fenced = replace(fenced, restores=(RestoreView("r1", backup="b1", phase="Fencing"),))
    d = decide(spec, fenced, d.status)
    assert [type(a) for a in d.actions] == [A.UpdateRestore, A.StartRestore]
    job = JobView(JobKind.RESTORE, "r1", JobState.FAILED, member="pg-0", message="checksum mismatch")
    failed = decide(spec, replace(fenced, jobs=(job,)), d.status)
    assert failed.phase is Phase.FAILED
    assert A.UpdateRestore("r1", "Failed", error="checksum mismatch") in failed.actions


def test_restore_of_a_missing_backup_fails_the_restore() -> None:
    spec, view, status = settled(make_spec(backup=STORE))
    view = replace(view, restores=(RestoreView("r1", backup="nope"),))
    d = decide(spec, view, status)
    assert [type(a) for a in d.actions] == [A.UpdateRestore] and d.actions[0].phase == "Failed"  # type: ignore[union-attr]


def test_backup_prefers_a_streaming_standby_and_prunes_after_success() -> None:
    spec, view, status = settled(make_spec(backup={**STORE, "retention": {"keepLast": 3}}), lsns={1: 990})
    view = replace(view, backups=(BackupView("b1"),))
    d = decide(spec, view, status)
    assert A.StartSnapshot("b1", "pg-2", reason="Backup requested") in d.actions
    running = replace(
        view,
        backups=(BackupView("b1", phase="Running", source_member="pg-2"),),
        jobs=(JobView(JobKind.SNAPSHOT, "b1", JobState.SUCCEEDED, member="pg-2"),),
    )
    d = decide(spec, running, d.status)
    assert [type(a) for a in d.actions] == [A.UpdateBackup, A.Prune]


def test_a_snapshot_job_whose_pod_does_not_start_fails_its_backup_after_the_start_timeout() -> None:
    """backup.jobStartTimeoutSeconds (default 300): a Job whose pod has waited that long to start fails
    its Backup with the platform's reason; a shorter wait, or a pod that started, changes nothing."""
    spec, view, status = settled(make_spec(backup=STORE))
    assert spec.backup is not None and spec.backup.job_start_timeout_seconds == 300
    reason = 'pod b1-snapshot-x: CreateContainerConfigError: secret "s3" not found'

    def waiting(seconds: float, why: str = reason) -> ClusterView:
        job = JobView(
            JobKind.SNAPSHOT,
            "b1",
            JobState.RUNNING,
            member="pg-2",
            waiting_since=NOW - timedelta(seconds=seconds),
            waiting_reason=why,
        )
        return replace(view, backups=(BackupView("b1", phase="Running", source_member="pg-2"),), jobs=(job,))

    assert decide(spec, waiting(299), status).actions == ()
    [failed] = decide(spec, waiting(300), status).actions
    assert failed == A.UpdateBackup(
        "b1",
        "Failed",
        error=f"the snapshot Job's pod did not start within 300 s (backup.jobStartTimeoutSeconds): {reason}",
    )
    # Merely slow (an image still being pulled): the same once the timeout has passed.
    [slow] = decide(spec, waiting(301, "pod b1-snapshot-x: ContainerCreating"), status).actions
    assert isinstance(slow, A.UpdateBackup) and slow.error and slow.error.endswith("ContainerCreating")
    shorter = make_spec(backup={**STORE, "jobStartTimeoutSeconds": 30})
    assert [type(a) for a in decide(shorter, waiting(30), status).actions] == [A.UpdateBackup]
    started = replace(waiting(3600), jobs=(JobView(JobKind.SNAPSHOT, "b1", JobState.RUNNING, member="pg-2"),))
    assert decide(spec, started, status).actions == ()


def test_backup_target_primary() -> None:
    spec, view, status = settled(make_spec(backup=STORE))
    view = replace(view, backups=(BackupView("b1", target="primary"),))
    d = decide(spec, view, status)
    assert A.StartSnapshot("b1", "pg-0", reason="Backup requested") in d.actions


def test_scheduled_backup_is_created_when_due() -> None:
    spec, view, status = settled(make_spec(backup={**STORE, "schedule": "0 3 * * *"}))
    d = decide(spec, view, status)
    assert d.status.last_scheduled_backup == NOW and not d.actions
    d = decide(spec, later(view, 3600 * 24), d.status)
    assert [a for a in d.actions if isinstance(a, A.CreateBackup)] == [
        A.CreateBackup("pg-202601020300", reason="schedule 0 3 * * *")
    ]


def test_paused_observes_only() -> None:
    spec, view, status = settled(make_spec(paused=True))
    view = with_members(view, down(view.members[0]))
    d = decide(spec, later(view, 600), status)
    assert d.phase is Phase.PAUSED and d.actions == () and d.status == status


def test_deleting() -> None:
    spec, view, status = settled()
    d = decide(spec, replace(view, deleting=True), status)
    assert d.phase is Phase.DELETING and d.actions == ()


def test_a_new_member_counts_only_once_it_holds_commits_acknowledged_before_it_joined() -> None:
    """Found by the long property run: commits acknowledged under the narrower configuration are
    below the primary's LSN when the wider one took effect; a member that has not received them yet
    must not count for majorities (two such members could outvote the only holders)."""
    spec, view, status = settled()
    spec = make_spec(instances=4)
    primary = replace(view.members[0], received_lsn=2000)
    newcomer = replace(replica(3, spec, lsn=1500), upstream="pg-0")
    view = with_members(view, primary, newcomer)
    d1 = decide(spec, view, status)  # widen first: ANY 2 (pg-1, pg-2, pg-3)
    assert d1.status.sync_pending == SyncConfig(2, frozenset({"pg-1", "pg-2", "pg-3"}))
    applied = with_members(view, replace(primary, sync=d1.status.sync_pending))
    d2 = decide(spec, applied, d1.status)
    assert d2.status.sync_since_lsn == 2000
    assert "pg-3" not in d2.status.voters  # still below 2000
    caught_up = with_members(applied, replace(newcomer, received_lsn=2000))
    d3 = decide(spec, caught_up, d2.status)
    assert "pg-3" in d3.status.voters


def test_continuous_archiving_says_why_the_archiver_fails() -> None:
    """The archiver's reason (wal-push's error, from the primary's agent) is the condition's message: an
    endpoint whose certificate the store's CA does not verify is named there, not merely "fails"."""
    spec, view, status = settled(make_spec(backup=STORE))

    def archiving(view: ClusterView) -> dict[str, object]:
        [condition] = [c for c in decide(spec, view, status).conditions if c.type == "ContinuousArchiving"]
        return {"status": condition.status, "reason": condition.reason, "message": condition.message or ""}

    assert archiving(replace(view, archiving_healthy=True))["status"] is True
    assert archiving(replace(view, archiving_healthy=False)) == {
        "status": False,
        "reason": "ArchiveFailing",
        "message": "WAL archiving fails",
    }
    why = "the S3 endpoint https://minio:9000 presented a certificate that the CA bundle ... does not verify"
    failing = archiving(replace(view, archiving_healthy=False, archiving_error=why))
    assert failing == {
        "status": False,
        "reason": "ArchiveFailing",
        "message": f"WAL archiving fails: {why}",
    }
