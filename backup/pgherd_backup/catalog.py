"""Finding snapshots: across the system ids of a cluster, complete ones only (those with a manifest)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pgherd_backup.errors import BackupError, ObjectMissing
from pgherd_backup.layout import Layout
from pgherd_backup.manifest import MANIFEST_NAME, Manifest
from pgherd_backup.store import Store


@dataclass(frozen=True)
class Incomplete:
    """A snapshot directory without a manifest: interrupted, failed, or still being written."""

    system_id: str
    id: str


def system_ids(store: Store) -> list[str]:
    return sorted(store.list_prefixes(store.location.cluster_prefix))


def load_manifest(store: Store, system_id: str, snapshot_id: str) -> Manifest:
    key = Layout(store.location, system_id).manifest_key(snapshot_id)
    try:
        data = store.get_bytes(key)
    except ObjectMissing:
        raise BackupError(
            f"snapshot {snapshot_id} of cluster {store.location.cluster!r} (system {system_id}) has no manifest "
            f"at s3://{store.bucket}/{key}: it is incomplete or does not exist; run `pgherd-backup list`"
        ) from None
    return Manifest.from_json(data, origin=f"s3://{store.bucket}/{key}")


def scan(store: Store, system_id: str | None = None) -> tuple[list[Manifest], list[Incomplete]]:
    """All complete snapshots (oldest first) and the incomplete snapshot directories."""
    complete: list[Manifest] = []
    incomplete: list[Incomplete] = []
    for sid in [system_id] if system_id else system_ids(store):
        layout = Layout(store.location, sid)
        manifests = {
            info.key[len(layout.snapshots_prefix) :].split("/", 1)[0]
            for info in store.list_objects(layout.snapshots_prefix)
            if info.key.endswith("/" + MANIFEST_NAME)
        }
        for snap in store.list_prefixes(layout.snapshots_prefix):
            if snap in manifests:
                complete.append(load_manifest(store, sid, snap))
            else:
                incomplete.append(Incomplete(sid, snap))
    complete.sort(key=lambda m: (m.stopped_at, m.id))
    return complete, incomplete


def list_snapshots(store: Store, system_id: str | None = None) -> list[Manifest]:
    return scan(store, system_id)[0]


def find_snapshot(
    store: Store,
    snapshot: str = "latest",
    *,
    system_id: str | None = None,
    not_after: datetime | None = None,
) -> Manifest:
    """The snapshot named `snapshot`, or with "latest" the newest complete one (ending before
    `not_after` when given: the newest snapshot a point-in-time recovery can start from)."""
    cluster = store.location.cluster
    if snapshot != "latest":
        if system_id:
            return load_manifest(store, system_id, snapshot)
        for sid in system_ids(store):
            if store.exists(Layout(store.location, sid).manifest_key(snapshot)):
                return load_manifest(store, sid, snapshot)
        raise BackupError(
            f"no complete snapshot {snapshot!r} for cluster {cluster!r} in {store.location.url()}: "
            "run `pgherd-backup list` to see the snapshots"
        )
    snapshots = list_snapshots(store, system_id)
    if not snapshots:
        raise BackupError(
            f"no complete snapshot for cluster {cluster!r} in {store.location.url()}"
            + (f" (system id {system_id})" if system_id else "")
            + ": take one with `pgherd-backup snapshot`"
        )
    if not_after is not None:
        usable = [m for m in snapshots if m.stopped_at <= not_after]
        if not usable:
            oldest = snapshots[0]
            raise BackupError(
                f"the target time {not_after.isoformat()} is before the end of the oldest snapshot "
                f"({oldest.id}, ended {oldest.stop_time}): no snapshot can reach it; choose a later target"
            )
        return usable[-1]
    return snapshots[-1]
