"""Unplanned failover: confirm the primary's failure with a quorum, fence it, promote the best replica.

Steps of a Failover operation (recorded before the first one):

``fence``   Fence the old primary until there is evidence that it cannot accept a write (its process
            or pod gone, its PostgreSQL confirmed stopped, or it answers read-only): being asked to
            fence is not enough, since a fence may lag or fail and an unreachable primary may run.
``promote`` Choose the reachable replica with the most WAL it provably holds (then replayed LSN, then
            name) among the voters on the current timeline, only when they are a majority of the voters
            and, in quorum mode, intersect every ack set that may be in force. Configure its sync
            standbys, then pg_promote it; repeat (harmless) until it is observed primary.
``finish``  Point the rw endpoint at it and re-point the other members.

The failure itself is confirmed first (``assess``): the operator cannot reach the primary for
``detectionSeconds`` and a majority of the voters agree, each replica's vote being a loss of its WAL
stream (or silence on it beyond what a live primary allows, dated back to its last word) observed
continuously for as long. Detection counts from the operator's first observation of the failure, or
from the earlier date by which a majority of the replicas lost the primary (``lost_since``). If the
promoted member vanishes after Promote was issued, it is recorded as the primary anyway and goes
through the same confirmation (fenced first): never two promoted members.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta

from pgherd.api.cluster import Phase
from pgherd.engine import recovery
from pgherd.engine.actions import (
    Action,
    Demote,
    Fence,
    Promote,
    Rejoin,
    SetPrimary,
    SetSynchronousStandbys,
    Unfence,
)
from pgherd.engine.context import Context, Outcome, by_most_data, cannot_write
from pgherd.engine.quorum import SyncConfig, failover_keeps_commits, majority, steady_config
from pgherd.engine.status import Operation, OperationKind
from pgherd.engine.view import MemberView, Role

# Silence on a WAL stream beyond its heartbeat before it counts as a lost primary: the heartbeat's own
# round trip and the sampling of the receiver's state.
SILENCE_MARGIN = 1.0


def reachable_replicas(ctx: Context, old: str | None) -> list[MemberView]:
    """Voters that can count for a failover: reachable replicas that report the WAL they provably hold
    (a member whose WAL end is uncertain is never counted to cover an ack set; see ``eligible``).
    The failed primary itself qualifies once it answers read-only (started again as a standby, or by
    Demote): it then holds every commit it acknowledged and cannot write."""
    return [m for m in ctx.voter_views() if m.reachable and m.role is Role.REPLICA and m.held_lsn is not None]


def promotion_quorum(ctx: Context, old: str | None) -> int:
    """How many reachable voters a promotion needs: a majority of the voters. With two voters in async
    mode the operator is the tie-breaker: one suffices once the platform confirms the old primary is
    gone or stopped (async replication promises no commit to keep, and split brain is excluded)."""
    voters = len(ctx.status.voters)
    if voters == 2 and not ctx.quorum_mode and old is not None:
        member = ctx.view.member(old)
        if member is None or not member.exists or member.stopped:
            return 1
    return majority(voters)


def eligible(ctx: Context, old: str | None) -> list[MemberView]:
    """The candidates, best first: reachable replicas on the newest timeline among them.

    Only the engine promotes, one member at a time, so the newest timeline is the latest history; a
    member on an older one (an earlier primary not rejoined yet, or a replica that never followed a
    promotion) reports LSNs of another history. Every ack set of the failed primary streams from it, on
    its timeline, so a reachable majority that intersects the ack sets contains a member on that
    timeline, and the newest timeline among the reachable is the failed primary's whenever it matters.

    A reachable voter whose WAL end is not known yet (restarted, replaying) is not counted, but it is
    ranked by the WAL it provably received or replayed: when that beats every counted member, it holds
    all they hold on that timeline, and promoting another would drop WAL a reachable member has.
    """
    replicas = reachable_replicas(ctx, old)
    if not replicas:
        return []
    newest = max(m.timeline or 0 for m in replicas)
    unsure = [
        m
        for m in ctx.voter_views()
        if m.reachable and m.role is Role.REPLICA and m.held_lsn is None and m.most_wal is not None
    ]
    return sorted((m for m in replicas + unsure if (m.timeline or 0) == newest), key=by_most_data)


def standby_starts(ctx: Context) -> tuple[Action, ...]:
    """While no primary is available, start fenced members read-only (Demote): their WAL then counts
    for the majority and for the choice of the new primary, and they still cannot write."""
    return tuple(
        Demote(m.name, reason="no primary: keep its WAL available, read-only")
        for m in ctx.view.existing()
        if m.fenced and not (m.reachable and m.role is Role.REPLICA) and m.name != ctx.kept_member
    )


def unsafe_reason(ctx: Context, old: str | None, reachable: list[MemberView]) -> str | None:
    """Why promoting among ``reachable`` could lose acknowledged commits or split the cluster."""
    needed = promotion_quorum(ctx, old)
    if len(reachable) < needed:
        return (
            f"only {len(reachable)} of {len(ctx.status.voters)} members are reachable replicas;"
            f" a majority ({needed}) is needed to promote"
        )
    if ctx.quorum_mode and old is not None:
        configs = ctx.status.possible_sync_configs()
        if not failover_keeps_commits((m.name for m in reachable), old, configs):
            shown = ", ".join(c.render() or "asynchronous" for c in configs) or "unknown"
            return f"the reachable replicas may miss acknowledged commits (synchronous standbys: {shown})"
    return None


def resume_in_place(ctx: Context, phase: Phase = Phase.DEGRADED) -> Outcome | None:
    """The recorded primary came back read-only (its PostgreSQL crashed and was restarted, which a
    member never does read-write on its own): promote it again, at once, when nothing else can have
    been promoted meanwhile (no failover begun, no other primary, on the recorded timeline). It holds
    every commit it acknowledged; this is faster than a failover and loses nothing. None otherwise."""
    status = ctx.status
    member = ctx.primary()
    if member is None or not member.exists or not member.reachable or member.fenced:
        return None
    if member.role is not Role.REPLICA or member.upstream is not None or member.wal_receiver_streaming:
        return None
    if status.timeline is not None and (member.timeline is None or member.timeline < status.timeline):
        return None  # an older history: never (a newer one is its own promotion, not yet observed)
    if any(m.reachable and m.role is Role.PRIMARY for m in ctx.view.existing() if m.name != member.name):
        return None
    config = status.sync_pending or status.sync or steady_config(status.voters, member.name, ctx.quorum_mode)
    why = f"{member.name}, the primary, came back read-only: promoting it in place"
    return Outcome(
        phase,
        replace(status, sync=None, sync_pending=config),
        (SetSynchronousStandbys(member.name, config, reason=why), Promote(member.name, reason=why)),
        message=why,
    )


def unfence_again(ctx: Context, phase: Phase = Phase.DEGRADED) -> Outcome | None:
    """The recorded primary is fenced and stopped, and no operation is under way: the engine fences a
    primary only inside an operation, and one that ended without a promotion sent Unfence, which was
    lost (its PostgreSQL crashed meanwhile, and its agent started it again fenced, as the fence on its
    volume says). Send it again, when nothing else can have been promoted (no other primary, on the
    recorded timeline): it holds every commit it acknowledged. None otherwise."""
    status = ctx.status
    member = ctx.primary()
    if status.operation is not None or member is None or not member.exists or member.absent:
        return None
    if not member.fenced or not member.stopped or not member.data_present:
        return None
    if status.timeline is not None and member.timeline is not None and member.timeline < status.timeline:
        return None
    if any(m.reachable and m.role is Role.PRIMARY for m in ctx.view.existing() if m.name != member.name):
        return None
    why = f"{member.name}, the primary, is fenced with no operation under way (a lost Unfence)"
    return Outcome(
        phase,
        status,
        (Unfence(member.name, reason=why), SetPrimary(member.name, reason=why)),
        message=f"starting {member.name} read-write again: {why}",
    )


def assess(ctx: Context) -> Outcome:
    """The recorded primary is not a healthy primary and no operation runs: wait, fail over, or
    report the quorum lost (fenced members are started read-only meanwhile)."""
    outcome = _assess(ctx)
    operation = outcome.status.operation
    if operation is None or (operation.kind is OperationKind.FAILOVER and operation.step == "fence"):
        outcome = replace(outcome, actions=outcome.actions + standby_starts(ctx))
    return outcome


def silent_since(member: MemberView, now: datetime) -> datetime | None:
    """When ``member``'s upstream last said anything, if it has been silent for longer than a live
    upstream ever is (its heartbeat and SILENCE_MARGIN); None otherwise, or when unknown."""
    silence, heartbeat = member.upstream_silence, member.upstream_heartbeat
    if silence is None or heartbeat is None or silence < heartbeat + SILENCE_MARGIN:
        return None
    return now - timedelta(seconds=silence)


def _votes(ctx: Context, old: str | None) -> dict[str, datetime]:
    """Since when each reachable replica has reported, at every observation, that it lost ``old``: no
    WAL stream from it, or a stream from which nothing arrived for longer than a live primary allows
    (a partition is silence: the receiver says streaming until wal_receiver_timeout). A silent stream
    votes from the moment the primary went silent, once seen at two observations in a row. A replica
    that streams again or cannot be reached loses its vote: one instantaneous sample is not a vote. The
    old primary answering read-only votes too: it is no primary."""
    since = ctx.status.votes_since
    out: dict[str, datetime] = {}
    for member in reachable_replicas(ctx, old):
        if old is None or not member.streams_from(old):
            # Lost since its upstream's last word when its agent knows it (the receiver gave up on a
            # silent primary after wal_receiver_timeout), else since now.
            last_word = member.upstream_silence
            lost = (
                ctx.now - timedelta(seconds=last_word) if last_word is not None and last_word > 0 else ctx.now
            )
            out[member.name] = min(since.get(member.name, lost), lost)
        elif (silent := silent_since(member, ctx.now)) is not None:
            out[member.name] = min(since.get(member.name, silent), silent)
    return out


def lost_since(ctx: Context, votes_since: dict[str, datetime], needed: int) -> datetime:
    """When the primary was lost, as far as the evidence goes: now (the operator's first observation of
    it), or earlier when ``needed`` replicas date their loss before (their WAL receivers' last word
    from it). Detection then counts from the failure, not from the operator's next poll, which comes
    up to a poll interval later (1.1 s of a 5.0 s failover on localkube, 2026-12-05); the votes
    themselves still need detectionSeconds and two observations each.

    Safe because no agent dates a loss before the truth: each watches its own WAL receiver every 0.1 s
    and dates a receiver gone at the first sample without it (pgherd_backup.agent.upstream), where it
    once aged the sample of the operator's last poll, up to 2 s too early (e52172d reverted this)."""
    dates = sorted(votes_since.values())
    return dates[needed - 1] if needed > 0 and len(dates) >= needed else ctx.now


def counted_votes(ctx: Context, votes_since: dict[str, datetime]) -> list[str]:
    """The votes that confirm the failure: lost for detectionSeconds, and reported at this observation
    and at the one before (a vote dated back to the primary's last word still needs two samples)."""
    before = ctx.status.votes_since
    return [n for n, when in votes_since.items() if ctx.now - when >= ctx.detection and n in before]


def _assess(ctx: Context) -> Outcome:
    status = ctx.status
    old = status.current_primary
    votes_since = _votes(ctx, old)
    needed = promotion_quorum(ctx, old)
    since = min(status.primary_lost_since or ctx.now, lost_since(ctx, votes_since, needed))
    status = replace(status, primary_lost_since=since, votes_since=votes_since)
    reachable = reachable_replicas(ctx, old)
    if len(ctx.reachable_voters()) < needed:
        return recovery.on_quorum_loss(replace(ctx, status=status), f"primary {old} is not available")
    status = replace(status, quorum_lost_since=None)
    if not ctx.spec.failover.enabled:
        return Outcome(
            Phase.DEGRADED, status, message=f"primary {old} is not available; failover is disabled"
        )
    elapsed = (ctx.now - since).total_seconds()
    if elapsed < ctx.spec.failover.detection_seconds:
        return Outcome(
            Phase.DEGRADED,
            status,
            message=f"primary {old} unreachable for {elapsed:.0f}s; confirming for"
            f" {ctx.spec.failover.detection_seconds}s before failing over",
        )
    votes = counted_votes(ctx, votes_since)
    if len(votes) < needed:
        return Outcome(
            Phase.DEGRADED,
            status,
            message=f"primary {old} unreachable from the operator, but only {len(votes)} replicas lost it"
            f" for {ctx.spec.failover.detection_seconds}s ({needed} needed to confirm the failure):"
            " no failover",
        )
    problem = unsafe_reason(ctx, old, reachable)
    if problem is not None:
        return Outcome(Phase.FAILING_OVER, status, message=f"cannot fail over: {problem}")
    operation = Operation(
        OperationKind.FAILOVER,
        started_at=ctx.now,
        source=old,
        reason=f"primary {old} failed (unreachable {elapsed:.0f}s, confirmed by {len(votes)} members)",
    ).at("fence", ctx.now)
    return advance(replace(ctx, status=replace(status, operation=operation)), operation)


def advance(ctx: Context, operation: Operation) -> Outcome:
    status = ctx.status
    old = operation.source
    if operation.step == "fence":
        member = ctx.view.member(old)
        if not cannot_write(member):
            assert member is not None
            # Repeated until the platform shows the old primary cannot write any more.
            return Outcome(
                Phase.FAILING_OVER,
                status,
                (Fence(member.name, reason=operation.reason),),
                message=f"fencing the old primary {old}: waiting for evidence that it stopped",
            )
        reachable = reachable_replicas(ctx, old)
        candidates = eligible(ctx, old)
        problem = unsafe_reason(ctx, old, reachable) if candidates else "no reachable replica"
        if problem is not None:
            if len(ctx.reachable_voters()) < promotion_quorum(ctx, old):
                outcome = recovery.on_quorum_loss(ctx, f"failover from {old} waits for a majority")
            else:
                outcome = Outcome(Phase.FAILING_OVER, status, message=f"waiting to promote: {problem}")
            if outcome.status.operation is operation:
                outcome = replace(outcome, actions=outcome.actions + standby_starts(ctx))
            return outcome
        operation = replace(operation, target=candidates[0].name).at("promote", ctx.now)
        ctx = replace(ctx, status=replace(status, operation=operation))
    if operation.step == "promote":
        return promote_step(ctx, operation, Phase.FAILING_OVER)
    raise AssertionError(f"unknown failover step {operation.step!r}")


def promote_step(ctx: Context, operation: Operation, phase: Phase) -> Outcome:
    """Promote ``operation.target`` (configuring its sync standbys first) until it is observed primary.

    Shared by failover and switchover: once Promote may have been applied, the target is the only
    member ever promoted for this operation.
    """
    status = ctx.status
    assert operation.target is not None
    target = ctx.view.member(operation.target)
    if target is not None and target.is_primary:
        return finish(ctx, operation, target, phase)
    if target is None or not target.reachable:
        # Promote was issued: it may have happened. Wait for the target to answer; if it stays away,
        # treat it as a failed primary (fence it first), never promote a second member beside it.
        silent = ctx.now - (operation.step_started_at or operation.started_at)
        if silent < ctx.detection:
            message = f"{operation.target} does not answer while being promoted; waiting"
            return Outcome(phase, replace(status, operation=operation), message=message)
        # It is the primary as far as anyone may know: its failure is confirmed like any other
        # (detection, then a majority of votes) before another member is promoted.
        status = replace(
            status,
            current_primary=operation.target,
            operation=None,
            primary_lost_since=ctx.now,
            votes_since={},
        )
        return assess(replace(ctx, status=status))
    # The source is fenced by now: it counts when running read-only (Demote), or, stopped, when it
    # handed all its WAL over (a switchover's final LSN).
    others = ctx.reachable_voters()
    drained = operation.final_lsn is not None and operation.source not in {m.name for m in others}
    if len(others) + (1 if drained else 0) < promotion_quorum(ctx, operation.source):
        # Decided with a majority; never (re-)issued without one. The quorum is lost meanwhile: report
        # it, and recover from backup when configured and a majority's data is gone (the operation
        # stays recorded until then, so that a returning majority lets the promotion go on).
        ctx = replace(ctx, status=replace(status, operation=operation))
        return recovery.on_quorum_loss(ctx, f"waiting for a majority to promote {target.name}")
    config = steady_config(status.voters, target.name, ctx.quorum_mode)
    status = replace(status, sync=None, sync_pending=config, operation=operation)
    why = f"{operation.kind} from {operation.source}"
    return Outcome(
        phase,
        status,
        (
            *_sync_standbys(target, config, why),
            *early_follow(ctx, operation, target),
            Promote(target.name, reason=why),
        ),
        message=f"promoting {target.name}",
    )


def prepare_promotion(ctx: Context, operation: Operation) -> tuple[Action, ...]:
    """What promote_step will ask of the other members, asked while a switchover's source drains (its
    clean shutdown is the longest part of the write outage): the target's sync standbys, which do
    nothing on a standby, and the other replicas following it as cascading standbys. The promotion
    then is one agent call. Both are harmless if the switchover is abandoned: the steady state points
    a replica at the primary again, and every promotion sets the sync standbys anew."""
    target = ctx.view.member(operation.target) if operation.target else None
    if target is None or not target.reachable or target.role is not Role.REPLICA:
        return ()
    config = steady_config(ctx.status.voters, target.name, ctx.quorum_mode)
    why = f"{operation.kind} from {operation.source}, ahead of the promotion"
    return (*_sync_standbys(target, config, why), *early_follow(ctx, operation, target))


def _sync_standbys(target: MemberView, config: SyncConfig, why: str) -> tuple[Action, ...]:
    """The target's synchronous standbys set to ``config``, unless observed in force already."""
    return () if target.sync == config else (SetSynchronousStandbys(target.name, config, reason=why),)


def early_follow(ctx: Context, operation: Operation, target: MemberView) -> tuple[Action, ...]:
    """The other replicas pointed at the member being promoted, before its promotion rather than once it
    is seen primary: they stream from it as cascading standbys while it promotes and follow its timeline
    switch, so that in quorum mode its first commit, which waits for one of them, does not also wait for
    their reconnection (0.33 s of a 0.85 s switchover on localkube). Only a reachable, unfenced replica
    that holds no more WAL than the target (one holding more needs the rewind the finish step's Rejoin
    decides) and does not already follow it; never the source, nor a member kept on the old major."""
    held = target.held_lsn
    if held is None:
        return ()
    return tuple(
        Rejoin(m.name, target.name, reason=f"follow {target.name}, being promoted", ahead_of_promotion=True)
        for m in ctx.view.existing()
        if m.name not in (target.name, operation.source, ctx.kept_member)
        and m.reachable
        and m.role is Role.REPLICA
        and not m.fenced
        and m.upstream != target.name
        and m.held_lsn is not None
        and m.held_lsn <= held
    )


def finish(ctx: Context, operation: Operation, target: MemberView, phase: Phase) -> Outcome:
    """The new primary is up: record it, point the rw endpoint at it, re-point the others."""
    status = replace(
        ctx.status,
        operation=None,
        current_primary=target.name,
        timeline=target.timeline,
        primary_lost_since=None,
        quorum_lost_since=None,
        votes_since={},
    )
    actions: list[Action] = [SetPrimary(target.name, reason=f"{operation.kind} from {operation.source}")]
    for member in ctx.view.existing():
        # Never the replica kept on the old major after an upgrade: it stays fenced until confirmed.
        if member.name not in (target.name, ctx.kept_member) and (member.reachable or member.fenced):
            actions.append(Rejoin(member.name, target.name, reason=f"new primary {target.name}"))
    return Outcome(phase, status, tuple(actions), message=f"{target.name} is the new primary")
