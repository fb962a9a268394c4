"""Backup: one snapshot of a cluster, taken by a Job, stored in the cluster's S3 store."""

from __future__ import annotations

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
    size: str | None = Field(default=None, description="Size of the data, human readable (e.g. 1.4Gi).")
    stored_size: str | None = Field(default=None, description="Size in the store after compression.")
    size_bytes: int | None = None
    stored_size_bytes: int | None = None
    store_path: str | None = None
    source_member: str | None = None
    verified: bool | None = None
    error: str | None = None


class Backup(ApiModel):
    api_version: Literal["pgherd.io/v1alpha1"] = "pgherd.io/v1alpha1"
    kind: Literal["Backup"] = "Backup"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: BackupSpec
    status: BackupStatus | None = None
