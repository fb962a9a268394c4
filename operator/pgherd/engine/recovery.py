"""Majority failure and in-place restore: QuorumLost, then (when asked) rebuild from a snapshot.

With a majority of the voters unreachable nothing is ever promoted: the reachable replicas might all
miss acknowledged commits. The engine reports QuorumLost and waits, unless recovery is asked for:

* ``recovery.onQuorumLoss: RestoreFromBackup``, the primary unavailable too, the quorum lost for at
  least ``recovery_grace``, AND positive evidence that a majority of the voters' data is gone (the
  platform reports their volume or data directory lost: ``MemberView.data_present`` False). Mere
  unreachability is never evidence: members cut off from the operator may hold acknowledged commits
  that no archive has yet, and a restore would roll them back. Without the evidence the engine reports
  and waits; a person can still apply a Restore (phase Recovering);
* a Restore object (phase Restoring; its own phases follow the steps below).

Steps of the Recovery / Restore operation:

``fence``    Fence every member until each is confirmed unable to write (gone, stopped, or read-only):
             nothing may write while the cluster is rebuilt.
``restore``  StartRestore into member 0: its data directory is moved aside (never deleted), the
             snapshot fetched and verified, archived WAL replayed to the target, then promotion onto a
             new timeline (Restore phases Restoring, then Replaying).
``promote``  When member 0 is observed primary: rw endpoint, voters reset to it alone.
``rebuild``  Re-clone every other member from it (Rejoin with reclone: their data kept aside), create
             missing ones; done when all stream from it (Restore phase Rebuilding, then Completed).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from pgherd.api.backup import BackupPhase
from pgherd.api.cluster import OnQuorumLoss, Phase
from pgherd.api.restore import RestorePhase
from pgherd.engine import upgrade
from pgherd.engine.actions import (
    Action,
    Fence,
    Promote,
    SetPrimary,
    SetSynchronousStandbys,
    StartRestore,
    UpdateRestore,
)
from pgherd.engine.backups import unrestorable
from pgherd.engine.context import Context, Outcome, cannot_write, data_lost
from pgherd.engine.quorum import ASYNC
from pgherd.engine.status import Operation, OperationKind
from pgherd.engine.view import BackupView, JobKind, JobState, RestoreView


def recovery_grace(ctx: Context) -> timedelta:
    """How long the quorum must stay lost before an automatic restore: a restore discards the WAL
    after the chosen target, so a short network split must not trigger it."""
    return max(timedelta(seconds=15), 3 * ctx.detection)


def latest_backup(ctx: Context, wanted: str) -> BackupView | None:
    """The Completed Backup named ``wanted``, or the most recent Completed one for ``latest``. An Expired
    Backup (its snapshot deleted by retention) is never one: see ``unrestorable``."""
    done = [b for b in ctx.view.backups if b.phase == BackupPhase.COMPLETED]
    if wanted != "latest":
        return next((b for b in done if b.name == wanted), None)
    if not done:
        return None
    return max(done, key=lambda b: (b.completed_at or b.created_at or ctx.now, b.name))


def on_quorum_loss(ctx: Context, why: str) -> Outcome:
    """A majority of the voters is unreachable: report it, and recover from backup when configured."""
    since = ctx.status.quorum_lost_since or ctx.now
    status = replace(ctx.status, quorum_lost_since=since)
    reachable, total = len(ctx.reachable_voters()), len(ctx.status.voters)
    base = f"{why}; {reachable} of {total} members reachable, {ctx.needed()} needed. Nothing is promoted"
    if ctx.spec.recovery.on_quorum_loss is not OnQuorumLoss.RESTORE_FROM_BACKUP:
        return Outcome(Phase.QUORUM_LOST, status, message=f"{base}; waiting for members to return")
    if ctx.healthy_primary() is not None:
        return Outcome(Phase.QUORUM_LOST, status, message=f"{base}; the primary is up: waiting for members")
    if ctx.status.aborted is not None and ctx.status.aborted.kind is OperationKind.RECOVERY:
        return Outcome(Phase.QUORUM_LOST, status, message=f"{base}; the last automatic recovery failed")
    lost = [m.name for m in ctx.voter_views() if data_lost(m)]
    if len(lost) < ctx.needed():
        evidence = f"data lost on {', '.join(lost)}" if lost else "no member's data is known to be lost"
        return Outcome(
            Phase.QUORUM_LOST,
            status,
            message=f"{base}; no automatic restore: {evidence} ({ctx.needed()} needed). The members may"
            " hold commits the archive lacks; apply a Restore to restore anyway",
        )
    remaining = recovery_grace(ctx) - (ctx.now - since)
    if remaining > timedelta(0):
        return Outcome(
            Phase.QUORUM_LOST,
            status,
            message=f"{base}; restoring from backup in {remaining.total_seconds():.0f}s if still lost",
        )
    backup = latest_backup(ctx, ctx.spec.recovery.backup)
    if backup is None:
        return Outcome(
            Phase.QUORUM_LOST,
            status,
            message=f"{base}; no Completed backup '{ctx.spec.recovery.backup}' to restore from",
        )
    operation = Operation(
        OperationKind.RECOVERY,
        started_at=ctx.now,
        restore=f"{ctx.view.cluster}-recovery-{ctx.now:%Y%m%d%H%M%S}",
        backup=backup.name,
        plan=tuple(m.name for m in ctx.view.existing()),
        reason=f"quorum lost since {since.isoformat()}",
    ).at("fence", ctx.now)
    return advance(replace(ctx, status=replace(status, operation=operation, aborted=None)), operation)


def pending_restore(ctx: Context) -> RestoreView | None:
    pending = [r for r in ctx.view.restores if r.phase == RestorePhase.PENDING]
    return min(pending, key=lambda r: (r.created_at or ctx.now, r.name)) if pending else None


def _target_text(restore: RestoreView) -> str | None:
    if restore.target_lsn:
        return f"lsn:{restore.target_lsn}"
    if restore.target_time:
        return f"time:{restore.target_time}"
    if restore.target_immediate:
        return "immediate"
    return None


def refusal(ctx: Context, restore: RestoreView) -> UpdateRestore | None:
    """The Restore's own failure when it cannot be carried out (its Backup missing, not Completed,
    Expired): the Restore fails at once and the cluster goes on as it was (never Failed for it)."""
    if restore.backup is None:
        return None
    error = unrestorable(ctx.view.backup(restore.backup), restore.backup)
    return None if error is None else UpdateRestore(restore.name, RestorePhase.FAILED, error=error)


def start_restore(ctx: Context, restore: RestoreView) -> Outcome:
    """A Restore object asks for an in-place restore (one refusal() accepts): record the operation, begin."""
    operation = Operation(
        OperationKind.RESTORE,
        started_at=ctx.now,
        restore=restore.name,
        backup=restore.backup,
        snapshot_id=restore.snapshot_id,
        recovery_target=_target_text(restore),
        plan=tuple(m.name for m in ctx.view.existing()),
        reason=f"Restore {restore.name}",
    ).at("fence", ctx.now)
    return advance(replace(ctx, status=replace(ctx.status, operation=operation, aborted=None)), operation)


def advance(ctx: Context, operation: Operation) -> Outcome:
    phase = Phase.RESTORING if operation.kind is OperationKind.RESTORE else Phase.RECOVERING
    # A restore rebuilds every member from the snapshot: a replica kept on the old major after an
    # upgrade is no way back any more (its data is kept aside like any member's).
    status = replace(ctx.status, operation=operation, kept=None)
    actions: list[Action] = []
    restore_view = next((r for r in ctx.view.restores if r.name == operation.restore), None)

    assert operation.restore is not None
    job_name = operation.restore

    def report(
        restore_phase: RestorePhase, error: str | None = None, restored_timeline: int | None = None
    ) -> None:
        changed = restore_view is None or restore_view.phase != restore_phase
        if operation.kind is OperationKind.RESTORE and (changed or error or restored_timeline):
            actions.append(UpdateRestore(job_name, restore_phase, error, restored_timeline))

    if operation.step == "fence":
        report(RestorePhase.FENCING)
        actions += _fences(ctx, operation, keep=None)
        waiting = _may_write(ctx)
        chosen = _restore_target(ctx)
        if waiting or chosen is None:
            why = (
                f"fencing {', '.join(waiting)}"
                if waiting
                else "waiting for a member whose agent answers, to restore into"
            )
            return Outcome(phase, status, tuple(actions), why + _missing_note(ctx))
        operation = replace(operation.at("restore", ctx.now), target=chosen)
        status = replace(status, operation=operation)
        actions.clear()
    if operation.step in ("restore", "promote"):
        # A member that returns meanwhile stays fenced until the rebuild re-clones it.
        actions += _fences(ctx, operation, keep=operation.target)
    if operation.step == "restore":
        job = ctx.view.job(JobKind.RESTORE, job_name)
        if job is None or job.state is JobState.RUNNING:
            replaying = job is not None and job.stage == "replaying"
            report(RestorePhase.REPLAYING if replaying else RestorePhase.RESTORING)
            if job is None:
                actions.append(
                    StartRestore(
                        job_name,
                        str(operation.target),
                        operation.backup,
                        operation.snapshot_id,
                        operation.recovery_target,
                        reason=operation.reason,
                    )
                )
            what = "replaying WAL" if replaying else f"restoring {operation.backup or operation.snapshot_id}"
            return Outcome(
                phase, status, tuple(actions), f"{what} into {operation.target}{_missing_note(ctx)}"
            )
        if job.state is JobState.FAILED:
            error = job.message or "the restore job failed"
            actions.clear()
            report(RestorePhase.FAILED, error=error)
            status = replace(status, operation=None, aborted=replace(operation, failed=error))
            return Outcome(
                Phase.FAILED, status, tuple(actions), f"restore into {operation.target} failed: {error}"
            )
        operation = operation.at("promote", ctx.now)
        status = replace(status, operation=operation)
    target = ctx.view.member(operation.target)
    if operation.step == "promote":
        if data_lost(target):
            error = f"the restored data of {operation.target} was lost before it started"
            actions.clear()
            report(RestorePhase.FAILED, error=error)
            status = replace(status, operation=None, aborted=replace(operation, failed=error))
            return Outcome(Phase.FAILED, status, tuple(actions), f"{operation.kind} failed: {error}")
        if target is None or not target.reachable:
            return Outcome(
                phase,
                status,
                tuple(actions),
                f"waiting for {operation.target} to start after the restore",
            )
        if not target.is_primary:
            actions.append(Promote(target.name, reason=operation.reason))
            return Outcome(phase, status, tuple(actions), "promoting")
        operation = operation.at("rebuild", ctx.now)
        status = replace(
            status,
            operation=operation,
            current_primary=target.name,
            timeline=target.timeline,
            # A snapshot taken before a major upgrade brings the data back on its own major (and a
            # postgresVersion above it upgrades the cluster again, as for any cluster behind its spec).
            major=target.data_major or ctx.status.major,
            voters=frozenset({target.name}),
            sync=None,
            sync_pending=ASYNC,
            primary_lost_since=None,
            votes_since={},
            quorum_lost_since=None,
        )
        status = upgrade.restored(ctx, status, operation.reason)
        actions.clear()
        report(RestorePhase.REBUILDING, restored_timeline=target.timeline)
        actions += [
            SetPrimary(target.name, reason=operation.reason),
            SetSynchronousStandbys(target.name, ASYNC),
        ]
        return Outcome(phase, status, tuple(actions), f"{target.name} restored on timeline {target.timeline}")
    if operation.step == "rebuild":
        return _rebuild(replace(ctx, status=status), operation, phase)
    raise AssertionError(f"unknown recovery step {operation.step!r}")


def _rebuild(ctx: Context, operation: Operation, phase: Phase) -> Outcome:
    from pgherd.engine import membership  # the rebuild is ordinary membership upkeep plus re-clones

    primary = ctx.healthy_primary()
    if primary is None:
        # The restored primary failed during the rebuild: the ordinary failure handling takes over.
        status = replace(ctx.status, operation=None)
        return Outcome(phase, status, message=f"restored primary {operation.target} is not available")
    # The restored member is the primary now: only the others are re-cloned from it, each once: a
    # member seen streaming from it is rebuilt (operation.done), and a stream that drops later (a WAL
    # receiver reconnecting) is ordinary upkeep, never a second re-clone of a fresh copy.
    rebuilt = tuple(n for n in operation.plan if n not in operation.done and _streams(ctx, n))
    if rebuilt:
        operation = replace(operation, done=operation.done + rebuilt)
        ctx = replace(ctx, status=replace(ctx.status, operation=operation))
    replaced = frozenset(operation.plan) - {primary.name} - frozenset(operation.done)
    upkeep = membership.maintain(ctx, reclone=replaced)
    behind = [n for n in ctx.expected_names() if n != primary.name and not _streams(ctx, n)]
    # A member with nothing running (its pod not scheduled, its node gone) does not hold the cluster
    # back: it is reported, and re-cloned once it returns (status.rebuildPending).
    absent = [n for n in behind if _absent(ctx, n)]
    missing = [n for n in behind if n not in absent]
    if missing:
        return replace(
            upkeep,
            phase=phase,
            message=f"rebuilding {', '.join(missing)} from {primary.name}{_missing_note(ctx)}",
        )
    actions: list[Action] = list(upkeep.actions)
    if operation.kind is OperationKind.RESTORE:
        actions.append(UpdateRestore(str(operation.restore), RestorePhase.COMPLETED))
    pending = frozenset(n for n in absent if n in replaced) | upkeep.status.rebuild_pending
    status = replace(upkeep.status, operation=None, rebuild_pending=pending)
    message = f"{operation.kind} {operation.restore} completed"
    if absent:
        message += f"; {', '.join(absent)} not running: rebuilt from {primary.name} when they return"
    # Done: the phase is the cluster's own again (Running, or Degraded while members are missing).
    return Outcome(upkeep.phase, status, tuple(actions), message)


def _absent(ctx: Context, name: str) -> bool:
    member = ctx.view.member(name)
    return member is None or member.absent


def _may_write(ctx: Context) -> list[str]:
    """Members that may still accept writes: nothing may write while the cluster is restored. A member
    counts as fenced once it provably cannot write: nothing of it runs (absent), its volume is lost, its
    agent reports it fenced and stopped or read-only. A member whose agent answers but is not fenced yet
    is waited for too (it answers a Fence at once); one that is merely starting is waited for, never
    killed: a starting agent does not run PostgreSQL read-write on its own."""
    waiting = []
    for member in ctx.view.existing():
        if member.absent or data_lost(member):
            continue
        if not cannot_write(member) or (member.reachable and not member.fenced):
            waiting.append(member.name)
    return waiting


def _fences(ctx: Context, operation: Operation, keep: str | None) -> list[Action]:
    """A Fence for every member that is not fenced and not absent (the platform skips one whose agent is
    not up yet, and asks again at the next tick), but ``keep``: the member being restored."""
    return [
        Fence(m.name, reason=operation.reason)
        for m in ctx.view.existing()
        if m.name != keep and not m.fenced and not m.absent
    ]


def _restore_target(ctx: Context) -> str | None:
    """The member to restore into: the lowest ordinal whose agent answers under a fence (the agent
    restores only under one), or answers for an empty volume (the platform fences it first). A member
    that is absent or still starting is never chosen: it may never come back."""
    candidates = [
        m
        for m in ctx.view.members
        if ctx.wanted(m.name)
        and not m.absent
        and ((m.exists and m.fenced) or (not m.exists and data_lost(m)))
    ]
    return min(candidates, key=lambda m: m.ordinal).name if candidates else None


def _missing_note(ctx: Context) -> str:
    absent = [n for n in ctx.expected_names() if _absent(ctx, n)]
    return f" ({', '.join(absent)} not running)" if absent else ""


def _streams(ctx: Context, name: str) -> bool:
    member = ctx.view.member(name)
    return (
        member is not None
        and ctx.status.current_primary is not None
        and member.streams_from(ctx.status.current_primary)
    )
