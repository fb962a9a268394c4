"""The WAL archive: wal-push (archive_command) and wal-fetch (restore_command).

Each archived file is one object `wal/<name>`: a one-line JSON header (codec, size, sha256 of
the original bytes) followed by the compressed bytes, so the object describes itself and the
check needs no S3 metadata support. Pushing is idempotent: the same content under the same name
succeeds, different content under an existing name fails loudly.
"""

from __future__ import annotations

import contextlib
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
from pgherd_backup.walnames import Segment, is_segment, is_wal_name

MAGIC = b"PGHERDWAL1\n"
_HEADER_PROBE = 4096
# Where wal-push records why it last failed (the agent sets it in its PostgreSQL's environment and
# reports the reason in /status while pg_stat_archiver says archiving fails).
ARCHIVE_FAILURE_VARIABLE = "PGHERD_ARCHIVE_FAILURE_FILE"
_FAILURE_MAX = 1000  # characters of a reason kept: a condition's message, not a log


@dataclass(frozen=True)
class WalHeader:
    codec: str
    size: int
    sha256: str

    def encode(self) -> bytes:
        return (
            MAGIC
            + json.dumps({"codec": self.codec, "size": self.size, "sha256": self.sha256}).encode()
            + b"\n"
        )


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


def _download(store: Store, key: str) -> bytes:
    origin = f"s3://{store.bucket}/{key}"
    header, payload = _split(store.get_bytes(key), origin)
    data = Codec.get(header.codec).decompress(bytes(payload), origin)
    if len(data) != header.size or hashlib.sha256(data).hexdigest() != header.sha256:
        raise IntegrityError(
            f"{origin} is corrupted (size or sha256 mismatch): the archived WAL cannot be trusted; "
            "recover from a later snapshot or to an earlier target"
        )
    return data


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".pgherd-tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


def _spool_dir(dest: Path) -> Path | None:
    """Where prefetched segments wait: pg_wal/pgherd-prefetch (never part of a base backup)."""
    for pgdata in (Path.cwd(), dest.absolute().parent.parent):
        if (pgdata / "pg_wal").is_dir() and (pgdata / "global" / "pg_control").exists():
            return pgdata / "pg_wal" / "pgherd-prefetch"
    return None


def fetch(store: Store, name: str, dest: Path, *, system_id: str | None = None, prefetch: int = 0) -> None:
    """Restore one archived WAL file into `dest`; raises ObjectMissing when it is not archived.

    With `prefetch`, the next segments are downloaded in parallel into pg_wal/pgherd-prefetch,
    checked, and handed over by the next calls without a request: recovery replays one segment
    per restore_command, and archived segments never change (wal-push refuses to overwrite).
    """
    if not is_wal_name(name):
        raise UsageError(f"{name!r} is not a WAL file name")
    layout = Layout(store.location, system_id_for(dest, system_id))
    spool = _spool_dir(dest) if prefetch > 0 and is_segment(name) else None
    if spool is not None and (spool / name).exists():
        os.replace(spool / name, dest)
        _drop_older(spool, name)
        return
    _write(dest, _download(store, layout.wal_key(name)))
    if spool is not None:
        _prefetch(store, layout, spool, name, prefetch)


def _drop_older(spool: Path, name: str) -> None:
    for stale in spool.glob("*"):
        if stale.name < name or stale.name.endswith(".pgherd-tmp"):
            stale.unlink(missing_ok=True)


def _prefetch(store: Store, layout: Layout, spool: Path, name: str, count: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    current = Segment.parse(name)
    upcoming = [Segment(current.timeline, current.number + i).name() for i in range(1, count + 1)]
    wanted = [n for n in upcoming if not (spool / n).exists()]
    spool.mkdir(mode=0o700, exist_ok=True)
    _drop_older(spool, name)

    def one(segment: str) -> None:
        # not archived yet, or damaged: the call for that very segment will say so
        with contextlib.suppress(BackupError):
            _write(spool / segment, _download(store, layout.wal_key(segment)))

    with ThreadPoolExecutor(min(4, len(wanted) or 1), thread_name_prefix="prefetch") as pool:
        list(pool.map(one, wanted))


def verify_wal_object(store: Store, key: str) -> None:
    """Check one archived WAL object end to end (header, decompression, size, sha256)."""
    _download(store, key)


__all__ = ["ObjectMissing", "WalHeader", "fetch", "push", "system_id_for", "verify_wal_object"]


def note_archive_outcome(path: str | None, error: str | None) -> None:
    """wal-push's outcome for the agent: the reason of a failure written to `path`, removed after a
    success. Best effort: the archiving itself must never fail for want of this note."""
    if not path:
        return
    with contextlib.suppress(OSError):
        if error is None:
            os.unlink(path)
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(error[:_FAILURE_MAX])
        os.replace(tmp, path)


def archive_failure(path: Path) -> str | None:
    """The reason wal-push last failed, as `note_archive_outcome` wrote it; None without one."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")[:_FAILURE_MAX].strip() or None
    except OSError:
        return None
