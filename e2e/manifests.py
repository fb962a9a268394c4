"""Small builders of the manifests the scenarios apply: the same objects a user writes by hand."""

from __future__ import annotations

from typing import Any

API_VERSION = "pgherd.io/v1alpha1"

# Failure detection for the scenarios: short, so that the suite stays within its CI budget.
DETECTION_SECONDS = 3


def cluster(
    name: str,
    *,
    postgres_version: int,
    instances: int = 3,
    mode: str | None = "quorum",
    detection_seconds: int = DETECTION_SECONDS,
    parameters: dict[str, str] | None = None,
    database: str = "app",
    owner: str = "app",
    backup_schedule: str | None = None,
    keep_last: int | None = None,
    on_quorum_loss: str | None = None,
    recovery_backup: str = "latest",
    **spec: Any,
) -> dict[str, Any]:
    """A PostgresCluster with small storage and short failure detection; `spec` adds or overrides fields.

    `backup_schedule` (5-field cron, UTC) and `keep_last` set spec.backup's schedule and retention (the
    driver supplies the store); `on_quorum_loss` (Wait or RestoreFromBackup) sets spec.recovery, from
    `recovery_backup` (latest, or a Backup's name)."""
    body: dict[str, Any] = {
        "instances": instances,
        "postgresVersion": postgres_version,
        "storage": {"size": "1Gi"},
        "failover": {"enabled": True, "detectionSeconds": detection_seconds},
        "bootstrap": {"initdb": {"database": database, "owner": owner}},
    }
    if mode is not None:
        body["replication"] = {"mode": mode}
    if parameters:
        body["parameters"] = dict(parameters)
    backup: dict[str, Any] = {}
    if backup_schedule is not None:
        backup["schedule"] = backup_schedule
    if keep_last is not None:
        backup["retention"] = {"keepLast": keep_last}
    if backup:
        body["backup"] = backup
    if on_quorum_loss is not None:
        body["recovery"] = {"onQuorumLoss": on_quorum_loss, "backup": recovery_backup}
    body.update(spec)
    return {"apiVersion": API_VERSION, "kind": "PostgresCluster", "metadata": {"name": name}, "spec": body}


def with_changes(manifest: dict[str, Any], **spec: Any) -> dict[str, Any]:
    """A copy of a PostgresCluster manifest with some spec fields replaced (scaling, parameters)."""
    changed = {**manifest, "spec": {**manifest["spec"], **spec}}
    changed["metadata"] = dict(manifest["metadata"])
    return changed


def backup(name: str, cluster_name: str, *, target: str = "preferStandby") -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "Backup",
        "metadata": {"name": name},
        "spec": {"cluster": {"name": cluster_name}, "target": target},
    }


def restore(
    name: str, cluster_name: str, *, backup_name: str, time: str | None = None, immediate: bool = False
) -> dict[str, Any]:
    """An in-place Restore of `cluster_name` from the Backup `backup_name`, to `time` (RFC 3339) when given,
    to the snapshot alone with `immediate`, else to the end of the archived WAL."""
    spec: dict[str, Any] = {"cluster": {"name": cluster_name}, "backup": backup_name}
    if time is not None:
        spec["target"] = {"time": time}
    elif immediate:
        spec["target"] = {"immediate": True}
    return {"apiVersion": API_VERSION, "kind": "Restore", "metadata": {"name": name}, "spec": spec}
