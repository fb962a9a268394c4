"""Backups: drive Backup objects through their phases, create scheduled ones, prune after success.

A Pending Backup starts once the cluster has a healthy primary: on a streaming, caught-up replica
when its target is preferStandby and one exists (most WAL first), else on the primary. The snapshot
Job is then followed to Completed or Failed; a Completed backup triggers a Prune when retention is set.
Scheduled backups: the last scheduled run is recorded in status; a Backup named after the due time is
created when the schedule's next run after it has come (one, however many runs were missed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

from croniter import croniter

from pgherd.api.backup import BackupPhase, BackupTarget
from pgherd.engine.actions import Action, CreateBackup, Prune, StartSnapshot, UpdateBackup
from pgherd.engine.conditions import Condition, ConditionType, false, true
from pgherd.engine.context import Context, by_most_data
from pgherd.engine.status import EngineStatus
from pgherd.engine.view import BackupView, JobKind, JobState


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


def next_run(schedule: str, after: datetime) -> datetime:
    value: datetime = croniter(schedule, after).get_next(datetime)
    return value


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
    return BackupWork(status, tuple(actions))


def conditions(ctx: Context) -> list[Condition]:
    out: list[Condition] = []
    spec = ctx.spec.backup
    if spec is not None and spec.archiving_enabled:
        if ctx.view.archiving_healthy is False:
            out.append(false(ConditionType.CONTINUOUS_ARCHIVING, "ArchiveFailing", "WAL archiving fails"))
        else:
            out.append(true(ConditionType.CONTINUOUS_ARCHIVING, "Archiving"))
    else:
        out.append(
            false(ConditionType.CONTINUOUS_ARCHIVING, "Disabled", "no backup store or walArchiving off")
        )
    finished = [b for b in ctx.view.backups if b.phase in (BackupPhase.COMPLETED, BackupPhase.FAILED)]
    if finished:
        last = max(finished, key=lambda b: (b.completed_at or b.created_at or ctx.now, b.name))
        if last.phase == BackupPhase.COMPLETED:
            out.append(true(ConditionType.LAST_BACKUP_SUCCEEDED, "Completed", f"Backup {last.name}"))
        else:
            out.append(false(ConditionType.LAST_BACKUP_SUCCEEDED, "Failed", f"Backup {last.name} failed"))
    return out
