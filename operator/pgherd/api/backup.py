"""Backup: one snapshot of a cluster, taken by a Job, stored in the cluster's S3 store."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal

from pydantic import ConfigDict, Field

from pgherd.api.common import ApiModel, ObjectRef, StatusModel, cel, rule

KIND = "Backup"
PLURAL = "backups"
SINGULAR = "backup"
SHORT_NAMES = ["pgbackup"]


class BackupTarget(StrEnum):
    PREFER_STANDBY = "preferStandby"
    PRIMARY = "primary"


class BackupPhase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    COMPLETED = "Completed"
    FAILED = "Failed"
    # Completed once, then retention (backup.retention) deleted its snapshot: nothing left to restore.
    EXPIRED = "Expired"


class BackupSpec(ApiModel):
    model_config = ConfigDict(
        json_schema_extra=cel(rule("self == oldSelf", "a Backup's spec is immutable: create a new Backup"))
    )

    cluster: ObjectRef = Field(description="The PostgresCluster to back up.")
    target: BackupTarget = Field(
        default=BackupTarget.PREFER_STANDBY,
        description="Where to take the snapshot: a streaming standby when one is caught up, or the primary.",
    )


class BackupStatus(StatusModel):
    phase: BackupPhase = BackupPhase.PENDING
    backup_id: str | None = None
    started_at: str | None = None
    completed_at: str | None = None
    start_lsn: str | None = Field(default=None, alias="startLSN")
    end_lsn: str | None = Field(default=None, alias="endLSN")
    timeline: int | None = None
    postgres_version: str | None = Field(
        default=None,
        description="The server version the snapshot was taken from (MAJOR.MINOR): its data restores on"
        " that major, also after the cluster was upgraded to a later one.",
    )
    size: str | None = Field(default=None, description="Size of the data, human readable (e.g. 1.4Gi).")
    stored_size: str | None = Field(default=None, description="Size in the store after compression.")
    size_bytes: int | None = None
    stored_size_bytes: int | None = None
    store_path: str | None = None
    source_member: str | None = None
    verified: bool | None = None
    error: str | None = None
    expired_at: str | None = Field(
        default=None, description="When retention deleted the snapshot (phase Expired)."
    )
    message: str | None = Field(
        default=None,
        description="Why the Backup is in its phase, when that needs saying: for Expired, the retention"
        " that deleted its snapshot.",
    )


class Backup(ApiModel):
    api_version: Literal["pgherd.io/v1alpha1"] = "pgherd.io/v1alpha1"
    kind: Literal["Backup"] = "Backup"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: BackupSpec
    status: BackupStatus | None = None


def human_size(size: int | None) -> str | None:
    """1536 -> '1.5Ki' (the Backup's readable sizes; the exact ones are sizeBytes, storedSizeBytes)."""
    if size is None:
        return None
    amount = float(size)
    for unit in ("", "Ki", "Mi", "Gi", "Ti"):
        if amount < 1024 or unit == "Ti":
            return f"{amount:.0f}{unit}" if unit == "" else f"{amount:.1f}{unit}"
        amount /= 1024
    return None


def status_from_summary(summary: Mapping[str, Any], store_url: str | None = None) -> dict[str, Any]:
    """A Backup's status fields from the JSON summary `pgherd-backup snapshot` prints (and a snapshot
    Job leaves as its termination message), on every platform: the snapshot's id, LSNs, timeline,
    sizes (readable strings as the CRD declares them, and exact bytes), where it is stored, and, with
    `--verify`, whether every object read back (false: the reason in `error`)."""
    if not summary.get("id"):
        return {}
    store = store_url or summary.get("store")
    fields: dict[str, Any] = {
        "backupId": summary.get("id"),
        "startLSN": summary.get("start_lsn"),
        "endLSN": summary.get("stop_lsn"),
        "timeline": summary.get("timeline"),
        "postgresVersion": summary.get("pg_version"),
        "sizeBytes": summary.get("size"),
        "storedSizeBytes": summary.get("stored_size"),
        "size": human_size(summary.get("size")),
        "storedSize": human_size(summary.get("stored_size")),
        "storePath": (
            f"{store}/{summary.get('cluster')}/{summary.get('system_id')}/snapshots/{summary['id']}/"
            if store and summary.get("cluster")
            else None
        ),
    }
    if isinstance(summary.get("verified"), bool):
        fields["verified"] = summary["verified"]
        if not summary["verified"]:
            fields["error"] = f"verify failed: {summary.get('verify_error') or 'unknown'}"
    return {key: value for key, value in fields.items() if value is not None}


def retention_text(keep_last: int | None, keep_within: str | None) -> str:
    """backup.retention as a person wrote it: 'keepLast: 3, keepWithin: 7d'."""
    parts = [f"keepLast: {keep_last}"] if keep_last is not None else []
    parts += [f"keepWithin: {keep_within}"] if keep_within else []
    return ", ".join(parts) or "retention"


def expired_status(snapshot_id: str, at: str, retention: str, after: str | None = None) -> dict[str, Any]:
    """The status fields of a Backup whose snapshot retention deleted at ``at``, on every platform:
    phase Expired, ``expiredAt``, and in ``message`` which retention did it (and after which Backup)."""
    why = f"its snapshot {snapshot_id} was deleted by retention ({retention})"
    if after:
        why += f" after Backup {after}"
    return {"phase": BackupPhase.EXPIRED.value, "expiredAt": at, "message": why}


def expired_refusal(name: str, expired_at: str | None) -> str:
    """Why a Restore, bootstrap.fromBackup or recovery.backup naming an Expired Backup is refused."""
    when = f" at {expired_at}" if expired_at else ""
    return f"Backup {name} is Expired (its snapshot was deleted by retention{when}); choose another Backup"


def unrestorable(name: str, status: Mapping[str, Any] | None) -> str | None:
    """Why Backup ``name`` (its status as stored, None when there is no such Backup) cannot be restored,
    or None when it can: it must hold a snapshot id (set when it completed), and not be Expired."""
    if status is None:
        return f"Backup {name!r} not found: no snapshot to restore"
    phase = status.get("phase") or BackupPhase.PENDING.value
    if phase == BackupPhase.EXPIRED:
        return expired_refusal(name, status.get("expiredAt"))
    if not status.get("backupId"):
        return f"Backup {name!r} has no completed snapshot to restore (phase {phase})"
    return None
