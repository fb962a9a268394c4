"""verify: re-read every object of a snapshot (sizes, sha256 of every part and object, the
decompression, the tar structure to its end marker, backup_label and pg_control against the
manifest) without restoring anything."""

from __future__ import annotations

from dataclasses import dataclass

from pgherd_backup.basefiles import CONTROL, LABEL, check_base_files
from pgherd_backup.errors import IntegrityError
from pgherd_backup.manifest import Manifest
from pgherd_backup.progress import Progress
from pgherd_backup.restore import Decompressor, PartFetcher, QueueReader, RestoreOptions
from pgherd_backup.store import Store
from pgherd_backup.tarstream import TarTap


@dataclass(frozen=True)
class VerifyReport:
    snapshot: str
    objects: int
    stored_bytes: int
    raw_bytes: int

    def as_dict(self) -> dict[str, object]:
        return {
            "snapshot": self.snapshot,
            "ok": True,
            "objects": self.objects,
            "stored_bytes": self.stored_bytes,
            "raw_bytes": self.raw_bytes,
        }


def verify_snapshot(
    store: Store,
    manifest: Manifest,
    *,
    options: RestoreOptions | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Raise IntegrityError (naming the object) on the first damaged object."""
    fetcher = PartFetcher(store, manifest, options or RestoreOptions())
    decompressor = Decompressor(fetcher)
    reader = QueueReader(decompressor.blocks)
    tap = TarTap((LABEL, CONTROL))
    raw = 0
    if progress is not None:
        progress.set_total(manifest.size)
    try:
        decompressor.start()
        while True:
            block = reader.read()
            if not block:
                break
            raw += len(block)
            tap.feed(block)
            if progress is not None:
                progress.update(raw)
        decompressor.join()
    finally:
        decompressor.stopping.set()
        fetcher.close()
    origin = f"snapshot {manifest.id}'s tar stream"
    if not tap.ended:
        raise IntegrityError(f"{origin} has no end marker: it is truncated")
    check_base_files(manifest, tap.files.get(LABEL), tap.files.get(CONTROL), origin)
    if progress is not None:
        progress.finish()
    return VerifyReport(manifest.id, len(manifest.objects), manifest.stored_size, raw)
