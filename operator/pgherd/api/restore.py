"""Restore: in-place disaster recovery of an existing cluster from one of its snapshots."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import ConfigDict, Field

from pgherd.api.common import NAME_PATTERN, ApiModel, ObjectRef, RecoveryTarget, StatusModel, cel, rule

KIND = "Restore"
PLURAL = "restores"
SINGULAR = "restore"
SHORT_NAMES = ["pgrestore"]


class RestorePhase(StrEnum):
    PENDING = "Pending"
    FENCING = "Fencing"
    RESTORING = "Restoring"
    REPLAYING = "Replaying"
    REBUILDING = "Rebuilding"
    COMPLETED = "Completed"
    FAILED = "Failed"


class RestoreSpec(ApiModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            rule("has(self.backup) != has(self.snapshotId)", "set exactly one of backup, snapshotId"),
            rule("self == oldSelf", "a Restore's spec is immutable: create a new Restore"),
        )
    )

    cluster: ObjectRef = Field(description="The PostgresCluster to restore in place.")
    backup: str | None = Field(default=None, pattern=NAME_PATTERN, description="A Backup object to restore.")
    snapshot_id: str | None = Field(
        default=None, min_length=1, description="A snapshot id in the cluster's store."
    )
    target: RecoveryTarget | None = Field(
        default=None, description="Where replay stops; the end of the archived WAL when unset."
    )


class RestoreProgress(StatusModel):
    bytes_done: int = 0
    bytes_total: int | None = None


class RestoreStatus(StatusModel):
    phase: RestorePhase = RestorePhase.PENDING
    progress: RestoreProgress | None = None
    snapshot_id: str | None = None
    restored_timeline: int | None = None
    started_at: str | None = None
    completed_at: str | None = None
    kept_data: list[str] | None = Field(
        default=None, description="Where the survivors' data directories were kept aside."
    )
    error: str | None = None


class Restore(ApiModel):
    api_version: Literal["pgherd.io/v1alpha1"] = "pgherd.io/v1alpha1"
    kind: Literal["Restore"] = "Restore"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: RestoreSpec
    status: RestoreStatus | None = None
