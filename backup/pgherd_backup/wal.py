"""The WAL archive: wal-push (archive_command) and wal-fetch (restore_command).

Each archived file is one object `wal/<name>`: a one-line JSON header (codec, size, sha256 of
the original bytes) followed by the compressed bytes, so the object describes itself and the
check needs no S3 metadata support. Pushing is idempotent: the same content under the same name
succeeds, different content under an existing name fails loudly.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pgherd_backup.compression import Codec
from pgherd_backup.errors import BackupError, IntegrityError, ObjectMissing, UsageError
from pgherd_backup.layout import Layout
from pgherd_backup.postgres.control import read_system_id
from pgherd_backup.store import Store
from pgherd_backup.walnames import is_wal_name

MAGIC = b"PGHERDWAL1\n"
_HEADER_PROBE = 4096


@dataclass(frozen=True)
class WalHeader:
    codec: str
    size: int
    sha256: str

    def encode(self) -> bytes:
        return MAGIC + json.dumps({"codec": self.codec, "size": self.size, "sha256": self.sha256}).encode() + b"\n"


def _split(blob: bytes, origin: str) -> tuple[WalHeader, memoryview]:
    if not blob.startswith(MAGIC):
        raise IntegrityError(f"{origin} is not a pgherd WAL object (bad header): the archive is damaged")
    end = blob.find(b"\n", len(MAGIC))
    try:
        raw = json.loads(blob[len(MAGIC) : end])
        header = WalHeader(str(raw["codec"]), int(raw["size"]), str(raw["sha256"]))
    except (ValueError, KeyError) as exc:
        raise IntegrityError(f"{origin} has an unreadable header ({exc}): the archive is damaged") from None
    return header, memoryview(blob)[end + 1 :]


def system_id_for(path: Path, explicit: str | None = None) -> str:
    """The system id of the cluster a WAL path belongs to: from pg_control in the data directory
    (archive_command and restore_command run with the data directory as working directory)."""
    if explicit:
        return explicit
    candidates = [Path.cwd(), path.absolute().parent.parent]
    for pgdata in candidates:
        if (pgdata / "global" / "pg_control").exists():
            return read_system_id(pgdata)
    raise UsageError(
        f"cannot tell the system id for {path}: run from the data directory (as archive_command does) "
        "or pass --system-id"
    )


def push(store: Store, path: Path, *, system_id: str | None = None, codec: Codec | None = None) -> str:
    """Archive one WAL file; returns "archived" or "already archived"."""
    name = path.name
    if not is_wal_name(name):
        raise UsageError(f"{name!r} is not a WAL file name: wal-push archives what PostgreSQL passes as %p")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BackupError(f"cannot read the WAL file {path}: {exc.strerror}") from None
    digest = hashlib.sha256(data).hexdigest()
    layout = Layout(store.location, system_id_for(path, system_id))
    key = layout.wal_key(name)
    origin = f"s3://{store.bucket}/{key}"
    if store.head(key) is not None:
        existing, _ = _split(store.get_bytes(key, (0, _HEADER_PROBE - 1)), origin)
        if existing.sha256 == digest and existing.size == len(data):
            return "already archived"
        raise IntegrityError(
            f"{name} is already archived at {origin} with different content "
            f"(sha256 {existing.sha256[:16]}... vs local {digest[:16]}...): refusing to overwrite it. "
            "Two servers may be archiving into the same place: check PGHERD_STORE / PGHERD_CLUSTER"
        )
    codec = codec or Codec.get("zstd", threads=0)
    header = WalHeader(codec.name, len(data), digest)
    store.put_bytes(key, header.encode() + codec.compress(data))
    return "archived"


def fetch(store: Store, name: str, dest: Path, *, system_id: str | None = None) -> None:
    """Restore one archived WAL file into `dest`; raises ObjectMissing when it is not archived."""
    if not is_wal_name(name):
        raise UsageError(f"{name!r} is not a WAL file name")
    layout = Layout(store.location, system_id_for(dest, system_id))
    key = layout.wal_key(name)
    origin = f"s3://{store.bucket}/{key}"
    blob = store.get_bytes(key)
    header, payload = _split(blob, origin)
    data = Codec.get(header.codec).decompress(bytes(payload), origin)
    if len(data) != header.size or hashlib.sha256(data).hexdigest() != header.sha256:
        raise IntegrityError(
            f"{origin} is corrupted (size or sha256 mismatch): the archived WAL cannot be trusted; "
            "recover from a later snapshot or to an earlier target"
        )
    tmp = dest.with_name(dest.name + ".pgherd-tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
    os.replace(tmp, dest)


def verify_wal_object(store: Store, key: str) -> None:
    """Check one archived WAL object end to end (header, decompression, size, sha256)."""
    blob = store.get_bytes(key)
    origin = f"s3://{store.bucket}/{key}"
    header, payload = _split(blob, origin)
    data = Codec.get(header.codec).decompress(bytes(payload), origin)
    if len(data) != header.size or hashlib.sha256(data).hexdigest() != header.sha256:
        raise IntegrityError(f"{origin} is corrupted (size or sha256 mismatch)")


__all__ = ["ObjectMissing", "WalHeader", "fetch", "push", "system_id_for", "verify_wal_object"]
