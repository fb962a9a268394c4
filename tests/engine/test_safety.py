"""Regression tests for the engine-safety review (issue #10): each scenario as a scripted sequence of
views, each failing on the engine before its fix.

The views are what an adapter would observe; ``_apply`` plays the platform's part where a scenario
needs the effect of an action (a sync configuration taking hold, a member deleted).
"""

from __future__ import annotations

from dataclasses import replace

from pgherd.api.cluster import Phase, PostgresClusterSpec
from pgherd.engine import ClusterView, EngineStatus, Role, decide
from pgherd.engine import actions as A
from pgherd.engine.conditions import ConditionType
from pgherd.engine.plan import Decision
from pgherd.engine.quorum import SyncConfig, failover_keeps_commits
from pgherd.engine.revision import spec_revision
from pgherd.engine.rollout import PRIMARY_RESTART_TIMEOUT
from pgherd.engine.status import Operation, OperationKind
from pgherd.engine.view import BackupView, RestoreView

from .builders import NOW, down, later, lost_primary, make_spec, settled, with_members

STORE = {"store": {"s3": {"bucket": "bkt", "credentials": {"secretName": "s3"}}}}


def _apply(view: ClusterView, decision: Decision) -> ClusterView:
    """The platform's effect of the actions this scenario needs: sync settings and deletions."""
    members = {m.name: m for m in view.members}
    for action in decision.actions:
        if isinstance(action, A.SetSynchronousStandbys) and action.member in members:
            members[action.member] = replace(members[action.member], sync=action.config)
        elif isinstance(action, A.DeleteMember):
            members.pop(action.member, None)
    return replace(view, members=tuple(sorted(members.values(), key=lambda m: m.ordinal)))


def _promotions(decision: Decision) -> list[str]:
    return [a.member for a in decision.actions if isinstance(a, A.Promote)]


def _run(
    spec: PostgresClusterSpec, view: ClusterView, status: EngineStatus, steps: int, seconds: float = 1
) -> tuple[ClusterView, EngineStatus, list[Decision]]:
    decisions = []
    for _ in range(steps):
        decision = decide(spec, view, status)
        decisions.append(decision)
        status = decision.status
        view = later(_apply(view, decision), seconds)
    return view, status, decisions


# ---- 1. scale-down by two voters ------------------------------------------------------------------


def test_scale_down_by_two_voters_keeps_the_only_holders_of_an_acknowledged_commit() -> None:
    """ANY 2 (pg-1..pg-4): pg-3 and pg-4 acknowledged the commit at LSN 2000, pg-1 and pg-2 lag at 1000.
    Scaling to 3 must not leave the voters {pg-0, pg-1, pg-2} while neither replica has LSN 2000: a
    crash of pg-0 would then promote a member without the commit."""
    _, view, status = settled(make_spec(instances=5), lsns={0: 2000, 1: 1000, 2: 1000, 3: 2000, 4: 2000})
    status = replace(status, sync_since_lsn=500)
    spec3 = make_spec(instances=3)
    view, status, _ = _run(spec3, view, status, 30)
    assert "pg-3" in status.voters, "pg-3, a holder of the commit, left the voters while pg-1/pg-2 lag"
    # pg-0 crashes: whatever the engine promotes must hold LSN 2000.
    dead = with_members(view, down(view.members[0]), *[lost_primary(m) for m in view.members[1:]])
    for step in range(12):
        decision = decide(spec3, later(dead, step), status)
        status = decision.status
        for name in _promotions(decision):
            member = dead.member(name)
            assert member is not None and (member.most_wal or 0) >= 2000, f"promoted {name} without LSN 2000"
        if any(isinstance(a, A.Fence) for a in decision.actions):
            dead = with_members(dead, replace(dead.members[0], fenced=True, stopped=True))


def test_scale_down_completes_once_a_remaining_replica_holds_the_commits() -> None:
    _, view, status = settled(make_spec(instances=5), lsns={0: 2000, 1: 1000, 2: 1000, 3: 2000, 4: 2000})
    status = replace(status, sync_since_lsn=500)
    spec3 = make_spec(instances=3)
    view, status, _ = _run(spec3, view, status, 10)
    caught_up = with_members(view, replace(view.members[1], received_lsn=2000, held_lsn=2000))
    view, status, decisions = _run(spec3, caught_up, status, 30)
    assert status.voters == {"pg-0", "pg-1", "pg-2"}
    assert {m.name for m in view.members} == {"pg-0", "pg-1", "pg-2"}
    assert decisions[-1].phase is Phase.RUNNING


# ---- 2. automatic recovery needs evidence that a majority's data is gone -------------------------


def _all_unreachable(spec: PostgresClusterSpec) -> tuple[PostgresClusterSpec, ClusterView, EngineStatus]:
    spec, view, status = settled(spec)
    view = with_members(view, *[down(m) for m in view.members])
    view = replace(view, backups=(BackupView("b", phase="Completed", completed_at=NOW),))
    return spec, view, status


def test_no_automatic_restore_when_members_are_merely_unreachable() -> None:
    spec, view, status = _all_unreachable(
        make_spec(backup=STORE, recovery={"onQuorumLoss": "RestoreFromBackup"})
    )
    for seconds in (0, 20, 60, 600, 6000):
        decision = decide(spec, later(view, seconds), status)
        status = decision.status
        assert decision.phase is Phase.QUORUM_LOST
        assert not [a for a in decision.actions if isinstance(a, A.StartRestore | A.Fence | A.Promote)]
    assert "no automatic restore" in decision.message


def test_automatic_restore_once_a_majority_of_volumes_is_reported_lost() -> None:
    spec, view, status = _all_unreachable(
        make_spec(backup=STORE, recovery={"onQuorumLoss": "RestoreFromBackup"})
    )
    one_lost = with_members(view, replace(view.members[1], exists=False, data_present=False))
    decision = decide(spec, later(one_lost, 600), decide(spec, one_lost, status).status)
    assert decision.phase is Phase.QUORUM_LOST, "one lost volume of three is not a majority"
    two_lost = with_members(one_lost, replace(view.members[2], exists=False, data_present=False))
    first = decide(spec, two_lost, status)
    decision = decide(spec, later(two_lost, 60), first.status)
    assert decision.phase is Phase.RECOVERING


def test_a_lone_member_restarting_for_long_is_never_restored_over() -> None:
    spec, view, status = settled(
        make_spec(instances=1, backup=STORE, recovery={"onQuorumLoss": "RestoreFromBackup"})
    )
    view = replace(
        with_members(view, down(view.members[0])),
        backups=(BackupView("b", phase="Completed", completed_at=NOW),),
    )
    for seconds in (0, 16, 60, 300):
        decision = decide(spec, later(view, seconds), status)
        status = decision.status
        assert not [a for a in decision.actions if isinstance(a, A.StartRestore | A.Fence)]


# ---- 4. fencing needs evidence -------------------------------------------------------------------


def _failover_at_fence(instances: int = 3) -> tuple[PostgresClusterSpec, ClusterView, EngineStatus]:
    spec, view, status = settled(make_spec(instances=instances), lsns={1: 900, 2: 950})
    dead = with_members(view, down(view.members[0]), *[lost_primary(m) for m in view.members[1:]])
    status = decide(spec, dead, status).status
    decision = decide(spec, later(dead, 6), status)
    assert [type(a) for a in decision.actions] == [A.Fence]
    return spec, later(dead, 6), decision.status


def test_a_fence_that_has_not_landed_never_lets_a_replica_be_promoted() -> None:
    spec, view, status = _failover_at_fence()
    asked = with_members(view, replace(view.members[0], fenced=True))  # asked, not confirmed stopped
    for seconds in (1, 10, 100, 1000):
        decision = decide(spec, later(asked, seconds), status)
        status = decision.status
        assert not _promotions(decision)
        assert [a.member for a in decision.actions if isinstance(a, A.Fence)] == ["pg-0"]


def test_promotion_follows_evidence_that_the_old_primary_cannot_write() -> None:
    spec, view, status = _failover_at_fence()
    for evidence in (
        {"fenced": True, "stopped": True},  # the platform confirms PostgreSQL stopped
        {"exists": False},  # the pod or process is gone
    ):
        old = replace(view.members[0], **evidence)  # type: ignore[arg-type]
        decision = decide(spec, with_members(view, old), status)
        assert _promotions(decision) == ["pg-2"], evidence
    read_only = replace(
        view.members[0], fenced=True, reachable=True, role=Role.REPLICA, timeline=1, held_lsn=1000
    )
    decision = decide(spec, with_members(view, read_only), status)
    assert _promotions(decision) == ["pg-0"], "the old primary, read-only with the most WAL, wins"


def test_recovery_fences_until_every_member_is_confirmed_unable_to_write() -> None:
    spec, view, status = settled(make_spec(backup=STORE))
    view = replace(
        view,
        backups=(BackupView("b", phase="Completed", completed_at=NOW),),
        restores=(RestoreView("r", backup="b"),),
    )
    decision = decide(spec, view, status)
    assert {a.member for a in decision.actions if isinstance(a, A.Fence)} == {"pg-0", "pg-1", "pg-2"}
    asked = with_members(view, *[replace(m, fenced=True) for m in view.members])
    decision = decide(spec, asked, decision.status)
    assert not [a for a in decision.actions if isinstance(a, A.StartRestore)]
    stopped = with_members(view, *[replace(down(m), fenced=True, stopped=True) for m in view.members])
    decision = decide(spec, stopped, decision.status)
    assert [a for a in decision.actions if isinstance(a, A.StartRestore)]


# ---- 5. a planned in-place restart of the primary is not a failure -------------------------------


def _replicas_updated(
    spec: PostgresClusterSpec, new: PostgresClusterSpec
) -> tuple[ClusterView, EngineStatus]:
    """A rollout to ``new`` whose replicas are done: only the primary pg-0 is left."""
    _, view, status = settled(spec)
    revision = spec_revision(new)
    updated = with_members(view, *[replace(m, revision=revision) for m in view.members[1:]])
    operation = Operation(
        OperationKind.ROLLOUT,
        started_at=NOW,
        source="pg-0",
        revision=revision,
        plan=("pg-1", "pg-2", "pg-0"),
        done=("pg-1", "pg-2"),
    )
    return updated, replace(status, operation=operation)


def _restart_primary_step() -> tuple[PostgresClusterSpec, ClusterView, EngineStatus]:
    spec = make_spec(upgrade={"primaryUpdateMethod": "restart"})
    new = make_spec(upgrade={"primaryUpdateMethod": "restart"}, image="img:2")
    updated, status = _replicas_updated(spec, new)
    revision = spec_revision(new)
    decision = decide(new, updated, status)
    restart = [a for a in decision.actions if isinstance(a, A.RestartMember)]
    assert restart == [A.RestartMember("pg-0", revision, primary=True, reason=restart[0].reason)]
    return new, updated, decision.status


def test_a_planned_primary_restart_never_turns_into_a_failover() -> None:
    spec, view, status = _restart_primary_step()
    restarting = with_members(view, down(view.members[0]), *[lost_primary(m) for m in view.members[1:]])
    for seconds in (1, 5, 10, 30, 60, 110):
        decision = decide(spec, later(restarting, seconds), status)
        status = decision.status
        assert decision.phase is Phase.UPGRADING, decision.message
        assert not [a for a in decision.actions if isinstance(a, A.Fence | A.Promote | A.StartRestore)]
    back = with_members(later(view, 115), replace(view.members[0], revision=spec_revision(spec)))
    decision = decide(spec, back, status)
    assert decision.status.operation is None and decision.phase is Phase.RUNNING


def test_a_primary_restart_past_its_bound_aborts_then_the_failure_is_confirmed_as_usual() -> None:
    spec, view, status = _restart_primary_step()
    restarting = with_members(view, down(view.members[0]), *[lost_primary(m) for m in view.members[1:]])
    seconds = PRIMARY_RESTART_TIMEOUT.total_seconds() + 1
    decision = decide(spec, later(restarting, seconds), status)
    assert decision.status.aborted is not None and not decision.actions
    # From the abort on, an ordinary failure: detection first, then fence.
    confirm = decide(spec, later(restarting, seconds + 1), decision.status)
    assert not [a for a in confirm.actions if isinstance(a, A.Fence)]
    fence = decide(spec, later(restarting, seconds + 7), confirm.status)
    assert [type(a) for a in fence.actions] == [A.Fence]


# ---- a crashed primary back read-only is promoted again in place ---------------------------------


def test_the_recorded_primary_back_read_only_is_promoted_in_place_at_once() -> None:
    spec, view, status = settled()
    back = replace(view.members[0], role=Role.REPLICA, upstream=None, wal_receiver_streaming=False)
    decision = decide(spec, with_members(view, back, *[lost_primary(m) for m in view.members[1:]]), status)
    assert [type(a) for a in decision.actions] == [A.SetSynchronousStandbys, A.Promote]
    assert _promotions(decision) == ["pg-0"]


def test_once_a_failover_began_the_old_primary_back_read_only_is_only_a_candidate() -> None:
    spec, view, status = _failover_at_fence()
    back = replace(
        view.members[0], reachable=True, role=Role.REPLICA, timeline=1, received_lsn=1000, held_lsn=1000
    )
    decision = decide(spec, with_members(view, back), status)
    # The failover goes on (read-only is evidence it cannot write) and ranks pg-0 with the others:
    # it holds the most WAL. One promotion, through the failover's own steps.
    assert decision.status.operation is not None
    assert decision.status.operation.kind is OperationKind.FAILOVER
    assert _promotions(decision) == ["pg-0"]


# ---- 6. a switchover never trusts the final LSN of an unclean stop -------------------------------


def test_switchover_after_an_unclean_stop_is_abandoned_without_promoting() -> None:
    spec, view, status = settled()
    d1 = decide(spec, replace(view, switchover_to="pg-1"), status)
    killed = replace(
        view.members[0],
        fenced=True,
        stopped=True,
        shutdown_clean=False,
        reachable=False,
        role=Role.UNKNOWN,
        received_lsn=900,  # a checkpoint location, not the end of WAL
    )
    d2 = decide(spec, with_members(view, killed), d1.status)
    assert not _promotions(d2)
    assert [type(a) for a in d2.actions] == [A.Unfence, A.SetPrimary]


def test_switchover_waits_for_the_fence_to_land_then_gives_up() -> None:
    spec, view, status = settled()
    d1 = decide(spec, replace(view, switchover_to="pg-1"), status)
    asked = with_members(view, replace(view.members[0], fenced=True, reachable=False, role=Role.UNKNOWN))
    d2 = decide(spec, later(asked, 5), d1.status)
    assert isinstance(d2.actions[-1], A.Fence) and not _promotions(d2)
    d3 = decide(spec, later(asked, 40), d2.status)
    assert [type(a) for a in d3.actions] == [A.Unfence, A.SetPrimary]


# ---- 7. rank by the WAL a member provably holds ---------------------------------------------------


def test_a_restarted_replica_that_under_reports_its_received_lsn_still_wins() -> None:
    spec, view, status = settled(lsns={1: 1500, 2: 1200})
    dead = with_members(
        view,
        down(view.members[0]),
        replace(lost_primary(view.members[1]), received_lsn=1024, replayed_lsn=1400, held_lsn=1500),
        lost_primary(view.members[2]),
    )
    first = decide(spec, dead, status)
    fence = decide(spec, later(dead, 6), first.status)
    fenced = with_members(later(dead, 6), replace(dead.members[0], fenced=True, stopped=True))
    assert _promotions(decide(spec, fenced, fence.status)) == ["pg-1"]


def test_a_replica_whose_wal_position_is_unknown_is_never_counted() -> None:
    spec, view, status = settled(lsns={1: 1500, 2: 1200})
    unsure = replace(lost_primary(view.members[1]), held_lsn=None)
    dead = with_members(view, down(view.members[0]), unsure, lost_primary(view.members[2]))
    first = decide(spec, dead, status)
    fence = decide(spec, later(dead, 6), first.status)
    fenced = with_members(later(dead, 6), replace(dead.members[0], fenced=True, stopped=True))
    decision = decide(spec, fenced, fence.status)
    assert not _promotions(decision), "pg-2 alone is no majority, and pg-1's position is unproven"


def test_a_replica_whose_wal_end_is_unknown_still_ranks_by_the_wal_it_provably_received() -> None:
    """Found by the model: pg-4 restarted just before the primary died; its WAL end is not known yet,
    but it provably received WAL to 1500 while the others hold 1000. Its unknown end keeps it out of
    the majority count (pg-1..pg-3 are a majority of five), never out of the ranking: promoting pg-1
    would drop WAL a reachable member provably holds."""
    spec, view, status = settled(make_spec(instances=5))
    unsure = replace(lost_primary(view.members[4]), received_lsn=1500, replayed_lsn=1500, held_lsn=None)
    dead = with_members(view, down(view.members[0]), *[lost_primary(m) for m in view.members[1:4]], unsure)
    first = decide(spec, dead, status)
    fence = decide(spec, later(dead, 6), first.status)
    fenced = with_members(later(dead, 6), replace(dead.members[0], fenced=True, stopped=True))
    assert _promotions(decide(spec, fenced, fence.status)) == ["pg-4"]


# ---- 8. a vanished promotion target goes through failure confirmation ----------------------------


def test_a_vanished_promotion_target_is_confirmed_failed_before_another_failover() -> None:
    spec, view, status = _failover_at_fence()
    fenced = with_members(view, replace(view.members[0], fenced=True, stopped=True))
    promote = decide(spec, fenced, status)
    assert _promotions(promote) == ["pg-2"]
    vanished = with_members(fenced, down(fenced.members[2]))
    decision = decide(spec, later(vanished, 6), promote.status)
    assert decision.status.current_primary == "pg-2"
    assert not [a for a in decision.actions if isinstance(a, A.Fence | A.Promote)], (
        "a new failover began without detection and replica votes"
    )


def test_a_failover_that_loses_its_majority_after_choosing_its_target_reports_quorum_lost() -> None:
    """Found by the model: pg-2 was chosen (and Promote issued) while a majority was reachable; then
    pg-0's and pg-1's volumes were lost before it was promoted. The failover may not promote pg-2
    alone, and must not wait as FailingOver forever: the quorum is lost, reported as such, and the
    configured recovery from backup applies once a majority's data is known to be gone."""
    spec = make_spec(backup=STORE, recovery={"onQuorumLoss": "RestoreFromBackup"})
    spec, view, status = settled(spec, lsns={1: 900, 2: 950})
    dead = with_members(view, down(view.members[0]), *[lost_primary(m) for m in view.members[1:]])
    status = decide(spec, dead, status).status
    fence = decide(spec, later(dead, 6), status)
    fenced = with_members(later(dead, 6), replace(dead.members[0], fenced=True, stopped=True))
    promote = decide(spec, fenced, fence.status)
    assert _promotions(promote) == ["pg-2"]
    gone = [replace(down(m), exists=False, data_present=False) for m in view.members[:2]]
    lost = replace(
        with_members(fenced, *gone), backups=(BackupView("b", phase="Completed", completed_at=NOW),)
    )
    status, phases = promote.status, []
    for seconds in (1, 10, 30, 31):
        decision = decide(spec, later(lost, seconds), status)
        status = decision.status
        phases.append(decision.phase)
        assert not _promotions(decision), "pg-2 alone is no majority"
    assert phases[:2] == [Phase.QUORUM_LOST, Phase.QUORUM_LOST], phases
    assert phases[-1] is Phase.RECOVERING, phases


# ---- 9. an aborted rollout resumes the primary its switchover stopped ----------------------------


def test_an_aborted_rollout_switchover_unfences_the_old_primary() -> None:
    new = make_spec(image="img:2")
    updated, status = _replicas_updated(make_spec(), new)
    d1 = decide(new, updated, status)
    assert isinstance(d1.actions[-1], A.Fence) and not _promotions(d1)
    killed = replace(
        updated.members[0],
        fenced=True,
        stopped=True,
        shutdown_clean=False,
        reachable=False,
        role=Role.UNKNOWN,
    )
    d2 = decide(new, with_members(updated, killed), d1.status)
    assert d2.status.aborted is not None
    assert [type(a) for a in d2.actions] == [A.Unfence, A.SetPrimary]


# ---- 10. kept-aside data is never deleted by a scale-down ----------------------------------------


def test_scale_down_keeps_the_volume_of_a_member_holding_kept_aside_data() -> None:
    _, view, status = settled(make_spec(instances=3))
    view = with_members(view, replace(view.members[2], kept_aside=1))
    _, _, decisions = _run(make_spec(instances=2, replication={"mode": "async"}), view, status, 10)
    deletes = [a for d in decisions for a in d.actions if isinstance(a, A.DeleteMember)]
    assert deletes and all(a.keep_data for a in deletes)


# ---- 12. the smaller ones ------------------------------------------------------------------------


def test_a_flapping_vote_does_not_confirm_a_failure() -> None:
    spec, view, status = settled()
    dead = with_members(view, down(view.members[0]), *[lost_primary(m) for m in view.members[1:]])
    flapped = with_members(dead, view.members[2])  # pg-2 streams again for one observation
    s = decide(spec, dead, status).status
    s = decide(spec, later(flapped, 3), s).status
    decision = decide(spec, later(dead, 6), s)
    assert not [a for a in decision.actions if isinstance(a, A.Fence)], "pg-2's vote is 3 s old"
    decision = decide(spec, later(dead, 9), decision.status)
    assert not [a for a in decision.actions if isinstance(a, A.Fence)], "pg-2's vote is 3 s old"
    decision = decide(spec, later(dead, 11), decision.status)
    assert [type(a) for a in decision.actions] == [A.Fence]


def test_two_async_members_fail_over_once_the_old_primary_is_confirmed_gone() -> None:
    spec, view, status = settled(make_spec(instances=2))
    dead = with_members(view, down(view.members[0]), lost_primary(view.members[1]))
    s = decide(spec, dead, status).status
    unreachable_only = decide(spec, later(dead, 10), s)
    assert not _promotions(unreachable_only), "unreachable is not gone: no promotion"
    gone = with_members(dead, replace(dead.members[0], exists=False))
    s = unreachable_only.status
    for seconds in (11, 12):
        decision = decide(spec, later(gone, seconds), s)
        s = decision.status
    assert _promotions(decision) == ["pg-1"]


def test_failover_keeps_commits_is_false_without_any_known_configuration() -> None:
    assert not failover_keeps_commits(["pg-1", "pg-2"], "pg-0", [])
    config = SyncConfig(1, frozenset({"pg-1", "pg-2"}))
    assert failover_keeps_commits(["pg-1", "pg-2"], "pg-0", [config])
    assert not failover_keeps_commits(["pg-1"], "pg-0", [config])


def test_a_stray_primary_on_a_newer_timeline_is_recloned_not_rewound() -> None:
    spec, view, status = settled()
    stray = replace(
        view.members[2], role=Role.PRIMARY, timeline=2, upstream=None, wal_receiver_streaming=False
    )
    decision = decide(spec, with_members(view, stray), status)
    rejoins = [a for a in decision.actions if isinstance(a, A.Rejoin)]
    assert rejoins and rejoins[0].member == "pg-2" and rejoins[0].reclone


def test_scaling_below_three_says_commits_are_no_longer_quorum() -> None:
    spec, view, status = settled(make_spec(instances=3))
    quorum = decide(spec, view, status).condition(ConditionType.QUORUM_COMMIT)
    assert quorum is not None and quorum.status is True
    below = decide(make_spec(instances=1), view, status).condition(ConditionType.QUORUM_COMMIT)
    assert below is not None and below.status is False and below.reason == "AsyncBelowThreeInstances"


# ---- found by the stronger model: an operator crash between recording a primary and SetPrimary ----


def test_the_rw_endpoint_is_repointed_when_it_does_not_select_the_primary() -> None:
    spec, view, status = settled()
    stale = replace(view, rw_member="pg-2")  # the label stayed where an earlier pass left it
    decision = decide(spec, stale, status)
    assert A.SetPrimary("pg-0", reason=decision.actions[0].reason) in decision.actions
    nowhere = replace(view, rw_member=None)
    assert any(isinstance(a, A.SetPrimary) for a in decide(spec, nowhere, status).actions)
    assert decide(spec, view, status).actions == ()


def test_a_promotion_never_observed_is_resumed_when_its_target_returns_read_only() -> None:
    """Found by the model: Promote(pg-1) was applied, pg-1 crashed before anyone saw it primary, and
    came back read-only on the timeline of its own promotion. It is the recorded primary now (the
    vanished-target rule); nothing else was promoted: promote it again rather than wait forever."""
    spec, view, status = _failover_at_fence()
    fenced = with_members(view, replace(view.members[0], fenced=True, stopped=True))
    promote = decide(spec, fenced, status)
    vanished = with_members(fenced, down(fenced.members[2]))
    recorded = decide(spec, later(vanished, 6), promote.status)
    assert recorded.status.current_primary == "pg-2"
    back = replace(fenced.members[2], timeline=2, upstream=None, wal_receiver_streaming=False)
    decision = decide(spec, with_members(later(vanished, 7), back), recorded.status)
    assert _promotions(decision) == ["pg-2"]


def test_a_restore_whose_restored_data_is_lost_fails_instead_of_waiting_forever() -> None:
    spec, view, status = settled(make_spec(instances=1, backup=STORE))
    operation = Operation(
        OperationKind.RESTORE, started_at=NOW, target="pg-0", restore="r", backup="b", plan=("pg-0",)
    ).at("promote", NOW)
    view = replace(view, restores=(RestoreView("r", backup="b", phase="Restoring"),))
    lost = with_members(view, replace(down(view.members[0]), data_present=False, stopped=True))
    decision = decide(spec, lost, replace(status, operation=operation))
    assert decision.phase is Phase.FAILED and decision.status.aborted is not None
    assert [a.phase for a in decision.actions if isinstance(a, A.UpdateRestore)] == ["Failed"]


def test_a_member_being_removed_is_never_recloned_then_deleted_with_its_kept_data() -> None:
    """Found by the model: after a restore of a cluster scaled down meanwhile, one decision re-cloned
    pg-1 (its data kept aside on its volume) and deleted that volume."""
    spec, view, status = settled(make_spec(instances=1, backup=STORE))
    extra = replace(view.members[0], name="pg-1", ordinal=1, role=Role.REPLICA, upstream="pg-0", fenced=True)
    view = with_members(view, extra)
    operation = Operation(
        OperationKind.RESTORE, started_at=NOW, target="pg-0", restore="r", backup="b", plan=("pg-0", "pg-1")
    ).at("rebuild", NOW)
    decision = decide(spec, view, replace(status, operation=operation))
    recloned = {a.member for a in decision.actions if isinstance(a, A.Rejoin) and a.reclone}
    deleted = {a.member for a in decision.actions if isinstance(a, A.DeleteMember) and not a.keep_data}
    assert not recloned & deleted
    assert "pg-1" not in recloned


def test_a_spec_change_mid_restart_never_restarts_a_second_member() -> None:
    """Found by the model (a stale view): the image changed again while pg-1 restarted; a view that
    did not show pg-1 down yet let the new plan restart another member beside it. The new plan
    restarts the member in flight first (perhaps its restart was never applied: an operator crash)."""
    _, view, status = settled(lsns={1: 1000, 2: 900})
    first = make_spec(image="img:2")
    d1 = decide(first, view, status)
    restarted = [a.member for a in d1.actions if isinstance(a, A.RestartMember)]
    assert restarted == ["pg-2"]  # the most lagging first
    second = make_spec(image="img:3")
    # The view still shows every member up, and pg-1 is now the most lagging.
    stale = with_members(
        later(view, 1),
        replace(view.members[1], received_lsn=800, held_lsn=800),
        replace(view.members[2], received_lsn=1000, held_lsn=1000),
    )
    d2 = decide(second, stale, d1.status)
    again = [a.member for a in d2.actions if isinstance(a, A.RestartMember)]
    assert again in ([], restarted), f"{again} restarted while {restarted} restarts"


# ---- issue #11: what the agent reports ------------------------------------------------------------


def test_a_terminating_primary_is_switched_over_before_it_stops() -> None:
    spec, view, status = settled()
    draining = with_members(view, replace(view.members[0], terminating=True))
    decision = decide(spec, draining, status)
    assert decision.phase is Phase.SWITCHING_OVER and "terminating" in decision.status.operation.reason  # type: ignore[union-attr]
    # Its target carries its sync standbys already (upkeep): the other replica follows it, the primary is fenced.
    assert [type(a) for a in decision.actions] == [A.Rejoin, A.Fence]


def test_a_terminating_primary_in_its_planned_restart_is_not_switched_over() -> None:
    spec, view, status = _restart_primary_step()
    terminating = with_members(view, replace(view.members[0], terminating=True))
    decision = decide(spec, terminating, status)
    assert decision.status.operation is not None and decision.status.operation.kind is OperationKind.ROLLOUT
    assert not [a for a in decision.actions if isinstance(a, A.Fence | A.Promote)]


def test_a_planned_primary_restart_whose_data_is_lost_aborts_at_once() -> None:
    spec, view, status = _restart_primary_step()
    lost = with_members(view, replace(down(view.members[0]), data_present=False, stopped=True))
    decision = decide(spec, later(lost, 5), status)
    assert decision.status.aborted is not None and "data is lost" in str(decision.status.aborted.failed)
