"""Backups: drive Backup objects through their phases, create scheduled ones, prune after success.

A Pending Backup starts once the cluster has a healthy primary: on a streaming, caught-up replica
when its target is preferStandby and one exists (most WAL first), else on the primary. The snapshot
Job is then followed to Completed or Failed; a Completed backup triggers a Prune when retention is set.
A Job whose pod has not started after ``backup.jobStartTimeoutSeconds`` (the adapter reports since
when it waits, and why) fails its Backup with that reason, rather than waiting for the Job's deadline.
Scheduled backups: the last scheduled run is recorded in status; a Backup named after the due time is
created when the schedule's next run after it has come (one, however many runs were missed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from croniter import croniter

from pgherd.api.backup import BackupPhase, BackupTarget, expired_refusal
from pgherd.api.cluster import JOB_START_TIMEOUT_SECONDS, OnQuorumLoss
from pgherd.engine.actions import Action, CreateBackup, Prune, StartSnapshot, UpdateBackup
from pgherd.engine.conditions import Condition, ConditionType, false, true
from pgherd.engine.context import Context, by_most_data
from pgherd.engine.status import EngineStatus
from pgherd.engine.view import BackupView, JobKind, JobState, JobView


@dataclass(frozen=True)
class BackupWork:
    status: EngineStatus
    actions: tuple[Action, ...]


def source_member(ctx: Context, backup: BackupView) -> str | None:
    primary = ctx.healthy_primary()
    if primary is None:
        return None
    if backup.target == BackupTarget.PREFER_STANDBY:
        standbys = [m for m in ctx.healthy_replicas() if ctx.caught_up(m)]
        if standbys:
            return min(standbys, key=by_most_data).name
    return primary.name


def unrestorable(backup: BackupView | None, name: str) -> str | None:
    """Why Backup ``name`` (``backup``: its view, None when this cluster has none of that name) cannot be
    restored, or None: only a Completed Backup can; an Expired one is refused with when and why."""
    if backup is None:
        return f"Backup {name} is not found; only a Completed backup can be restored"
    if backup.phase == BackupPhase.EXPIRED:
        return expired_refusal(name, iso_time(backup.expired_at))
    if backup.phase != BackupPhase.COMPLETED:
        return f"Backup {name} is in phase {backup.phase}; only a Completed backup can be restored"
    return None


def iso_time(at: datetime | None) -> str | None:
    """A time as the API writes it: 2026-01-01T10:00:00Z."""
    return None if at is None else at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def next_run(schedule: str, after: datetime) -> datetime:
    value: datetime = croniter(schedule, after).get_next(datetime)
    return value


def not_started(ctx: Context, job: JobView) -> str | None:
    """The error of a snapshot job whose pod has waited ``backup.jobStartTimeoutSeconds`` to start, with
    the platform's reason (a missing Secret, an image that cannot be pulled, no node for it); None while
    it may still start. Whatever the reason: a slow image pull is given the same time, no less."""
    if job.waiting_since is None:
        return None
    backup = ctx.spec.backup
    limit = backup.job_start_timeout_seconds if backup is not None else JOB_START_TIMEOUT_SECONDS
    if ctx.now - job.waiting_since < timedelta(seconds=limit):
        return None
    why = job.waiting_reason or "no reason reported"
    return f"the snapshot Job's pod did not start within {limit} s (backup.jobStartTimeoutSeconds): {why}"


def plan(ctx: Context, status: EngineStatus) -> BackupWork:
    actions: list[Action] = []
    spec = ctx.spec.backup
    if spec is not None and spec.store is not None and spec.schedule:
        last = status.last_scheduled_backup
        if last is None:
            status = replace(status, last_scheduled_backup=ctx.now)  # the schedule starts counting now
        elif next_run(spec.schedule, last) <= ctx.now:
            due = next_run(spec.schedule, last)
            while next_run(spec.schedule, due) <= ctx.now:
                due = next_run(spec.schedule, due)
            name = f"{ctx.view.cluster}-{due:%Y%m%d%H%M}"
            if ctx.view.backup(name) is None:
                actions.append(CreateBackup(name, reason=f"schedule {spec.schedule}"))
            status = replace(status, last_scheduled_backup=due)
    for backup in sorted(ctx.view.backups, key=lambda b: b.name):
        if backup.phase == BackupPhase.PENDING:
            member = source_member(ctx, backup)
            if member is not None:
                actions.append(StartSnapshot(backup.name, member, reason="Backup requested"))
                actions.append(UpdateBackup(backup.name, BackupPhase.RUNNING, source_member=member))
        elif backup.phase == BackupPhase.RUNNING:
            job = ctx.view.job(JobKind.SNAPSHOT, backup.name)
            if job is None:
                member = backup.source_member or source_member(ctx, backup)
                if member is not None:
                    actions.append(StartSnapshot(backup.name, member, reason="snapshot job not found"))
            elif job.state is JobState.SUCCEEDED:
                actions.append(UpdateBackup(backup.name, BackupPhase.COMPLETED, source_member=job.member))
                retention = spec.retention if spec is not None else None
                if retention is not None and (retention.keep_last or retention.keep_within):
                    actions.append(
                        Prune(retention.keep_last, retention.keep_within, reason=f"after {backup.name}")
                    )
            elif job.state is JobState.FAILED:
                error = job.message or "the snapshot job failed"
                actions.append(UpdateBackup(backup.name, BackupPhase.FAILED, error=error))
            elif (stuck := not_started(ctx, job)) is not None:
                actions.append(UpdateBackup(backup.name, BackupPhase.FAILED, error=stuck))
    return BackupWork(status, tuple(actions))


def conditions(ctx: Context) -> list[Condition]:
    out: list[Condition] = []
    spec = ctx.spec.backup
    if spec is not None and spec.archiving_enabled:
        if ctx.view.archiving_healthy is False:
            why = f": {ctx.view.archiving_error}" if ctx.view.archiving_error else ""
            out.append(
                false(ConditionType.CONTINUOUS_ARCHIVING, "ArchiveFailing", f"WAL archiving fails{why}")
            )
        else:
            out.append(true(ConditionType.CONTINUOUS_ARCHIVING, "Archiving"))
    else:
        out.append(
            false(ConditionType.CONTINUOUS_ARCHIVING, "Disabled", "no backup store or walArchiving off")
        )
    # An Expired Backup completed (retention deleted its snapshot later): it counts as a success.
    succeeded = (BackupPhase.COMPLETED, BackupPhase.EXPIRED)
    finished = [b for b in ctx.view.backups if b.phase in (*succeeded, BackupPhase.FAILED)]
    if finished:
        last = max(finished, key=lambda b: (b.completed_at or b.created_at or ctx.now, b.name))
        if last.phase in succeeded:
            out.append(true(ConditionType.LAST_BACKUP_SUCCEEDED, "Completed", f"Backup {last.name}"))
        else:
            out.append(false(ConditionType.LAST_BACKUP_SUCCEEDED, "Failed", f"Backup {last.name} failed"))
    recovery = ctx.spec.recovery
    if recovery.on_quorum_loss is OnQuorumLoss.RESTORE_FROM_BACKUP and recovery.backup != "latest":
        out.append(recovery_backup(ctx, recovery.backup))
    return out


def recovery_backup(ctx: Context, name: str) -> Condition:
    """RecoveryBackupAvailable: whether the Backup recovery.backup names can be restored, reported as
    soon as it cannot (an Expired one: its snapshot deleted by retention) rather than when the quorum is
    lost and the automatic recovery needs it."""
    backup = ctx.view.backup(name)
    refusal = unrestorable(backup, name)
    if refusal is None:
        return true(ConditionType.RECOVERY_BACKUP_AVAILABLE, "Completed", f"recovery.backup: Backup {name}")
    if backup is None:
        reason = "BackupNotFound"
    elif backup.phase == BackupPhase.EXPIRED:
        reason = "BackupExpired"
    elif backup.phase == BackupPhase.FAILED:
        reason = "BackupFailed"
    else:
        reason = "BackupNotCompleted"
    return false(ConditionType.RECOVERY_BACKUP_AVAILABLE, reason, f"recovery.backup: {refusal}")
