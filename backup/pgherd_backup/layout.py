"""Where things live in the bucket.

    s3://<bucket>/<path>/<cluster>/<system-id>/snapshots/<id>/data/00000.tar.zst ...
    s3://<bucket>/<path>/<cluster>/<system-id>/snapshots/<id>/manifest.json   (written last)
    s3://<bucket>/<path>/<cluster>/<system-id>/wal/<wal file name>

Keyed by system id, so a cluster re-created under the same name never mixes with the archive of
its previous life, while an in-place restore (same system id) continues its own archive on a new
timeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from pgherd_backup.manifest import MANIFEST_NAME
from pgherd_backup.store import StoreLocation


@dataclass(frozen=True)
class Layout:
    location: StoreLocation
    system_id: str

    @property
    def root(self) -> str:
        return self.location.system_prefix(self.system_id)

    @property
    def snapshots_prefix(self) -> str:
        return f"{self.root}snapshots/"

    def snapshot_prefix(self, snapshot_id: str) -> str:
        return f"{self.snapshots_prefix}{snapshot_id}/"

    def manifest_key(self, snapshot_id: str) -> str:
        return f"{self.snapshot_prefix(snapshot_id)}{MANIFEST_NAME}"

    def data_key(self, snapshot_id: str, name: str) -> str:
        return f"{self.snapshot_prefix(snapshot_id)}{name}"

    @property
    def wal_prefix(self) -> str:
        return f"{self.root}wal/"

    def wal_key(self, wal_name: str) -> str:
        return f"{self.wal_prefix}{wal_name}"
