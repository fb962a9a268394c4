"""Decision.events (engine/narrate.py): every decision the engine acts on is told once, with its reason —
an operation's start, each step, its end (completed, failed, or stopped short), a new primary — and a
decision that changes nothing tells nothing."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from pgherd.engine import ClusterView, EngineStatus, Operation, OperationKind, Role, decide
from pgherd.engine import actions as A
from pgherd.engine.narrate import narrate
from pgherd.engine.plan import Decision
from pgherd.engine.revision import spec_revision

from .builders import NOW, down, later, lost_primary, make_spec, settled, with_members


def told(decision: Decision) -> list[tuple[str, str, bool]]:
    return [(e.reason, e.message, e.warning) for e in decision.events]


def reasons(decision: Decision) -> list[str]:
    return [e.reason for e in decision.events]


def test_a_settled_cluster_tells_nothing() -> None:
    spec, view, status = settled()
    decision = decide(spec, view, status)
    assert decision.events == ()
    assert decide(spec, later(view, 5), decision.status).events == ()


def test_a_failover_is_told_from_its_start_to_the_new_primary_once_each() -> None:
    spec, view, status = settled(lsns={1: 900, 2: 950})
    dead = with_members(view, down(view.members[0]), *(lost_primary(m) for m in view.members[1:]))
    confirming = decide(spec, dead, status)
    assert confirming.events == ()  # waiting for the detection time is no decision yet
    started = decide(spec, later(dead, 6), confirming.status)
    ((reason, message, warning),) = told(started)
    assert (reason, warning) == ("FailoverStarted", True)
    assert message.startswith(
        "failover from pg-0 (primary pg-0 failed (unreachable 6s, confirmed by 2 members))"
    )
    assert message.endswith("fencing the old primary pg-0")
    # The same decision again (the fence not effective yet) tells nothing more.
    assert decide(spec, later(dead, 7), started.status).events == ()
    fenced = with_members(later(dead, 8), replace(dead.members[0], fenced=True, stopped=True))
    promoting = decide(spec, fenced, started.status)
    assert told(promoting) == [
        ("FailoverStep", promoting.events[0].message, False),
    ]
    assert promoting.events[0].message.endswith(": promoting pg-2")
    assert decide(spec, later(fenced, 1), promoting.status).events == ()
    promoted = replace(dead.members[2], role=Role.PRIMARY, timeline=2, upstream=None, ready=True)
    done = decide(spec, with_members(later(fenced, 3), promoted), promoting.status)
    assert reasons(done) == ["Promoted", "FailoverCompleted"]
    assert done.events[0].message.startswith(
        "pg-2 is the primary on timeline 2, was pg-0: failover from pg-0"
    )
    assert done.events[1].message.endswith("pg-2 is the primary, after 5.0 s")
    assert decide(spec, with_members(later(fenced, 4), promoted), done.status).events == ()


def test_a_requested_switchover_tells_its_steps_and_leaves_its_answer_to_the_adapter() -> None:
    spec, view, status = settled()
    asked = replace(view, switchover_to="pg-1")
    draining = decide(spec, asked, status)
    ((reason, message, warning),) = told(draining)
    assert (reason, warning) == ("SwitchoverStarted", False)
    assert message == (
        "switchover from pg-0 to pg-1 (requested); draining pg-0: a clean shutdown (writes refused), then the promotion"
    )
    stopped = replace(
        view.members[0], fenced=True, stopped=True, shutdown_clean=True, reachable=False, role=Role.UNKNOWN
    )
    promoting = decide(spec, with_members(later(asked, 1), stopped), draining.status)
    # Caught up at once: catch-up and promotion in one decision, the step reached is told.
    assert [(e.reason, e.message.rsplit(": ", 1)[-1]) for e in promoting.events] == [
        ("SwitchoverStep", "promoting pg-1")
    ]
    primary = replace(view.members[1], role=Role.PRIMARY, timeline=2, upstream=None)
    done = decide(spec, with_members(later(asked, 2), stopped, primary), promoting.status)
    # Promoted, but no SwitchoverCompleted: the adapter answers the request (Event `Switchover`).
    assert reasons(done) == ["Promoted"]


def test_a_switchover_of_the_engine_own_is_told_to_its_end() -> None:
    spec, view, status = settled()
    draining = with_members(view, replace(view.members[0], terminating=True))  # its pod is being deleted
    started = decide(spec, draining, status)
    assert reasons(started) == ["SwitchoverStarted"]
    assert "(the primary pg-0 is terminating)" in started.events[0].message
    target = started.status.operation.target  # type: ignore[union-attr]
    old = replace(
        view.members[0], fenced=True, stopped=True, shutdown_clean=True, reachable=False, role=Role.UNKNOWN
    )
    promoting = decide(spec, with_members(later(view, 1), old), started.status)
    new = replace(view.member(target), role=Role.PRIMARY, timeline=2, upstream=None)  # type: ignore[arg-type]
    done = decide(spec, with_members(later(view, 2), old, new), promoting.status)
    assert reasons(done) == ["Promoted", "SwitchoverCompleted"]
    assert done.events[1].message == (
        f"switchover from pg-0 to {target} (the primary pg-0 is terminating): {target} is the primary, after 2.0 s"
    )


def test_a_rolling_update_tells_its_plan_and_each_restart() -> None:
    _, view, status = settled(lsns={1: 990, 2: 900})
    spec = make_spec(image="img:2")
    revision = spec_revision(spec)
    started = decide(spec, view, status)
    assert [(e.reason, e.warning) for e in started.events] == [("RolloutStarted", False)]
    assert started.events[0].message == (
        f"rolling update to revision {revision} (pg-2, pg-1, pg-0, in that order); restarting pg-2 (1 of 3)"
    )
    back = with_members(later(view, 5), replace(view.members[2], revision=revision))
    next_one = decide(spec, back, started.status)
    assert told(next_one) == [
        ("MemberRestarted", f"restarting pg-1 (2 of 3): rolling update to revision {revision}", False)
    ]


def test_a_rolling_update_that_aborts_is_told_as_failed() -> None:
    _, view, status = settled()
    spec = make_spec(image="img:2")
    started = decide(spec, view, status)
    gone = with_members(later(view, 700), replace(view.members[1], ready=False, wal_receiver_streaming=False))
    aborted = decide(spec, gone, started.status)
    assert aborted.status.aborted is not None
    ((reason, message, warning),) = told(aborted)
    assert (reason, warning) == ("RolloutFailed", True)
    assert message.endswith(f"failed: {aborted.status.aborted.failed}")
    assert decide(spec, later(gone, 1), aborted.status).events == ()


def test_an_operation_whose_primary_vanished_is_told_as_stopped_short() -> None:
    _, view, status = settled()
    failover = Operation(
        OperationKind.FAILOVER, started_at=NOW, step="promote", source="pg-0", target="pg-1", reason="x"
    )
    before = replace(status, operation=failover)
    after = replace(status, operation=None, current_primary="pg-1")
    gone = with_members(view, down(view.members[1]))
    (event,) = [e for e in narrate(before, after, gone) if e.reason != "Promoted"]
    assert (event.reason, event.warning) == ("FailoverInterrupted", True)
    assert event.message.endswith("the primary pg-1 is not available")


def test_the_first_primary_of_a_new_cluster() -> None:
    _, view, status = settled()
    events = narrate(EngineStatus(), status, view)
    assert [(e.reason, e.message) for e in events] == [
        ("Initialized", "pg-0 is the first primary on timeline 1")
    ]


def test_a_major_upgrade_step_is_told_and_its_own_events_are_not_repeated() -> None:
    _, view, status = settled()
    upgrade = Operation(
        OperationKind.MAJOR_UPGRADE,
        started_at=NOW,
        step="check",
        source="pg-0",
        target="pg-0",
        from_major=16,
        to_major=17,
        reason="postgresVersion 16 -> 17",
    )
    before = replace(status, operation=upgrade)
    stop = replace(status, operation=upgrade.at("stop", NOW + timedelta(seconds=9)))
    assert [(e.reason, e.message) for e in narrate(before, stop, view)] == [
        ("UpgradeStep", "upgrade to PostgreSQL 17 (postgresVersion 16 -> 17): stopping writes on pg-0")
    ]
    # Refused: UpgradeRefused is the engine's own (engine/upgrade.py), not repeated here.
    refused = replace(status, operation=None, aborted=replace(upgrade, failed="no room"))
    assert narrate(before, refused, view) == ()
    # Done: told here.
    done = narrate(replace(status, operation=upgrade.at("rebuild", NOW)), status, later(view, 60))
    assert [e.reason for e in done] == ["UpgradeCompleted"]


def test_engine_record_events_stay_actions() -> None:
    """The engine's own RecordEvent actions (an upgrade's) are untouched: events are another list."""
    spec, view, status = settled()
    decision = decide(spec, view, status)
    assert not [a for a in decision.actions if isinstance(a, A.RecordEvent)]
    assert isinstance(view, ClusterView)
