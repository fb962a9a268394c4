"""Quorum-confirmed failure detection and failover."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any
from unittest.mock import ANY

from pgherd.api.cluster import Phase, PostgresClusterSpec
from pgherd.engine import ClusterView, EngineStatus, Role, decide
from pgherd.engine import actions as A
from pgherd.engine.conditions import ConditionType
from pgherd.engine.quorum import SyncConfig, steady_config
from pgherd.engine.view import MemberView

from .builders import down, later, lost_primary, make_spec, settled, with_members


def _primary_dies(
    lsns: dict[int, int] | None = None, instances: int = 3
) -> tuple[PostgresClusterSpec, ClusterView, EngineStatus]:
    spec, view, status = settled(make_spec(instances=instances), lsns=lsns)
    members = [down(view.members[0])] + [lost_primary(m) for m in view.members[1:]]
    return spec, with_members(view, *members), status


def test_healthy_cluster_is_running_with_no_action() -> None:
    spec, view, status = settled()
    decision = decide(spec, view, status)
    assert decision.phase is Phase.RUNNING
    assert decision.actions == ()
    ready = decision.condition(ConditionType.READY)
    assert ready is not None and ready.status is True


def test_each_voting_replica_is_given_the_sync_standbys_it_would_need_as_the_primary() -> None:
    """Set ahead, outside any write outage: a failover's promotion is then one agent call."""
    spec, view, status = settled()
    bare = with_members(view, replace(view.members[1], sync=None), replace(view.members[2], sync=None))
    decision = decide(spec, bare, status)
    assert decision.phase is Phase.RUNNING
    assert decision.actions == (
        A.SetSynchronousStandbys("pg-1", steady_config(status.voters, "pg-1", quorum=True), reason=ANY),
        A.SetSynchronousStandbys("pg-2", steady_config(status.voters, "pg-2", quorum=True), reason=ANY),
    )
    assert decision.status == status  # nothing about the primary's quorum changes
    # Not while the primary's own sync standbys change (the voters may be about to).
    pending = replace(status, sync_pending=SyncConfig(2, frozenset({"pg-1", "pg-2"})))
    assert not [
        a
        for a in decide(spec, bare, pending).actions
        if isinstance(a, A.SetSynchronousStandbys) and a.member != "pg-0"
    ]
    # Asynchronous replication: nothing to prepare.
    async_spec, async_view, async_status = settled(make_spec(replication={"mode": "async"}))
    plain = with_members(async_view, *(replace(m, sync=None) for m in async_view.members[1:]))
    assert decide(async_spec, plain, async_status).actions == ()


def test_failure_is_confirmed_for_detection_seconds_first() -> None:
    spec, view, status = _primary_dies()
    first = decide(spec, view, status)
    assert first.phase is Phase.DEGRADED and first.actions == ()
    assert "confirming" in first.message
    assert first.status.primary_lost_since == view.now
    again = decide(spec, later(view, 3), first.status)
    assert again.actions == ()


def test_detection_counts_from_when_the_replicas_lost_the_primary() -> None:
    """The operator first sees the failure a poll after it happened; the replicas' WAL receivers date it
    (their upstream's last word). Detection (5 s) counts from there, once a majority of them say so."""
    spec, view, status = _primary_dies()

    def silent_for(view: ClusterView, seconds: float) -> ClusterView:
        members = [view.members[0]] + [replace(m, upstream_silence=seconds) for m in view.members[1:]]
        return with_members(view, *members)

    first = decide(spec, silent_for(view, 2.0), status)  # lost 2 s before the operator looked
    assert first.actions == () and first.status.primary_lost_since == view.now - timedelta(seconds=2)
    early = decide(spec, silent_for(later(view, 2.5), 4.5), first.status)
    assert early.actions == ()  # 4.5 s: not yet
    decision = decide(spec, silent_for(later(view, 3.1), 5.1), early.status)
    assert decision.phase is Phase.FAILING_OVER
    assert decision.actions == (A.Fence("pg-0", reason=decision.actions[0].reason),)


def test_one_replica_dating_the_loss_early_does_not_shorten_detection() -> None:
    """Only the time by which a majority (here both replicas) lost the primary counts."""
    spec, view, status = _primary_dies()
    one_early = [view.members[0], replace(view.members[1], upstream_silence=4.0), view.members[2]]
    first = decide(spec, with_members(view, *one_early), status)
    assert first.status.primary_lost_since == view.now
    again = decide(spec, with_members(later(view, 1.5), *one_early), first.status)
    assert again.actions == ()


def test_failover_fences_then_promotes_the_member_with_most_wal() -> None:
    spec, view, status = _primary_dies(lsns={1: 900, 2: 950})
    first = decide(spec, view, status)
    decision = decide(spec, later(view, 6), first.status)
    assert decision.phase is Phase.FAILING_OVER
    assert decision.actions == (A.Fence("pg-0", reason=decision.actions[0].reason),)
    assert decision.status.operation is not None and decision.status.operation.step == "fence"
    fenced = with_members(later(view, 6), replace(view.members[0], fenced=True, stopped=True))
    promote = decide(spec, fenced, decision.status)
    # The target carries the sync standbys it needs as the primary already (upkeep set them): the
    # promotion is one agent call.
    kinds = [type(a) for a in promote.actions]
    assert kinds == [A.Rejoin, A.Promote]
    assert promote.actions[1].member == "pg-2"  # type: ignore[union-attr]
    # The other replica follows the member being promoted before the promotion (it holds less WAL: no
    # rewind), as a cascading standby that follows the timeline switch.
    early = promote.actions[0]
    assert isinstance(early, A.Rejoin) and (early.member, early.upstream) == ("pg-1", "pg-2")
    assert early.ahead_of_promotion  # its agent skips the archive inside the timeline switch
    # A target without them (never set, or set for other voters) gets them first.
    unset = with_members(fenced, replace(fenced.members[2], sync=None))
    promote = decide(spec, unset, decision.status)
    assert [type(a) for a in promote.actions] == [A.SetSynchronousStandbys, A.Rejoin, A.Promote]
    sync = promote.actions[0]
    assert isinstance(sync, A.SetSynchronousStandbys) and sync.member == "pg-2"
    assert sync.config.standbys == {"pg-0", "pg-1"} and sync.config.k == 1


def _promoted_after_failover(lsns: dict[int, int], **pg1: Any) -> list[A.Promote]:
    """The Promote actions once pg-0 died and was fenced, with pg-1's view changed by ``pg1``."""
    spec, view, status = _primary_dies(lsns=lsns)
    view = with_members(view, replace(view.members[1], **pg1))
    first = decide(spec, view, status)
    fenced = with_members(later(view, 6), replace(view.members[0], fenced=True, stopped=True))
    decision = decide(spec, fenced, decide(spec, later(view, 6), first.status).status)
    return [a for a in decision.actions if isinstance(a, A.Promote)]


def test_ties_break_on_replayed_lsn_then_name() -> None:
    promotes = _promoted_after_failover({1: 950, 2: 950}, replayed_lsn=940)
    assert promotes == [A.Promote("pg-2", reason=promotes[0].reason)]


def test_ties_break_on_a_member_free_of_actions_before_the_name() -> None:
    """Equal WAL: the member whose agent carries out nothing is promoted at once; a busy one would take
    the Promote only after its action (a rejoin towards the lost primary waits 10 s for streaming)."""
    promotes = _promoted_after_failover({1: 950, 2: 950}, busy=True)
    assert promotes == [A.Promote("pg-2", reason=promotes[0].reason)]
    # More WAL still wins: a busy member holding commits the other lacks is waited for.
    promotes = _promoted_after_failover({1: 960, 2: 950}, busy=True)
    assert promotes == [A.Promote("pg-1", reason=promotes[0].reason)]


def test_operator_cut_off_from_primary_alone_never_fails_over() -> None:
    spec, view, status = settled()
    view = with_members(view, down(view.members[0]))  # replicas still stream from it
    first = decide(spec, view, status)
    decision = decide(spec, later(view, 60), first.status)
    assert decision.actions == ()
    assert decision.phase is Phase.DEGRADED
    assert "lost it" in decision.message


def test_no_failover_without_reachable_majority() -> None:
    spec, view, status = settled(make_spec(instances=5))
    members = [down(view.members[0]), down(view.members[1]), down(view.members[2])]
    members += [lost_primary(m) for m in view.members[3:]]
    view = with_members(view, *members)
    first = decide(spec, view, status)
    decision = decide(spec, later(view, 120), first.status)
    assert decision.phase is Phase.QUORUM_LOST
    assert not [a for a in decision.actions if isinstance(a, A.Promote | A.Fence)]
    quorum = decision.condition(ConditionType.QUORUM_HEALTHY)
    assert quorum is not None and quorum.status is False


def test_failover_disabled_only_reports() -> None:
    spec, view, status = _primary_dies()
    spec = spec.model_copy(update={"failover": spec.failover.model_copy(update={"enabled": False})})
    decision = decide(spec, later(view, 60), decide(spec, view, status).status)
    assert decision.actions == () and "disabled" in decision.message


def test_member_on_an_old_timeline_is_never_a_candidate() -> None:
    spec, view, status = _primary_dies(lsns={1: 900, 2: 5000})
    view = with_members(view, replace(view.members[2], timeline=0))
    first = decide(spec, view, status)
    fenced = with_members(later(view, 6), replace(view.members[0], fenced=True, stopped=True))
    decision = decide(spec, fenced, decide(spec, later(view, 6), first.status).status)
    # pg-2 counts for the majority, but its LSN belongs to another history: pg-1 is promoted.
    promotes = [a.member for a in decision.actions if isinstance(a, A.Promote)]
    assert promotes == ["pg-1"]


def test_finish_points_rw_endpoint_and_repoints_others() -> None:
    spec, view, status = _primary_dies(lsns={1: 900, 2: 950})
    s1 = decide(spec, view, status).status
    s2 = decide(spec, later(view, 6), s1).status
    fenced = with_members(later(view, 6), replace(view.members[0], fenced=True, stopped=True))
    s3 = decide(spec, fenced, s2).status
    promoted = with_members(fenced, replace(view.members[2], role=Role.PRIMARY, timeline=2, upstream=None))
    done = decide(spec, promoted, s3)
    assert done.status.current_primary == "pg-2" and done.status.timeline == 2
    assert done.status.operation is None
    names = [(type(a).__name__, getattr(a, "member", None)) for a in done.actions]
    assert ("SetPrimary", "pg-2") in names and ("Rejoin", "pg-0") in names and ("Rejoin", "pg-1") in names


def test_deciding_twice_gives_the_same_answer() -> None:
    spec, view, status = _primary_dies()
    assert decide(spec, later(view, 9), status) == decide(spec, later(view, 9), status)


def test_fenced_members_start_read_only_and_count_while_no_primary() -> None:
    """A failover fenced the old primary, then lost its majority: fenced members are started
    read-only (Demote) so that their WAL counts; the fenced old primary, with the most WAL, wins."""
    spec, view, status = _primary_dies(lsns={0: 1000, 1: 900, 2: 900})
    s1 = decide(spec, view, status).status
    s2 = decide(spec, later(view, 6), s1).status  # Fence pg-0
    fenced_old = replace(view.members[0], fenced=True, stopped=True)
    lost = with_members(later(view, 7), fenced_old, down(view.members[1]))
    d = decide(spec, lost, s2)
    assert d.phase is Phase.QUORUM_LOST
    assert A.Demote("pg-0", reason=d.actions[0].reason) in d.actions
    assert not [a for a in d.actions if isinstance(a, A.Promote)]
    standby = replace(
        fenced_old,
        reachable=True,
        role=Role.REPLICA,
        timeline=1,
        received_lsn=1000,
        replayed_lsn=1000,
        held_lsn=1000,
        stopped=False,
    )
    d2 = decide(spec, with_members(later(view, 8), standby, down(view.members[1])), d.status)
    assert [type(a) for a in d2.actions] == [A.SetSynchronousStandbys, A.Promote]
    assert d2.actions[1].member == "pg-0"  # type: ignore[union-attr]


def _silent(member: MemberView, seconds: float, heartbeat: float = 5.0) -> MemberView:
    """A replica whose receiver still says streaming from its primary, which has said nothing for
    `seconds` (a partition: no reset, only silence, until wal_receiver_timeout)."""
    return replace(member, upstream_silence=seconds, upstream_heartbeat=heartbeat)


def _isolated(view: ClusterView, seconds: float, heartbeat: float = 5.0) -> ClusterView:
    return with_members(
        view, down(view.members[0]), *(_silent(m, seconds, heartbeat) for m in view.members[1:])
    )


def test_a_silent_stream_votes_from_the_primarys_last_word_once_seen_twice() -> None:
    # The primary cut off from the operator and both replicas at t0: they still say streaming.
    spec, view, status = settled()  # detectionSeconds 5, heartbeat 5 s (wal_receiver_timeout 10 s)
    first = decide(spec, _isolated(later(view, 2), 2), status)
    assert first.phase is Phase.DEGRADED and first.status.votes_since == {}  # 2 s: a quiet primary's
    second = decide(spec, _isolated(later(view, 6.5), 6.5), first.status)
    assert second.actions == ()  # one sample of silence is not a vote yet
    assert set(second.status.votes_since) == {"pg-1", "pg-2"}
    third = decide(spec, _isolated(later(view, 7.5), 7.5), second.status)
    # Dated back to t0: the failure is confirmed now, not detectionSeconds after the second sample.
    assert third.status.votes_since == dict.fromkeys(("pg-1", "pg-2"), view.now)
    assert [type(a) for a in third.actions] == [A.Fence]


def test_a_silence_within_the_heartbeat_is_no_vote() -> None:
    spec, view, status = settled()
    first = decide(spec, _isolated(view, 5.5), status)
    decision = decide(spec, _isolated(later(view, 60), 5.9), first.status)
    assert decision.actions == () and decision.status.votes_since == {}
    assert "lost it" in decision.message


def test_a_silent_stream_that_speaks_again_loses_its_vote() -> None:
    spec, view, status = settled()
    first = decide(spec, _isolated(later(view, 7), 7), status)
    assert set(first.status.votes_since) == {"pg-1", "pg-2"}
    spoke = decide(spec, _isolated(later(view, 8), 0.2), first.status)
    assert spoke.status.votes_since == {} and spoke.actions == ()


def test_silence_with_no_heartbeat_known_is_no_vote() -> None:
    # wal_receiver_timeout 0 (or an agent from before silentSeconds): nothing says how long is too long.
    spec, view, status = settled()
    members = [down(view.members[0])] + [replace(m, upstream_silence=100.0) for m in view.members[1:]]
    first = decide(spec, with_members(view, *members), status)
    decision = decide(spec, with_members(later(view, 60), *members), first.status)
    assert decision.actions == () and decision.status.votes_since == {}


def test_a_receiver_that_gave_up_on_a_silent_primary_votes_from_its_last_word() -> None:
    # wal_receiver_timeout passed between two observations: no stream any more, only its agent's memory
    # of the primary's last word (7 s ago). Dated back, it counts at the next observation.
    spec, view, status = settled()
    gone = [replace(lost_primary(m), upstream_silence=7.0) for m in view.members[1:]]
    first = decide(spec, with_members(later(view, 7), down(view.members[0]), *gone), status)
    assert first.status.votes_since == dict.fromkeys(("pg-1", "pg-2"), view.now)
    assert first.actions == ()  # one sample is no vote, however old the silence it reports
    again = [replace(m, upstream_silence=12.0) for m in gone]
    second = decide(spec, with_members(later(view, 12), down(view.members[0]), *again), first.status)
    assert second.status.votes_since == dict.fromkeys(("pg-1", "pg-2"), view.now)
    assert [type(a) for a in second.actions] == [A.Fence]


def test_a_fenced_recorded_primary_with_no_operation_is_unfenced_again() -> None:
    # Its Unfence was lost (it crashed; its agent started it again fenced): sent again, at once.
    spec, view, status = settled()
    fenced = replace(down(view.members[0]), fenced=True, stopped=True, timeline=1)
    decision = decide(spec, with_members(view, fenced), status)
    assert [type(a) for a in decision.actions] == [A.Unfence, A.SetPrimary]
    assert decision.actions[0].member == "pg-0"  # type: ignore[union-attr]
    # Not while another member runs as a primary, nor with data on an older timeline.
    other = replace(view.members[1], role=Role.PRIMARY, upstream=None)
    assert not [
        a for a in decide(spec, with_members(view, fenced, other), status).actions if isinstance(a, A.Unfence)
    ]
    older = replace(fenced, timeline=0)
    assert not [
        a for a in decide(spec, with_members(view, older), status).actions if isinstance(a, A.Unfence)
    ]
