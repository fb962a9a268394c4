"""Planned switchover: drain the primary, let the target catch up exactly, promote it.

Steps (``operation.source`` is the primary, ``operation.target`` the member to promote):

``switchover-fence``    Fence the primary: clean shutdown (the target's sync standbys set and the other
                        replicas re-pointed at it before, see prepare_promotion). PostgreSQL's clean
                        shutdown sends all WAL to the connected standbys; once the platform confirms
                        the member stopped and its shutdown was clean, its final WAL end
                        (``received_lsn`` of the stopped member) is recorded as final_lsn. After an
                        unclean stop (a fast shutdown that timed out and was killed) the final WAL
                        end is unknown: the switchover is abandoned.
``switchover-catchup``  Wait until the target holds exactly that much WAL.
``switchover-promote``  As in a failover (sync standbys first, then pg_promote), then re-point.

The target is checked before the first step: a voter, streaming from the primary, ready, on the
primary's timeline and caught up. A member that just rejoined and does not stream yet is never a
target (Patroni 3.0.2 lost acknowledged writes that way), nor one carrying out an action (its agent
would take the Promote only after it, the primary fenced all along). If the final LSN cannot be read
or the target does not reach it in time, the switchover is abandoned before any promotion: the old
primary is unfenced and resumes. Once Promote may have been issued there is no way back (and no timeout).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

from pgherd.api.cluster import Phase
from pgherd.engine.actions import Fence, SetPrimary, Unfence
from pgherd.engine.context import Context, Outcome, by_most_data
from pgherd.engine.failover import prepare_promotion, promote_step
from pgherd.engine.status import Operation
from pgherd.engine.view import MemberView

SWITCHOVER_TIMEOUT = timedelta(seconds=30)

STEPS = ("switchover-fence", "switchover-catchup", "switchover-promote")
# The reason of a switchover a person asked for (pgherd.io/switchover-to): the adapter answers the request.
REQUESTED = "requested"


def target_problem(ctx: Context, member: MemberView | None) -> str | None:
    """Why ``member`` cannot be a switchover target now, or None."""
    primary = ctx.status.current_primary
    if member is None or not member.exists:
        return "it does not exist"
    if member.name == primary:
        return "it is the primary"
    if member.name not in ctx.status.voters:
        return "it is not yet a quorum member (still seeding or joining)"
    if primary is None or not member.streams_from(primary):
        return f"it is not streaming from the primary {primary}"
    if not member.ready or member.fenced:
        return "it is not ready"
    if member.busy:
        # Its agent would take the Promote only once that action ends, the primary fenced meanwhile.
        return "it is carrying out another action"
    if not ctx.on_current_timeline(member):
        return f"it is on timeline {member.timeline}, the primary on {ctx.status.timeline}"
    if not ctx.caught_up(member):
        return f"it is {ctx.lag(member)} bytes behind the primary"
    reachable = len(ctx.reachable_voters())  # the primary included: it hands over all its WAL
    if reachable < ctx.needed():
        return f"only {reachable} members are reachable; a majority ({ctx.needed()}) is needed"
    return None


def best_target(ctx: Context, candidates: list[MemberView]) -> MemberView | None:
    valid = [m for m in candidates if target_problem(ctx, m) is None]
    return min(valid, key=by_most_data) if valid else None


@dataclass(frozen=True)
class Progress:
    """A switchover step's result: the outcome, and whether it finished or failed (with why)."""

    outcome: Outcome
    finished: bool = False
    failed: str | None = None


def begin(ctx: Context, operation: Operation, target: str) -> Operation:
    """``operation`` moved to the first switchover step; the caller checked target_problem first."""
    return replace(operation, source=ctx.status.current_primary, target=target, final_lsn=None).at(
        STEPS[0], ctx.now
    )


def advance(ctx: Context, operation: Operation, phase: Phase = Phase.SWITCHING_OVER) -> Progress:
    status = replace(ctx.status, operation=operation)
    ctx = replace(ctx, status=status)
    old = ctx.view.member(operation.source)
    target = ctx.view.member(operation.target)
    step_age = ctx.now - (operation.step_started_at or operation.started_at)
    if operation.step == "switchover-fence":
        if old is not None and old.exists and not (old.fenced and old.stopped):
            if step_age > SWITCHOVER_TIMEOUT:
                return _abandon(ctx, operation, phase, f"{old.name} did not stop in time")
            actions = (*prepare_promotion(ctx, operation), Fence(old.name, reason="switchover"))
            return Progress(Outcome(phase, status, actions, f"draining {old.name}"))
        # Only a clean shutdown hands every WAL record to the standbys and tells where WAL ends.
        clean = old is not None and old.exists and old.stopped and old.shutdown_clean is True
        final = old.received_lsn if clean and old is not None else None
        operation = replace(operation, final_lsn=final).at("switchover-catchup", ctx.now)
        status = replace(status, operation=operation)
        ctx = replace(ctx, status=status)
        step_age = timedelta(0)
    if operation.step == "switchover-catchup":
        if operation.final_lsn is None:
            return _abandon(ctx, operation, phase, f"the final WAL position of {operation.source} is unknown")
        have = target.most_wal if target is not None and target.reachable else None
        if have is not None and have >= operation.final_lsn:
            operation = operation.at("switchover-promote", ctx.now)
            ctx = replace(ctx, status=replace(status, operation=operation))
        elif step_age > SWITCHOVER_TIMEOUT:
            return _abandon(ctx, operation, phase, f"{operation.target} did not catch up in time")
        else:
            return Progress(Outcome(phase, status, message=f"waiting for {operation.target} to catch up"))
    if operation.step == "switchover-promote":
        # No timeout here: once Promote may have been applied, no other member may be promoted.
        done = target is not None and target.is_primary
        return Progress(promote_step(ctx, operation, phase), finished=done)
    raise AssertionError(f"unknown switchover step {operation.step!r}")


def _abandon(ctx: Context, operation: Operation, phase: Phase, why: str) -> Progress:
    """Nothing was promoted: resume the old primary (if it does not come back, the failover path
    takes over after its detection period). Unfence is the engine's explicit order to start it
    read-write again: it is still the recorded primary and no other member was promoted."""
    status = replace(ctx.status, operation=None)
    old = str(operation.source)
    actions = (
        Unfence(old, reason=f"switchover abandoned: {why}"),
        SetPrimary(old, reason="switchover abandoned"),
    )
    return Progress(Outcome(phase, status, actions, message=f"switchover abandoned: {why}"), failed=why)


# A request for any member waits this long for a streaming replica before it is refused: right after a
# switchover, the old primary rejoins and the others reconnect, and none streams for a moment.
ANY_TARGET_WAIT = 30.0


def any_target(streaming_replicas: dict[str, int]) -> str | None:
    """The target of `switchover-to: any`: of the replicas streaming now (name: received LSN as a number),
    the one with the most WAL, by name on a tie; None when none streams."""
    if not streaming_replicas:
        return None
    return max(streaming_replicas.items(), key=lambda item: (item[1], item[0]))[0]


def refuse_any(waited: float) -> bool:
    """A request for any member with no streaming replica, first seen ``waited`` seconds ago, is refused."""
    return waited >= ANY_TARGET_WAIT
