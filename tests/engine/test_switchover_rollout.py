"""Switchover and the ordered rolling update."""

from __future__ import annotations

from dataclasses import replace

from pgherd.api.cluster import Phase
from pgherd.engine import Role, decide
from pgherd.engine import actions as A
from pgherd.engine.revision import spec_revision

from .builders import later, make_spec, settled, with_members


def test_requested_switchover_drains_then_promotes_caught_up_target() -> None:
    spec, view, status = settled()
    # pg-1 without the sync standbys upkeep sets on a voting replica ahead of any promotion.
    view = replace(with_members(view, replace(view.members[1], sync=None)), switchover_to="pg-1")
    d1 = decide(spec, view, status)
    assert d1.phase is Phase.SWITCHING_OVER
    # While pg-0 drains, pg-1 gets its sync standbys and pg-2 follows it (a cascading standby): the
    # promotion is then one call, and its first quorum commit does not wait for pg-2 to reconnect.
    assert [type(a) for a in d1.actions] == [A.SetSynchronousStandbys, A.Rejoin, A.Fence]
    sync = d1.actions[0]
    assert isinstance(sync, A.SetSynchronousStandbys) and sync.member == "pg-1"
    assert sync.config.standbys == {"pg-0", "pg-2"} and sync.config.k == 1
    assert d1.actions[1] == A.Rejoin(
        "pg-2", "pg-1", reason="follow pg-1, being promoted", ahead_of_promotion=True
    )
    assert d1.actions[2] == A.Fence("pg-0", reason="switchover")
    assert d1.status.operation is not None and d1.status.operation.target == "pg-1"
    # Clean stop: the adapter reports the final WAL end; pg-1 has it all.
    old = replace(
        view.members[0],
        fenced=True,
        stopped=True,
        shutdown_clean=True,
        reachable=False,
        role=Role.UNKNOWN,
        received_lsn=1000,
    )
    d2 = decide(spec, with_members(view, old), d1.status)
    assert [type(a) for a in d2.actions] == [A.SetSynchronousStandbys, A.Rejoin, A.Promote]
    assert d2.actions[2].member == "pg-1"  # type: ignore[union-attr]
    assert d2.actions[1] == A.Rejoin(
        "pg-2", "pg-1", reason="follow pg-1, being promoted", ahead_of_promotion=True
    )
    # Both seen done while it drained: the promotion alone.
    prepared = with_members(
        view, old, replace(view.members[1], sync=sync.config), replace(view.members[2], upstream="pg-1")
    )
    d3 = decide(spec, prepared, d1.status)
    assert d3.actions == (A.Promote("pg-1", reason=d3.actions[0].reason),)  # type: ignore[union-attr]


def test_switchover_waits_for_exact_catch_up_and_abandons_without_promoting() -> None:
    spec, view, status = settled()
    view = replace(view, switchover_to="pg-1")
    d1 = decide(spec, view, status)
    old = replace(
        view.members[0],
        fenced=True,
        stopped=True,
        shutdown_clean=True,
        reachable=False,
        role=Role.UNKNOWN,
        received_lsn=1200,
    )
    lagging = replace(view.members[1], wal_receiver_streaming=False)
    d2 = decide(spec, with_members(view, old, lagging), d1.status)
    assert d2.actions == () and "catch up" in d2.message
    d3 = decide(spec, with_members(later(view, 60), old, lagging), d2.status)
    assert [type(a) for a in d3.actions] == [A.Unfence, A.SetPrimary]
    assert d3.status.current_primary == "pg-0" and d3.status.operation is None


def test_target_that_does_not_stream_is_refused() -> None:
    """A member that just rejoined and is not streaming yet is never a switchover target."""
    spec, view, status = settled()
    rejoined = replace(view.members[1], wal_receiver_streaming=False, ready=False)
    decision = decide(spec, replace(with_members(view, rejoined), switchover_to="pg-1"), status)
    assert not [a for a in decision.actions if isinstance(a, A.Fence)]


def test_a_member_carrying_out_an_action_is_no_target_until_it_is_done() -> None:
    """A rollout restarted pg-2, and its receiver, still connecting, drew a Rejoin: the switchover that
    came next fenced the primary and asked pg-2, busy with that rejoin, to promote. Its agent took no
    order until the rejoin ended (its upstream fenced, 10 s later, in failure): the writes waited
    11 s, then a failover and a second switchover followed (CI, 2026-12-06)."""
    spec, view, status = settled()
    busy = replace(view.members[1], busy=True)
    requested = decide(spec, replace(with_members(view, busy), switchover_to="pg-1"), status)
    assert not [a for a in requested.actions if isinstance(a, (A.Fence, A.Promote))]
    assert "carrying out" in requested.message
    done = decide(spec, replace(view, switchover_to="pg-1"), status)
    assert [a for a in done.actions if isinstance(a, A.Fence)]

    spec = make_spec(image="img:2")
    revision = spec_revision(spec)
    updated = [replace(m, revision=revision) if m.name != "pg-0" else m for m in view.members]
    rolling = with_members(view, *updated)
    d = decide(spec, view, status)
    for _ in range(3):
        d = decide(
            spec,
            with_members(later(rolling, 1), replace(updated[1], busy=True), replace(updated[2], busy=True)),
            d.status,
        )
        assert not [a for a in d.actions if isinstance(a, (A.Fence, A.Promote))], d.actions
    assert d.phase is Phase.UPGRADING and "carrying out" in d.message
    d = decide(spec, with_members(later(rolling, 2), replace(updated[2], busy=True)), d.status)
    fence = [a for a in d.actions if isinstance(a, A.Fence)]
    assert fence and d.status.operation is not None and d.status.operation.target == "pg-1"


def test_rollout_records_plan_then_restarts_most_lagging_replica_first() -> None:
    _, view, status = settled(lsns={1: 990, 2: 900})
    spec = make_spec(image="img:2")
    decision = decide(spec, view, status)
    assert decision.phase is Phase.UPGRADING
    operation = decision.status.operation
    assert operation is not None and operation.plan == ("pg-2", "pg-1", "pg-0")
    assert decision.actions == (A.RestartMember("pg-2", spec_revision(spec), reason=operation.reason),)


def test_rollout_waits_for_each_member_then_switches_over_and_restarts_old_primary_last() -> None:
    _, view, status = settled()
    spec = make_spec(image="img:2")
    revision = spec_revision(spec)
    d = decide(spec, view, status)
    restarted: list[str] = []
    for _ in range(12):
        acts = [a for a in d.actions if isinstance(a, A.RestartMember)]
        restarted += [a.member for a in acts]
        members = []
        for m in view.members:
            if m.name in restarted:
                m = replace(m, revision=revision)
            members.append(m)
        if any(isinstance(a, A.Fence) for a in d.actions):
            break
        view = with_members(later(view, 1), *members)
        d = decide(spec, view, d.status)
    assert restarted == ["pg-1", "pg-2"]
    assert d.phase is Phase.SWITCHING_OVER
    assert not [a for a in d.actions if isinstance(a, A.RestartMember) and a.member == "pg-0"]


def test_rollout_waits_for_a_down_member_then_aborts_and_reports() -> None:
    _, view, status = settled()
    spec = make_spec(image="img:2")
    started = decide(spec, view, status)  # restarts pg-1 first
    revision = spec_revision(spec)
    back = replace(view.members[1], revision=revision)
    gone = replace(view.members[2], ready=False, wal_receiver_streaming=False)
    view = with_members(view, back)
    d1 = decide(spec, view, started.status)  # pg-1 done; next would be pg-2... which now fails
    assert d1.status.operation is not None
    d2 = decide(spec, with_members(later(view, 1), gone), d1.status)
    assert not [a for a in d2.actions if isinstance(a, A.RestartMember) and a.member != "pg-2"]
    d3 = decide(spec, with_members(later(view, 700), gone), d2.status)
    d4 = decide(spec, with_members(later(view, 1400), gone), d3.status)
    assert d4.phase is Phase.FAILED
    assert d4.status.aborted is not None and d4.status.aborted.failed
    # The primary is never restarted as a fallback.
    assert not [a for d in (d1, d2, d3, d4) for a in d.actions if getattr(a, "member", "") == "pg-0"]


def test_restart_method_restarts_primary_in_place_last() -> None:
    _, view, status = settled()
    spec = make_spec(image="img:2", upgrade={"primaryUpdateMethod": "restart"})
    revision = spec_revision(spec)
    updated = [replace(m, revision=revision) for m in view.members[1:]]
    d = decide(spec, with_members(view, *updated), status)
    assert [(type(a), getattr(a, "member", None)) for a in d.actions] == [(A.RestartMember, "pg-0")]


def test_a_request_for_any_member_takes_the_streaming_replica_with_the_most_wal() -> None:
    from pgherd.engine.lsn import parse_lsn
    from pgherd.engine.switchover import ANY_TARGET_WAIT, any_target, refuse_any

    # by the LSN's value, not its text: "1/100" is past "0/FFFFFF00", though shorter
    assert any_target({"m-1": parse_lsn("0/FFFFFF00"), "m-2": parse_lsn("1/100")}) == "m-2"
    assert any_target({"m-1": 7, "m-2": 7}) == "m-2"
    assert any_target({}) is None
    # none streams right after a switchover: the request waits, and is refused only after the wait
    assert not refuse_any(0.0) and not refuse_any(ANY_TARGET_WAIT - 0.1) and refuse_any(ANY_TARGET_WAIT)


def test_a_replicas_sync_standbys_set_ahead_come_after_the_switchovers_own_actions() -> None:
    """A refused set-sync stops the rest of a pass: upkeep's, on a replica, never holds back a step."""
    spec, view, status = settled()
    bare = with_members(view, replace(view.members[2], sync=None))
    d = decide(spec, replace(bare, switchover_to="pg-1"), status)
    kinds = [(type(a).__name__, getattr(a, "member", None)) for a in d.actions]
    assert kinds == [("Rejoin", "pg-2"), ("Fence", "pg-0"), ("SetSynchronousStandbys", "pg-2")]
