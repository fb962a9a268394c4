"""A new cluster: create member 0 (initdb, or from a snapshot for bootstrap.fromBackup), then record it
as the first primary. The other members follow through ordinary membership upkeep (phase Creating
until all of them have streamed and joined the quorum once)."""

from __future__ import annotations

from dataclasses import replace

from pgherd.api.backup import BackupPhase, expired_refusal
from pgherd.api.cluster import Phase
from pgherd.engine.actions import CreateMember, Seed, SetPrimary
from pgherd.engine.backups import iso_time
from pgherd.engine.context import Context, Outcome
from pgherd.engine.view import member_name


def step(ctx: Context) -> Outcome:
    first = member_name(ctx.view.cluster, 0)
    member = ctx.view.member(first)
    from_backup = ctx.spec.effective_bootstrap.from_backup
    if member is None or not member.exists:
        if from_backup is None:
            create = CreateMember(first, 0, Seed.INITDB, ctx.revision, reason="new cluster")
            return Outcome(Phase.CREATING, ctx.status, (create,), f"initializing {first}")
        if from_backup.backup is not None:
            backup = ctx.view.backup(from_backup.backup)
            if backup is not None and backup.phase == BackupPhase.EXPIRED:
                # Nothing to start from, ever: bootstrap is immutable, so the cluster is made again.
                refusal = expired_refusal(from_backup.backup, iso_time(backup.expired_at))
                return Outcome(
                    Phase.FAILED,
                    ctx.status,
                    message=f"bootstrap.fromBackup: {refusal.removesuffix('; choose another Backup')};"
                    " bootstrap cannot change: create the cluster again from another Backup or a snapshotId",
                )
            if backup is not None and backup.phase != BackupPhase.COMPLETED:
                return Outcome(
                    Phase.PENDING,
                    ctx.status,
                    message=f"waiting for Backup {from_backup.backup} to complete (phase {backup.phase})",
                )
        target = from_backup.target
        target_text = None
        if target is not None:
            target_text = (
                f"lsn:{target.lsn}" if target.lsn else f"time:{target.time}" if target.time else "immediate"
            )
        create = CreateMember(
            first,
            0,
            Seed.SNAPSHOT,
            ctx.revision,
            source=from_backup.backup,
            snapshot_id=from_backup.snapshot_id,
            target=target_text,
            reason="bootstrap.fromBackup",
        )
        return Outcome(Phase.CREATING, ctx.status, (create,), f"restoring {first} from a snapshot")
    if not member.is_primary:
        return Outcome(
            Phase.CREATING, ctx.status, message=f"waiting for {first} to start as the first primary"
        )
    status = replace(
        ctx.status,
        initialized=True,
        current_primary=first,
        timeline=member.timeline,
        voters=frozenset({first}),
        sync=member.sync,
    )
    return Outcome(Phase.CREATING, status, (SetPrimary(first, reason="first primary"),), f"{first} is up")
