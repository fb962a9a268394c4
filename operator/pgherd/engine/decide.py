"""The engine's entry point: decide(spec, view, status) -> Decision. Pure and deterministic.

Routing, in order of precedence:

1. deletion -> Deleting; ``spec.paused`` -> Paused (observe and report only, no action);
2. bootstrap until the first primary is up;
3. a Restore/Recovery operation, or a pending Restore object;
4. a Failover or Switchover operation (also a rollout in its switchover step);
5. no healthy primary -> the recorded primary promoted again in place when it came back read-only
   and nothing else can have been promoted; a planned in-place restart waited for (never a failover);
   else failure assessment (wait, fail over, or QuorumLost / automatic recovery);
6. a healthy primary -> membership upkeep (create, rejoin, quorum steps, remove), then a rollout,
   a switchover away from a primary whose ordinal is being removed or whose pod is terminating, or a
   requested switchover;
7. with a healthy primary, backups (scheduled, Pending -> Running -> Completed/Failed, prune).
"""

from __future__ import annotations

from dataclasses import replace

from pgherd.api.cluster import Phase, PostgresClusterSpec
from pgherd.engine import backups, bootstrap, failover, membership, recovery, rollout, switchover, upgrade
from pgherd.engine.actions import RecordEvent, SetSynchronousStandbys
from pgherd.engine.conditions import Condition, ConditionType, false, true
from pgherd.engine.context import Context, Outcome
from pgherd.engine.narrate import narrate
from pgherd.engine.plan import Decision
from pgherd.engine.quorum import steady_config
from pgherd.engine.revision import spec_revision
from pgherd.engine.status import EngineStatus, Operation, OperationKind
from pgherd.engine.view import ClusterView

_RECOVERY_KINDS = (OperationKind.RESTORE, OperationKind.RECOVERY)


def decide(spec: PostgresClusterSpec, view: ClusterView, status: EngineStatus) -> Decision:
    """The next phase, conditions and actions for one cluster, and the status to record first."""
    ctx = Context(spec, view, status, spec_revision(spec, view.image, view.restart))
    if view.deleting:
        outcome = Outcome(Phase.DELETING, status, message="the cluster is being deleted")
    elif spec.paused:
        outcome = Outcome(Phase.PAUSED, status, message="spec.paused is set: observing only, no action taken")
    else:
        outcome = _route(ctx)
        if outcome.status.initialized and outcome.phase not in (Phase.RESTORING, Phase.RECOVERING):
            after = replace(ctx, status=outcome.status)
            if after.healthy_primary() is not None:
                work = backups.plan(after, outcome.status)
                outcome = replace(outcome, status=work.status, actions=outcome.actions + work.actions)
    final = replace(ctx, status=outcome.status)
    phase = outcome.phase
    aborted = outcome.status.aborted
    # A refused or rolled-back upgrade leaves a cluster that serves writes: reported by its condition.
    failing = aborted is not None and aborted.kind is not OperationKind.MAJOR_UPGRADE
    if failing and aborted is not None and phase in (Phase.RUNNING, Phase.DEGRADED, Phase.SCALING):
        phase = Phase.FAILED
        outcome = replace(outcome, message=outcome.message or f"{aborted.kind} aborted: {aborted.failed}")
    return Decision(
        phase,
        _conditions(final, phase, outcome),
        outcome.actions,
        outcome.status,
        outcome.message,
        narrate(status, outcome.status, view),
    )


def _route(ctx: Context) -> Outcome:
    if not ctx.status.initialized:
        return bootstrap.step(ctx)
    before = ctx.status.kept
    ctx = upgrade.confirm(upgrade.observe_major(ctx))
    outcome = _route_initialized(ctx)
    if before is not None and ctx.status.kept is None:
        note = RecordEvent(
            "UpgradeConfirmed",
            f"the upgrade to PostgreSQL {before.to_major} is confirmed: {before.member}, kept on PostgreSQL"
            f" {before.major}, is rebuilt on the new major",
        )
        outcome = replace(outcome, actions=(note, *outcome.actions))
    return outcome


def _route_initialized(ctx: Context) -> Outcome:
    status = ctx.status
    operation = status.operation
    if operation is not None and operation.kind in _RECOVERY_KINDS:
        return recovery.advance(ctx, operation)
    if operation is not None and operation.kind is OperationKind.MAJOR_UPGRADE:
        if operation.step in ("backup", "check") and ctx.healthy_primary() is not None:
            # Before writes stop the cluster is looked after as usual (a member rejoined, created).
            upkeep = membership.upkeep(ctx)
            after = replace(ctx, status=upkeep.outcome.status)
            return _merge(upkeep.outcome, upgrade.advance(after, operation))
        return upgrade.advance(ctx, operation)
    rolled_back = upgrade.rollback_kept(ctx)
    if rolled_back is not None:
        return rolled_back
    restore = recovery.pending_restore(ctx)
    if restore is not None:
        refused = recovery.refusal(ctx, restore)
        if refused is None:
            return recovery.start_restore(ctx, restore)
        # The Restore fails; the cluster is decided as if it had never been asked for.
        others = tuple(r for r in ctx.view.restores if r.name != restore.name)
        rest = _route_initialized(replace(ctx, view=replace(ctx.view, restores=others)))
        note = f"Restore {restore.name} refused: {refused.error}"
        return replace(
            rest, actions=(refused, *rest.actions), message="; ".join(m for m in (rest.message, note) if m)
        )
    if operation is not None and operation.kind is OperationKind.FAILOVER:
        return failover.advance(ctx, operation)
    if operation is not None and operation.kind is OperationKind.SWITCHOVER:
        progress = switchover.advance(ctx, operation)
        if progress.failed is not None:
            failed = replace(operation, failed=progress.failed)
            return replace(progress.outcome, status=replace(progress.outcome.status, aborted=failed))
        return progress.outcome
    if (
        operation is not None
        and operation.kind is OperationKind.ROLLOUT
        and operation.step in switchover.STEPS
    ):
        return rollout.advance(ctx, operation)
    if ctx.healthy_primary() is None:
        aborted = status.aborted
        if aborted is not None and aborted.kind in _RECOVERY_KINDS:
            # Member 0's data was moved aside by the failed restore: promote nothing on our own.
            message = f"{aborted.kind} {aborted.restore} failed: {aborted.failed}; create a Restore to retry"
            return Outcome(Phase.FAILED, status, message=message)
        planned = rollout.restarting_primary(ctx)
        resumed = failover.resume_in_place(ctx, Phase.UPGRADING if planned else Phase.DEGRADED)
        if resumed is not None:
            return resumed
        unfenced = failover.unfence_again(ctx)
        if unfenced is not None:
            return unfenced
        if planned:
            assert operation is not None
            return rollout.advance(ctx, operation)
        return failover.assess(ctx)
    if status.aborted is not None and _cause_gone(ctx, status.aborted):
        ctx = replace(ctx, status=replace(status, aborted=None))
    upkeep = membership.upkeep(ctx)
    after = replace(ctx, status=upkeep.outcome.status)
    if operation is not None and operation.kind is OperationKind.ROLLOUT:
        return _merge(upkeep.outcome, rollout.advance(after, operation))
    primary = str(status.current_primary)
    if not ctx.wanted(primary) and after.status.sync_pending is None:
        return _merge(upkeep.outcome, _switchover(after, None, f"{primary} is removed by scale-down"))
    healthy = ctx.healthy_primary()
    if healthy is not None and healthy.terminating and after.status.sync_pending is None:
        # Its pod is being deleted (drain, eviction): hand over before its PostgreSQL stops.
        return _merge(upkeep.outcome, _switchover(after, None, f"the primary {primary} is terminating"))
    if not upkeep.settled:
        return upkeep.outcome
    started = rollout.start(after) or upgrade.start(after)
    if started is not None:
        return _merge(upkeep.outcome, started)
    if ctx.view.switchover_to is not None and ctx.view.switchover_to != primary:
        return _merge(upkeep.outcome, _switchover(after, ctx.view.switchover_to, switchover.REQUESTED))
    return upkeep.outcome


def _cause_gone(ctx: Context, aborted: Operation) -> bool:
    if aborted.kind is OperationKind.ROLLOUT:
        return aborted.revision != ctx.revision
    if aborted.kind is OperationKind.MAJOR_UPGRADE:
        # Kept (the condition says why postgresVersion is not reached) until a retry is asked for.
        return aborted.to_major != ctx.spec.postgres_version or aborted.retry != ctx.view.retry_upgrade
    return aborted.kind is OperationKind.SWITCHOVER


def _switchover(ctx: Context, target: str | None, why: str) -> Outcome:
    """Start a switchover to ``target`` (or the best wanted replica)."""
    if target is None:
        candidates = [m for m in ctx.healthy_replicas() if ctx.wanted(m.name)]
        best = switchover.best_target(ctx, candidates)
        if best is None:
            return Outcome(Phase.SCALING, ctx.status, message=f"{why}: no replica can take over yet")
        target = best.name
    problem = switchover.target_problem(ctx, ctx.view.member(target))
    if problem is not None:
        return Outcome(Phase.RUNNING, ctx.status, message=f"switchover to {target} refused: {problem}")
    operation = Operation(OperationKind.SWITCHOVER, started_at=ctx.now, reason=why)
    operation = switchover.begin(ctx, operation, target)
    return switchover.advance(
        replace(ctx, status=replace(ctx.status, operation=operation)), operation
    ).outcome


def _merge(base: Outcome, top: Outcome) -> Outcome:
    phase = base.phase if top.phase is Phase.RUNNING else top.phase
    message = "; ".join(m for m in (top.message, base.message) if m)
    # A replica's sync standbys set ahead (upkeep) go last, once: a refused one holds back nothing of the
    # operation's step, which may set the same itself (a switchover preparing its target).
    primary = top.status.current_primary
    ahead = {(a.member, a.config) for a in top.actions if isinstance(a, SetSynchronousStandbys)}
    prepared = [a for a in base.actions if isinstance(a, SetSynchronousStandbys) and a.member != primary]
    kept = tuple(a for a in base.actions if a not in prepared)
    later = tuple(a for a in prepared if (a.member, a.config) not in ahead)
    return Outcome(phase, top.status, kept + top.actions + later, message)


def _quorum_commit(ctx: Context) -> Condition:
    """Whether commits wait for a majority, and why not: a cluster scaled below 3 members with
    ``replication.mode`` unset falls back to async, which must show in status, not happen silently."""
    if ctx.quorum_mode:
        return true(
            ConditionType.QUORUM_COMMIT, "Quorum", "a commit is acknowledged once a majority holds it"
        )
    if ctx.spec.replication.mode is None:
        message = (
            f"replication.mode is unset and instances is {ctx.spec.instances} (< 3): commits are"
            " acknowledged by the primary alone and a failover may lose the latest ones"
        )
        return false(ConditionType.QUORUM_COMMIT, "AsyncBelowThreeInstances", message)
    return false(ConditionType.QUORUM_COMMIT, "Async", "replication.mode is async")


def _quorum_members(ctx: Context) -> set[str]:
    """The voters that count for QuorumHealthy: those reachable, and the old primary a switchover stopped
    on purpose (fenced, stopped cleanly): it holds every commit and is handed over, not lost."""
    counted = {m.name for m in ctx.reachable_voters()}
    operation = ctx.status.operation
    if operation is not None and operation.step.startswith("switchover-") and operation.source:
        old = ctx.view.member(operation.source)
        if old is not None and old.name in ctx.status.voters and old.fenced and old.stopped:
            counted.add(old.name)
    return counted


def _conditions(ctx: Context, phase: Phase, outcome: Outcome) -> tuple[Condition, ...]:
    status = ctx.status
    out: list[Condition] = []
    if phase is Phase.RUNNING:
        out.append(true(ConditionType.READY, "Running"))
    else:
        out.append(false(ConditionType.READY, str(phase), outcome.message))
    primary = ctx.healthy_primary()
    if primary is not None:
        out.append(true(ConditionType.PRIMARY_AVAILABLE, "Available", primary.name))
    else:
        missing = (
            "no primary yet"
            if status.current_primary is None
            else f"the primary {status.current_primary} is not available"
        )
        out.append(false(ConditionType.PRIMARY_AVAILABLE, "Unavailable", missing))
    reachable, needed = len(_quorum_members(ctx)), ctx.needed()
    steady = (
        status.current_primary is not None
        and status.sync_pending is None
        and status.sync == steady_config(status.voters, status.current_primary, ctx.quorum_mode)
    )
    # A majority reachable is a healthy quorum, also while the synchronous standbys are being changed
    # (scaling, a switchover): planned work never turns it False.
    if status.voters and reachable >= needed:
        reason, note = (
            ("QuorumHealthy", "") if steady else ("Reconfiguring", "; synchronous standbys changing")
        )
        out.append(true(ConditionType.QUORUM_HEALTHY, reason, f"{reachable} of {len(status.voters)}{note}"))
    elif status.voters:
        message = f"{reachable} of {len(status.voters)} members reachable, {needed} needed"
        out.append(false(ConditionType.QUORUM_HEALTHY, "QuorumLost", message))
    else:
        out.append(false(ConditionType.QUORUM_HEALTHY, "Initializing", "no member holds the data yet"))
    out.append(_quorum_commit(ctx))
    if status.operation is not None:
        out.append(true(ConditionType.PROGRESSING, str(status.operation.kind), status.operation.step))
    elif status.aborted is not None:
        out.append(
            false(ConditionType.PROGRESSING, f"{status.aborted.kind}Aborted", str(status.aborted.failed))
        )
    if not outcome.actions and phase is not Phase.RUNNING:
        out.append(true(ConditionType.WAITING, str(phase), outcome.message))
    out += backups.conditions(ctx)
    reached = upgrade.condition(ctx)
    if reached is not None:
        out.append(reached)
    return tuple(out)
