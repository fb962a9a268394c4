"""The Backup and Restore objects a person would write (examples/backup.yaml, examples/restore-pitr.yaml),
checked first with what the API server and the engine would refuse anyway, in words."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pgherd.api.backup import unrestorable
from pgherd.engine.lsn import parse_lsn
from pgherd.engine.view import parse_time
from pgherd.kube import names
from pgherd.plugin.errors import PluginError

JSON = dict[str, Any]


def backup_name(cluster: str, now: datetime) -> str:
    return f"{cluster}-{now:%Y%m%d%H%M%S}"


def backup(cluster: Mapping[str, Any], name: str, target: str | None = None) -> JSON:
    meta, spec = cluster.get("metadata") or {}, cluster.get("spec") or {}
    if not (spec.get("backup") or {}).get("store"):
        raise PluginError(
            f"{meta.get('name')} has no backup store (spec.backup.store): a Backup of it would fail; set one first"
        )
    body: JSON = {"cluster": {"name": meta.get("name")}}
    if target:
        body["target"] = target
    return {
        "apiVersion": names.API_VERSION,
        "kind": "Backup",
        "metadata": {"name": name, "namespace": meta.get("namespace")},
        "spec": body,
    }


def restore(
    cluster: Mapping[str, Any],
    name: str,
    *,
    backup: Mapping[str, Any] | None = None,
    backup_name: str | None = None,
    snapshot: str | None = None,
    time: str | None = None,
    lsn: str | None = None,
) -> JSON:
    """A Restore of ``cluster`` from Backup ``backup_name`` (its object ``backup``, None when missing) or
    from snapshot id ``snapshot``, to ``time`` or ``lsn`` (else the end of the archived WAL)."""
    meta = cluster.get("metadata") or {}
    if (backup_name is None) == (snapshot is None):
        raise PluginError("name one of --backup and --snapshot")
    if time is not None and lsn is not None:
        raise PluginError("name at most one of --time and --lsn")
    spec: JSON = {"cluster": {"name": meta.get("name")}}
    if backup_name is not None:
        refused = unrestorable(backup_name, None if backup is None else (backup.get("status") or {}))
        if refused is not None:
            raise PluginError(refused)
        owner = ((backup or {}).get("spec") or {}).get("cluster", {}).get("name")
        if owner != meta.get("name"):
            raise PluginError(f"Backup {backup_name!r} is of cluster {owner!r}, not {meta.get('name')!r}")
        spec["backup"] = backup_name
    else:
        if not ((cluster.get("spec") or {}).get("backup") or {}).get("store"):
            raise PluginError(
                f"{meta.get('name')} has no backup store (spec.backup.store) to find snapshot {snapshot} in"
            )
        spec["snapshotId"] = snapshot
    if time is not None:
        moment = parse_time(time)
        if moment is None or moment.tzinfo is None:
            raise PluginError(
                f"--time {time!r}: expected an RFC 3339 time with its zone, e.g. 2026-11-21T10:41:59Z"
            )
        spec["target"] = {"time": time}
    if lsn is not None:
        try:
            parse_lsn(lsn)
        except ValueError as exc:
            raise PluginError(f"--lsn: {exc}") from None
        spec["target"] = {"lsn": lsn}
    return {
        "apiVersion": names.API_VERSION,
        "kind": "Restore",
        "metadata": {"name": name, "namespace": meta.get("namespace")},
        "spec": spec,
    }
