"""A restore (a Restore object, or the automatic recovery) finishes whatever the lost members do meanwhile:
still down, restarting (their agents not answering yet), empty, never coming back, or coming back in the
middle of it. Each test drives decide() tick by tick through views a platform would report."""

from __future__ import annotations

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
    MemberView,
    RestoreView,
    decide,
)
from pgherd.engine import actions as A
from pgherd.engine.plan import Decision

from .builders import NOW, down, later, lost_primary, make_spec, primary, replica, settled, with_members

STORE = {"store": {"s3": {"bucket": "bkt", "credentials": {"secretName": "s3"}}}}
BACKUP = BackupView("b1", phase="Completed", completed_at=NOW - timedelta(hours=1))


def gone(member: MemberView, *, wiped: bool = False) -> MemberView:
    """Nothing of the member runs (its pod lost, not scheduled); ``wiped``: the platform knows its volume
    is gone too."""
    return replace(down(member), stopped=True, absent=True, data_present=not wiped)


def starting(member: MemberView) -> MemberView:
    """Its pod runs again but its agent does not answer yet: not absent, not known to be stopped."""
    return replace(down(member), stopped=False, absent=False)


def empty(member: MemberView) -> MemberView:
    """Its agent answers for an empty volume (a lost volume, the pod made again)."""
    return replace(down(member), stopped=True, absent=False, data_present=False)


def fenced(member: MemberView) -> MemberView:
    """Its agent answers: fenced, PostgreSQL stopped."""
    return replace(down(member), fenced=True, stopped=True, absent=False, shutdown_clean=True)


def quorum_lost(**spec_fields: object) -> tuple[PostgresClusterSpec, ClusterView, EngineStatus, Decision]:
    """pg-0 (the primary) and pg-1 lost with their pods; pg-2 survives, its WAL receiver cut off."""
    spec, view, status = settled(make_spec(backup=STORE, **spec_fields))
    view = with_members(view, gone(view.members[0]), gone(view.members[1]), lost_primary(view.members[2]))
    view = replace(view, backups=(BACKUP,), rw_member=None)
    d = decide(spec, view, status)
    assert d.phase is Phase.QUORUM_LOST
    return spec, view, d.status, d


def with_restore(view: ClusterView, phase: str = "Pending") -> ClusterView:
    return replace(view, restores=(RestoreView("r1", backup="b1", phase=phase, created_at=NOW),))


def fences(d: Decision) -> set[str]:
    return {a.member for a in d.actions if isinstance(a, A.Fence)}


def start_restores(d: Decision) -> list[A.StartRestore]:
    return [a for a in d.actions if isinstance(a, A.StartRestore)]


def restored_primary(view: ClusterView, name: str = "pg-2") -> MemberView:
    spec = make_spec(backup=STORE)
    ordinal = int(name.rsplit("-", 1)[1])
    return replace(primary(ordinal, spec, lsn=2000, timeline=2), ready=True)


def test_a_restore_applied_while_the_lost_members_are_down_does_not_wait_for_them() -> None:
    spec, view, status, _ = quorum_lost()
    view = with_restore(view)
    d = decide(spec, view, status)
    assert d.phase is Phase.RESTORING
    # Nothing of pg-0 and pg-1 runs: they cannot write, and there is no agent to fence.
    assert fences(d) == {"pg-2"}
    view = with_members(with_restore(view, "Fencing"), fenced(view.members[2]), seconds=1)
    d = decide(spec, view, d.status)
    # The member restored into is one whose agent answers: pg-2, not pg-0 whose pod may never return.
    assert [(a.member, a.backup) for a in start_restores(d)] == [("pg-2", "b1")]
    assert d.status.operation is not None and d.status.operation.target == "pg-2"


def test_a_member_whose_agent_is_starting_is_waited_for_and_never_chosen() -> None:
    spec, view, status, _ = quorum_lost()
    view = with_members(with_restore(view), starting(view.members[0]), fenced(view.members[2]))
    d = decide(spec, view, status)
    # pg-0's agent is starting: it may not be stopped (nothing says so), so the restore waits for it
    # to answer (a Fence is asked: the platform sends it once its agent listens, and never kills it).
    assert d.phase is Phase.RESTORING and not start_restores(d)
    assert "pg-0" in fences(d) and "pg-0" in d.message
    view = with_members(view, fenced(view.members[0]), seconds=2)
    d = decide(spec, view, d.status)
    assert [a.member for a in start_restores(d)] == ["pg-0"]


def test_members_restarting_empty_are_fenced_not_waited_for_and_never_block_the_restore() -> None:
    spec, view, status, _ = quorum_lost()
    view = with_members(with_restore(view), empty(view.members[0]), gone(view.members[1]))
    d = decide(spec, view, status)
    assert fences(d) == {"pg-0", "pg-2"}
    # pg-2 answers, fenced; pg-0's empty agent took its fence too: both may be restored into (lowest).
    view = with_members(
        view, fenced(view.members[2]), replace(empty(view.members[0]), fenced=True), seconds=1
    )
    d = decide(spec, view, d.status)
    assert [a.member for a in start_restores(d)] == ["pg-0"]


def test_a_member_returning_during_the_restore_stays_fenced_until_rebuilt() -> None:
    spec, view, status, _ = quorum_lost()
    view = with_members(with_restore(view), fenced(view.members[2]))
    d = decide(spec, view, status)
    d = decide(spec, later(with_restore(view, "Fencing"), 1), d.status)
    assert [a.member for a in start_restores(d)] == ["pg-2"]
    job = JobView(JobKind.RESTORE, "r1", JobState.RUNNING, member="pg-2", stage="restoring")
    # pg-0 comes back with its old data, read-only (an agent never starts PostgreSQL read-write itself).
    back = replace(replica(0, spec, lsn=900), wal_receiver_streaming=False, upstream=None, ready=False)
    view = replace(with_members(with_restore(view, "Restoring"), back, seconds=5), jobs=(job,))
    d = decide(spec, view, d.status)
    assert d.phase is Phase.RESTORING and fences(d) == {"pg-0"}
    # The restored member is promoted while pg-0 is kept fenced.
    done = replace(job, state=JobState.SUCCEEDED, timeline=2)
    restored = replace(replica(2, spec, lsn=2000, timeline=2), upstream=None, wal_receiver_streaming=False)
    view = replace(with_members(view, fenced(back), restored, seconds=5), jobs=(done,))
    d = decide(spec, view, d.status)
    assert [a.member for a in d.actions if isinstance(a, A.Promote)] == ["pg-2"]
    assert not fences(d)
    # Promoted: pg-0 is re-cloned (its data kept aside), never rewound.
    view = with_members(view, restored_primary(view), seconds=1)
    d = decide(spec, view, d.status)
    d = decide(spec, later(view, 1), d.status)
    rejoins = [a for a in d.actions if isinstance(a, A.Rejoin)]
    assert ("pg-0", "pg-2", True) in {(a.member, a.upstream, a.reclone) for a in rejoins}


def test_a_member_rebuilt_by_the_restore_is_recloned_once_even_if_its_stream_drops() -> None:
    """Seen on a real Kubernetes: a survivor re-cloned from the restored primary, streaming, then its WAL
    receiver reconnecting for a moment (the primary's synchronous standbys changed): it was re-cloned a
    second time, its fresh copy kept aside as if it were old data. Once a member streamed from the
    restored primary it is rebuilt; a dropped stream is ordinary upkeep, never another re-clone."""
    spec, view, status, _ = quorum_lost()
    view = with_members(with_restore(view), fenced(view.members[2]))
    d = decide(spec, view, status)
    d = decide(spec, later(with_restore(view, "Fencing"), 1), d.status)
    job = JobView(JobKind.RESTORE, "r1", JobState.RUNNING, member="pg-2", stage="restoring")
    # pg-0 and pg-1 come back with their old data during the restore (kept fenced).
    back = [
        replace(replica(i, spec, lsn=900), wal_receiver_streaming=False, upstream=None, ready=False)
        for i in (0, 1)
    ]
    view = replace(with_members(with_restore(view, "Restoring"), *back, seconds=5), jobs=(job,))
    d = decide(spec, view, d.status)
    done = replace(job, state=JobState.SUCCEEDED, timeline=2)
    restored = replace(replica(2, spec, lsn=2000, timeline=2), upstream=None, wal_receiver_streaming=False)
    view = replace(with_members(view, *(fenced(b) for b in back), restored, seconds=5), jobs=(done,))
    d = decide(spec, view, d.status)
    assert [a.member for a in d.actions if isinstance(a, A.Promote)] == ["pg-2"]
    view = with_members(view, restored_primary(view), seconds=1)
    d = decide(spec, view, d.status)
    d = decide(spec, later(view, 1), d.status)
    recloned = {a.member for a in d.actions if isinstance(a, A.Rejoin) and a.reclone and a.upstream == "pg-2"}
    assert recloned == {"pg-0", "pg-1"}
    # Re-cloned: pg-0 streams from pg-2 on the restored timeline; pg-1's re-clone goes on.
    rebuilt = replica(0, spec, lsn=2000, upstream="pg-2", timeline=2)
    d = decide(spec, with_members(view, rebuilt, seconds=5), d.status)
    assert d.status.operation is not None and d.status.operation.step == "rebuild"
    assert not [a for a in d.actions if isinstance(a, A.Rejoin) and a.member == "pg-0"]
    # Its WAL receiver reconnects: for one observation it does not stream.
    reconnecting = replace(rebuilt, wal_receiver_streaming=False)
    d = decide(spec, with_members(view, reconnecting, seconds=6), d.status)
    assert not [a for a in d.actions if isinstance(a, A.Rejoin) and a.member == "pg-0" and a.reclone], (
        d.actions
    )


def test_members_that_never_return_do_not_block_the_restore_and_are_recloned_when_they_do() -> None:
    spec, view, status, _ = quorum_lost()
    lost0, lost1 = gone(view.members[0], wiped=True), gone(view.members[1], wiped=True)
    view = with_members(with_restore(view), lost0, lost1, fenced(view.members[2]))
    d = decide(spec, view, status)
    d = decide(spec, later(with_restore(view, "Fencing"), 1), d.status)
    job = JobView(JobKind.RESTORE, "r1", JobState.SUCCEEDED, member="pg-2", timeline=2)
    view = replace(with_members(view, restored_primary(view), seconds=60), jobs=(job,))
    view = with_restore(view, "Restoring")
    d = decide(spec, view, d.status)
    assert d.status.operation is not None and d.status.operation.step == "rebuild"
    d = decide(spec, later(view, 1), d.status)
    # pg-0 and pg-1 have nothing running (their pods cannot be scheduled): the restore completes with
    # the members the cluster can have, and says which are missing.
    assert A.UpdateRestore("r1", "Completed") in d.actions
    assert "pg-0" in d.message and "pg-1" in d.message
    assert d.status.operation is None
    assert d.status.rebuild_pending == frozenset({"pg-0", "pg-1"})
    view = replace(with_restore(view, "Completed"), rw_member="pg-2")
    d = decide(spec, later(view, 1), d.status)
    assert d.phase is Phase.DEGRADED and "not running" in d.message
    # pg-1 is scheduled again: its agent answers for an empty volume; it is seeded from pg-2.
    view = with_members(view, empty(view.members[1]), seconds=30)
    d = decide(spec, view, d.status)
    assert A.Rejoin("pg-1", "pg-2", reclone=True, reason="follow") in d.actions
    # Once it streams from pg-2 it leaves the set; pg-0 is still awaited.
    streaming = replica(1, spec, lsn=2000, upstream="pg-2", timeline=2)
    d = decide(spec, with_members(view, streaming, seconds=5), d.status)
    assert d.status.rebuild_pending == frozenset({"pg-0"})


def test_automatic_recovery_finishes_with_members_that_never_return() -> None:
    spec, view, status, d = quorum_lost(recovery={"onQuorumLoss": "RestoreFromBackup"})
    # The platform knows pg-0's and pg-1's volumes are gone, though nothing of them runs.
    view = with_members(view, gone(view.members[0], wiped=True), gone(view.members[1], wiped=True))
    d = decide(spec, view, status)
    assert d.phase is Phase.QUORUM_LOST and "restoring from backup in" in d.message
    d = decide(spec, later(view, 30), d.status)
    assert d.phase is Phase.RECOVERING and fences(d) == {"pg-2"}
    view = with_members(view, fenced(view.members[2]), seconds=31)
    d = decide(spec, view, d.status)
    assert [(a.member, a.backup) for a in start_restores(d)] == [("pg-2", "b1")]
    assert d.status.operation is not None
    job = JobView(JobKind.RESTORE, d.status.operation.restore or "", JobState.SUCCEEDED, "pg-2", timeline=2)
    view = replace(with_members(view, restored_primary(view), seconds=60), jobs=(job,))
    d = decide(spec, view, d.status)
    d = decide(spec, later(view, 1), d.status)
    assert d.status.operation is None and d.status.rebuild_pending == frozenset({"pg-0", "pg-1"})


def test_the_rebuild_waits_for_a_member_whose_agent_is_starting() -> None:
    spec, view, status, _ = quorum_lost()
    view = with_members(with_restore(view), gone(view.members[0]), fenced(view.members[2]))
    d = decide(spec, view, status)
    d = decide(spec, later(with_restore(view, "Fencing"), 1), d.status)
    job = JobView(JobKind.RESTORE, "r1", JobState.SUCCEEDED, member="pg-2", timeline=2)
    view = replace(with_members(view, restored_primary(view), seconds=60), jobs=(job,))
    d = decide(spec, with_restore(view, "Restoring"), d.status)
    # pg-1 (fenced, its agent up) is being re-cloned; pg-0's pod runs again, its agent starting.
    view = with_members(with_restore(view, "Rebuilding"), starting(view.members[0]), seconds=1)
    d = decide(spec, view, d.status)
    assert d.status.operation is not None and "pg-0" in d.message
    assert A.UpdateRestore("r1", "Completed") not in d.actions


def test_an_empty_member_that_answers_is_seeded_outside_any_restore() -> None:
    spec, view, status = settled(make_spec())
    view = with_members(view, empty(view.members[1]))
    d = decide(spec, view, status)
    assert A.Rejoin("pg-1", "pg-0", reclone=False, reason="follow") in d.actions
