"""Ordered rolling update: replicas first (most lagging first), then the primary, one member at a time.

The plan (replicas in order, then the primary) is recorded in ``status.operation`` before the first
restart. Each replica is restarted at the new revision and must be Ready and caught up before the
next. Then, with ``upgrade.primaryUpdateMethod: switchover``, an updated replica takes over
(switchover.py) and the old primary, now a replica, is restarted last; with ``restart`` the primary is
restarted in place (also with a single instance: no one to switch over to). Before each restart every
other member must be ready and the remaining streaming standbys must still cover the quorum; the
rollout waits for that. It aborts (phase Failed, condition Progressing=False) when a member does not
come back, or the wait does not end, within ``STEP_TIMEOUT``, or when the switchover fails (the old
primary is then resumed: the switchover's Unfence and SetPrimary are kept). It never restarts the primary
as a fallback.

A planned in-place restart of the primary is not a failure: while it lasts (at most
``PRIMARY_RESTART_TIMEOUT``) decide() routes here, not to failure assessment, so nothing is fenced or
promoted. If the primary does not come back in that time the rollout aborts and the ordinary failure
handling (detection, votes) takes over.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from pgherd.api.cluster import Phase, PrimaryUpdateMethod
from pgherd.engine import switchover
from pgherd.engine.actions import Action, RestartMember
from pgherd.engine.context import Context, Outcome, data_lost
from pgherd.engine.status import Operation, OperationKind
from pgherd.engine.view import MemberView

STEP_TIMEOUT = timedelta(minutes=10)
PRIMARY_RESTART_TIMEOUT = timedelta(minutes=2)


def outdated(ctx: Context) -> list[MemberView]:
    """Members to restart at the spec's revision; never the replica kept on the old major after an
    upgrade (fenced, untouched until the upgrade is confirmed)."""
    kept = ctx.kept_member
    return [
        m
        for m in ctx.view.existing()
        if ctx.wanted(m.name) and m.name != kept and m.revision not in (None, ctx.revision)
    ]


def start(ctx: Context, first: str | None = None) -> Outcome | None:
    """Begin a rollout when a member runs another revision (and the last one was not aborted for it).
    ``first``: a replica whose restart may be in flight, restarted before any other."""
    stale = outdated(ctx)
    aborted = ctx.status.aborted
    if not stale or (
        aborted is not None and aborted.kind is OperationKind.ROLLOUT and aborted.revision == ctx.revision
    ):
        return None
    primary = ctx.status.current_primary

    def lag_key(member: MemberView) -> tuple[int, str]:
        lag = ctx.lag(member)
        return (-(lag if lag is not None else 1 << 64), member.name)

    replicas = sorted((m for m in stale if m.name != primary), key=lambda m: (m.name != first, lag_key(m)))
    plan = tuple(m.name for m in replicas) + ((primary,) if primary in {m.name for m in stale} else ())
    operation = Operation(
        OperationKind.ROLLOUT,
        started_at=ctx.now,
        source=primary,
        revision=ctx.revision,
        plan=plan,
        reason=f"rolling update to revision {ctx.revision}",
    ).at("replicas", ctx.now)
    return advance(replace(ctx, status=replace(ctx.status, operation=operation)), operation)


def _abort(ctx: Context, operation: Operation, why: str, actions: tuple[Action, ...] = ()) -> Outcome:
    """Stop the rollout and report it; ``actions`` are what the failed step still needs done (a
    switchover's resumption of the old primary)."""
    status = replace(ctx.status, operation=None, aborted=replace(operation, failed=why))
    return Outcome(Phase.FAILED, status, actions, message=f"rolling update aborted: {why}")


def restarting_primary(ctx: Context) -> bool:
    """Is the recorded primary down for this rollout's planned in-place restart? (advance() waits for
    it, and aborts once PRIMARY_RESTART_TIMEOUT has passed.)"""
    operation = ctx.status.operation
    if (
        operation is None
        or operation.kind is not OperationKind.ROLLOUT
        or operation.step != "restart-primary"
    ):
        return False
    return operation.source == ctx.status.current_primary


def _ready(ctx: Context, member: MemberView) -> bool:
    return member.ready and member.revision == ctx.revision and ctx.caught_up(member)


def advance(ctx: Context, operation: Operation) -> Outcome:
    if operation.revision != ctx.revision and operation.step not in switchover.STEPS:
        # The spec changed again mid-rollout: start over with the new revision's plan, but only once
        # the restart in flight is over. The view may not show it yet (a deleted pod still looks
        # Running for a moment): a new plan at once could restart a second member beside it.
        inflight = _restart_in_flight(ctx, operation)
        age = ctx.now - (operation.step_started_at or operation.started_at)
        if (
            inflight == operation.source
            and operation.step == "restart-primary"
            and age <= PRIMARY_RESTART_TIMEOUT
        ):
            message = (
                f"waiting for the primary {inflight} to come back from its restart before planning again"
            )
            return Outcome(Phase.UPGRADING, ctx.status, message=message)
        # The new plan restarts the member in flight first: it is the only one that may be down.
        fresh = start(replace(ctx, status=replace(ctx.status, operation=None)), first=inflight)
        return fresh or Outcome(Phase.RUNNING, replace(ctx.status, operation=None))
    status = replace(ctx.status, operation=operation)
    ctx = replace(ctx, status=status)
    age = ctx.now - (operation.step_started_at or operation.started_at)
    if operation.step in switchover.STEPS:
        progress = switchover.advance(ctx, operation, Phase.SWITCHING_OVER)
        if progress.failed is not None:
            failed_ctx = replace(ctx, status=progress.outcome.status)
            return _abort(
                failed_ctx,
                operation,
                f"switchover to {operation.target} failed: {progress.failed}",
                progress.outcome.actions,
            )
        if not progress.finished:
            return progress.outcome
        after = replace(progress.outcome.status, operation=operation.at("old-primary", ctx.now))
        return replace(progress.outcome, status=after)
    old_primary = operation.source
    for name in operation.plan:
        if name in operation.done or name == old_primary:
            continue
        member = ctx.view.member(name)
        if member is None or not member.exists or (member.revision == ctx.revision and _ready(ctx, member)):
            operation = replace(operation, done=(*operation.done, name))
            continue
        restarting = operation.step == f"restart:{name}"
        if restarting and age > STEP_TIMEOUT:
            return _abort(
                ctx, operation, f"{name} was not Ready and caught up {STEP_TIMEOUT} after its restart"
            )
        if member.revision == ctx.revision:
            return Outcome(
                Phase.UPGRADING, replace(status, operation=operation), message=f"waiting for {name}"
            )
        gate = None if restarting else _gate(ctx, operation, member)
        if gate is not None:
            return gate
        operation = operation.at(f"restart:{name}", ctx.now)
        return Outcome(
            Phase.UPGRADING,
            replace(status, operation=operation),
            (RestartMember(name, ctx.revision, reason=operation.reason),),
            message=f"restarting {name} ({len(operation.done) + 1} of {len(operation.plan)})",
        )
    status = replace(status, operation=operation)
    ctx = replace(ctx, status=status)
    if old_primary not in operation.plan or old_primary in operation.done:
        return Outcome(Phase.RUNNING, replace(status, operation=None), message="rolling update complete")
    member = ctx.view.member(old_primary)
    if any(m.name != old_primary for m in outdated(ctx)):
        # Members were added or came back at the old revision (scaling): plan again, replicas first.
        return start(replace(ctx, status=replace(status, operation=None))) or Outcome(Phase.UPGRADING, status)
    if old_primary == ctx.status.current_primary:
        assert member is not None
        in_place = ctx.spec.upgrade.primary_update_method is PrimaryUpdateMethod.RESTART
        if in_place or ctx.spec.instances == 1:  # a lone member has no one to switch over to
            if member.revision == ctx.revision and member.is_primary:
                done = replace(operation, done=(*operation.done, old_primary))
                return Outcome(
                    Phase.RUNNING, replace(status, operation=None), message=f"{done.kind} complete"
                )
            if operation.step == "restart-primary" and age > PRIMARY_RESTART_TIMEOUT:
                return _abort(ctx, operation, f"the primary {old_primary} did not come back in time")
            if data_lost(member):
                return _abort(ctx, operation, f"the primary {old_primary}'s data is lost")
            if member.revision == ctx.revision:
                return Outcome(Phase.UPGRADING, status, message=f"waiting for the primary {old_primary}")
            if operation.step != "restart-primary":
                gate = _gate(ctx, operation, member)
                if gate is not None:
                    return gate
            operation = operation.at("restart-primary", ctx.now)
            return Outcome(
                Phase.UPGRADING,
                replace(status, operation=operation),
                (
                    RestartMember(
                        old_primary, ctx.revision, primary=True, reason="primaryUpdateMethod: restart"
                    ),
                ),
                message=f"restarting the primary {old_primary} in place",
            )
        updated = [m for m in ctx.healthy_replicas() if m.revision == ctx.revision]
        target = switchover.best_target(ctx, updated)
        if target is None:
            why = (
                "; ".join(f"{m.name}: {switchover.target_problem(ctx, m)}" for m in updated)
                or "none is ready"
            )
            if operation.step != "await-target":
                operation = operation.at("await-target", ctx.now)
                age = timedelta(0)
            if age <= STEP_TIMEOUT:
                message = f"waiting for an updated replica to take over from {old_primary}: {why}"
                return Outcome(Phase.UPGRADING, replace(status, operation=operation), message=message)
            return _abort(ctx, operation, f"no updated replica can take over from {old_primary} ({why})")
        operation = switchover.begin(ctx, operation, target.name)
        return advance(ctx, operation)
    # The old primary is a replica now: restart it last, once it streams again.
    if member is None or not member.exists:
        return Outcome(Phase.RUNNING, replace(status, operation=None), message="rolling update complete")
    if member.revision == ctx.revision:
        if _ready(ctx, member):
            return Outcome(Phase.RUNNING, replace(status, operation=None), message="rolling update complete")
        if age > STEP_TIMEOUT:
            return _abort(ctx, operation, f"{old_primary} was not Ready and caught up after its restart")
        return Outcome(Phase.UPGRADING, status, message=f"waiting for {old_primary}")
    if not member.streams_from(str(ctx.status.current_primary)):
        if age > STEP_TIMEOUT:
            return _abort(ctx, operation, f"the old primary {old_primary} did not rejoin")
        return Outcome(Phase.UPGRADING, status, message=f"waiting for {old_primary} to rejoin as a replica")
    gate = None if operation.step == "restart-old-primary" else _gate(ctx, operation, member)
    if gate is not None:
        return gate
    operation = operation.at("restart-old-primary", ctx.now)
    return Outcome(
        Phase.UPGRADING,
        replace(status, operation=operation),
        (RestartMember(old_primary, ctx.revision, reason=operation.reason),),
        message=f"restarting the old primary {old_primary}",
    )


def _restart_in_flight(ctx: Context, operation: Operation) -> str | None:
    """The member whose restart this rollout ordered and has not seen come back (ready at the
    rollout's revision) yet, within STEP_TIMEOUT; None when no restart is in flight. (Perhaps the
    restart was never applied: an operator crash. Its member is then simply restarted first.)"""
    step = operation.step
    if step.startswith("restart:"):
        name: str | None = step.split(":", 1)[1]
    elif step in ("restart-primary", "restart-old-primary"):
        name = operation.source
    else:
        return None
    member = ctx.view.member(name)
    if member is None or not member.exists or data_lost(member):
        return None
    age = ctx.now - (operation.step_started_at or operation.started_at)
    back = member.ready and member.revision == operation.revision
    return None if back or age > STEP_TIMEOUT else name


def _gate(ctx: Context, operation: Operation, member: MemberView) -> Outcome | None:
    """Wait (or abort after STEP_TIMEOUT) while another member is down; abort when restarting
    ``member`` would break the quorum. None: the restart may go ahead."""
    down = [m.name for m in ctx.view.existing() if m.name != member.name and not m.ready]
    problem = _quorum_risk(ctx, member)
    if not down and problem is None:
        return None
    # Replicas that were just re-pointed (after the switchover of this very rollout) or restarted
    # stream again within seconds: wait for them, and abort only if they do not in STEP_TIMEOUT.
    step = f"before:{member.name}"
    if operation.step != step:
        operation = operation.at(step, ctx.now)
    waited = ctx.now - (operation.step_started_at or ctx.now)
    reason = f"{', '.join(down)} not ready" if down else str(problem)
    if waited > STEP_TIMEOUT:
        return _abort(ctx, operation, f"{reason}; {member.name} not restarted")
    status = replace(ctx.status, operation=operation)
    return Outcome(Phase.UPGRADING, status, message=f"waiting before restarting {member.name}: {reason}")


def _quorum_risk(ctx: Context, member: MemberView) -> str | None:
    """Would taking ``member`` down leave the primary fewer live sync standbys than it waits for?"""
    config = ctx.status.sync
    if not ctx.quorum_mode or config is None or config.k == 0:
        return None
    others = {m.name for m in ctx.healthy_replicas() if m.name != member.name} & config.standbys
    if len(others) < config.k:
        return (
            f"restarting {member.name} would leave {len(others)} streaming synchronous standbys,"
            f" fewer than the {config.k} every commit waits for"
        )
    return None
