"""Backups whose snapshot retention deleted (phase Expired): never restored, refused at once by name."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from pgherd.api.cluster import Phase, PostgresClusterSpec
from pgherd.engine import BackupView, ClusterView, EngineStatus, RestoreView, decide
from pgherd.engine import actions as A
from pgherd.engine.conditions import ConditionType

from .builders import CLUSTER, NOW, down, later, lost_primary, make_spec, settled, with_members

STORE = {"store": {"s3": {"bucket": "bkt", "credentials": {"secretName": "s3"}}}}
EXPIRED_AT = NOW - timedelta(hours=2)
REFUSAL = (
    "Backup old is Expired (its snapshot was deleted by retention at 2026-01-01T10:00:00Z);"
    " choose another Backup"
)


def expired(name: str = "old", completed_days: float = 2) -> BackupView:
    return BackupView(
        name, phase="Expired", completed_at=NOW - timedelta(days=completed_days), expired_at=EXPIRED_AT
    )


def completed(name: str, completed_days: float) -> BackupView:
    return BackupView(name, phase="Completed", completed_at=NOW - timedelta(days=completed_days))


def test_a_restore_naming_an_expired_backup_is_refused_at_once_with_the_reason() -> None:
    spec, view, status = settled(make_spec(backup=STORE))
    view = replace(
        view, backups=(expired(), completed("new", 1)), restores=(RestoreView("r1", backup="old"),)
    )
    d = decide(spec, view, status)
    # Nothing fenced, nothing restored: only the Restore failed, saying which Backup, why and since when.
    assert d.actions == (A.UpdateRestore("r1", "Failed", error=REFUSAL),)
    assert d.status.operation is None
    assert REFUSAL in d.message


def test_latest_never_picks_an_expired_backup() -> None:
    spec, view, status = _quorum_lost({"onQuorumLoss": "RestoreFromBackup"})
    # "newer" completed last but retention deleted its snapshot since: "older" is the latest restorable.
    view = replace(view, backups=(completed("older", 3), expired("newer", completed_days=1)))
    restore = _automatic_restore(spec, view, status)
    assert restore is not None and restore.backup == "older"


def test_no_automatic_restore_when_every_backup_expired() -> None:
    spec, view, status = _quorum_lost({"onQuorumLoss": "RestoreFromBackup"})
    view = replace(view, backups=(expired("a", 3), expired("b", 2)))
    assert _automatic_restore(spec, view, status) is None


def test_recovery_backup_naming_an_expired_backup_is_reported_at_once_and_never_restored() -> None:
    spec, view, status = settled(
        make_spec(backup=STORE, recovery={"onQuorumLoss": "RestoreFromBackup", "backup": "old"})
    )
    view = replace(view, backups=(expired(), completed("new", 1)))
    d = decide(spec, view, status)
    assert d.phase is Phase.RUNNING  # a report, not a failure of the running cluster
    (condition,) = [c for c in d.conditions if c.type is ConditionType.RECOVERY_BACKUP_AVAILABLE]
    assert condition.status is False and condition.reason == "BackupExpired"
    assert condition.message == f"recovery.backup: {REFUSAL}"
    # When the quorum is lost, the automatic recovery never restores that snapshot.
    spec, lost, status = _quorum_lost({"onQuorumLoss": "RestoreFromBackup", "backup": "old"})
    assert _automatic_restore(spec, replace(lost, backups=view.backups), status) is None


def test_recovery_backup_naming_a_completed_backup_is_available() -> None:
    spec, view, status = settled(
        make_spec(backup=STORE, recovery={"onQuorumLoss": "RestoreFromBackup", "backup": "new"})
    )
    d = decide(spec, replace(view, backups=(expired(), completed("new", 1))), status)
    (condition,) = [c for c in d.conditions if c.type is ConditionType.RECOVERY_BACKUP_AVAILABLE]
    assert condition.status is True and "new" in condition.message
    # `latest` (the default) names no Backup: no such condition.
    spec, view, status = settled(make_spec(backup=STORE, recovery={"onQuorumLoss": "RestoreFromBackup"}))
    d = decide(spec, replace(view, backups=(expired(),)), status)
    assert not [c for c in d.conditions if c.type is ConditionType.RECOVERY_BACKUP_AVAILABLE]


def test_bootstrap_from_an_expired_backup_is_refused_at_once() -> None:
    spec = make_spec(backup=STORE, bootstrap={"fromBackup": {"backup": "old"}})
    d = decide(spec, ClusterView(CLUSTER, NOW, backups=(expired(),)), EngineStatus())
    assert d.actions == ()  # no member created from a snapshot that is gone
    assert d.phase is Phase.FAILED
    assert REFUSAL.removesuffix("; choose another Backup") in d.message
    assert "bootstrap.fromBackup" in d.message


def test_an_expired_backup_still_counts_as_a_backup_that_succeeded() -> None:
    spec, view, status = settled(make_spec(backup=STORE))
    d = decide(spec, replace(view, backups=(expired(completed_days=1),)), status)
    (condition,) = [c for c in d.conditions if c.type is ConditionType.LAST_BACKUP_SUCCEEDED]
    assert condition.status is True


def _quorum_lost(recovery: dict[str, object]) -> tuple[PostgresClusterSpec, ClusterView, EngineStatus]:
    """pg-0 (the primary) and pg-1 lost with their volumes, pg-2 left: the evidence an automatic restore
    needs (see test_scaling_recovery_backups)."""
    spec, view, status = settled(make_spec(backup=STORE, recovery=recovery))
    gone = [replace(down(m), exists=False, data_present=False) for m in view.members[:2]]
    return spec, with_members(view, *gone, lost_primary(view.members[2])), status


def _automatic_restore(
    spec: PostgresClusterSpec, view: ClusterView, status: EngineStatus
) -> A.StartRestore | None:
    """Drive the automatic recovery past its grace period and fence: the StartRestore it asks for."""
    d = decide(spec, view, status)
    d = decide(spec, later(view, 60), d.status)
    fenced = with_members(later(view, 61), *[replace(m, fenced=True, stopped=True) for m in view.members])
    d = decide(spec, fenced, d.status)
    found = [a for a in d.actions if isinstance(a, A.StartRestore)]
    return found[0] if found else None
