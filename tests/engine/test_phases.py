"""Every phase of DESIGN §2 is reachable, and no state is a silent dead end."""

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
    RestoreView,
    decide,
)
from pgherd.engine.conditions import ConditionType
from pgherd.engine.plan import Decision

from .builders import CLUSTER, NOW, down, later, lost_primary, make_spec, settled, with_members

STORE = {"store": {"s3": {"bucket": "bkt", "credentials": {"secretName": "s3"}}}}


def _twice(spec: PostgresClusterSpec, view: ClusterView, status: EngineStatus, seconds: float) -> Decision:
    first = decide(spec, view, status)
    return decide(spec, later(view, seconds), first.status)


def scenarios() -> dict[Phase, Decision]:
    out: dict[Phase, Decision] = {}
    spec, view, status = settled()
    out[Phase.RUNNING] = decide(spec, view, status)
    out[Phase.PAUSED] = decide(make_spec(paused=True), view, status)
    out[Phase.DELETING] = decide(spec, replace(view, deleting=True), status)
    out[Phase.CREATING] = decide(spec, ClusterView(CLUSTER, NOW), EngineStatus())
    pending_spec = make_spec(bootstrap={"fromBackup": {"backup": "b"}})
    out[Phase.PENDING] = decide(
        pending_spec, ClusterView(CLUSTER, NOW, backups=(BackupView("b", "Running"),)), EngineStatus()
    )
    out[Phase.SCALING] = decide(make_spec(instances=5), view, status)
    out[Phase.UPGRADING] = decide(make_spec(image="img:2"), view, status)
    out[Phase.SWITCHING_OVER] = decide(spec, replace(view, switchover_to="pg-2"), status)
    dead = with_members(view, down(view.members[0]), *[lost_primary(m) for m in view.members[1:]])
    out[Phase.DEGRADED] = decide(spec, dead, status)
    out[Phase.FAILING_OVER] = _twice(spec, dead, status, 6)
    lost = with_members(view, down(view.members[0]), down(view.members[1]), lost_primary(view.members[2]))
    out[Phase.QUORUM_LOST] = decide(spec, lost, status)
    recover = make_spec(backup=STORE, recovery={"onQuorumLoss": "RestoreFromBackup"})
    gone = with_members(
        lost,
        replace(down(view.members[0]), exists=False, data_present=False),
        replace(down(view.members[1]), exists=False, data_present=False),
    )
    with_backup = replace(
        gone, backups=(BackupView("b", "Completed", completed_at=NOW - timedelta(hours=1)),)
    )
    out[Phase.RECOVERING] = _twice(recover, with_backup, status, 60)
    restore = replace(view, backups=with_backup.backups, restores=(RestoreView("r", backup="b"),))
    out[Phase.RESTORING] = decide(spec, restore, status)
    # A restore whose job failed (a refused Restore fails alone: the cluster is never Failed for it).
    restoring = out[Phase.RESTORING].status
    fenced = with_members(restore, *[replace(down(m), fenced=True, stopped=True) for m in view.members])
    started = decide(spec, later(fenced, 1), restoring)
    job = JobView(JobKind.RESTORE, "r", JobState.FAILED, member="pg-0", message="checksum mismatch")
    out[Phase.FAILED] = decide(spec, replace(later(fenced, 2), jobs=(job,)), started.status)
    return out


def test_every_phase_is_reachable() -> None:
    reached = scenarios()
    for phase, decision in reached.items():
        assert decision.phase is phase, (phase, decision.phase, decision.message)
    assert set(reached) == set(Phase)


def test_no_silent_dead_end() -> None:
    for decision in scenarios().values():
        if decision.phase is not Phase.RUNNING and not decision.actions:
            waiting = decision.condition(ConditionType.WAITING)
            assert waiting is not None and waiting.message, decision


def test_primary_available_names_what_is_missing() -> None:
    """A user reads PrimaryAvailable's message: "primary None" before any primary exists said nothing."""
    reached = scenarios()
    for phase, decision in reached.items():
        condition = decision.condition(ConditionType.PRIMARY_AVAILABLE)
        assert condition is not None and "None" not in condition.message, (phase, condition)
    creating = reached[Phase.CREATING].condition(ConditionType.PRIMARY_AVAILABLE)
    assert creating is not None and creating.message == "no primary yet"
    degraded = reached[Phase.DEGRADED].condition(ConditionType.PRIMARY_AVAILABLE)
    assert degraded is not None and degraded.message == "the primary pg-0 is not available"
