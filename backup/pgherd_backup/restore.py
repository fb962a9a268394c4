"""Restore a snapshot into an empty data directory, then write the recovery settings.

Parts are downloaded in parallel by byte range and each is checked against its sha256 before a
single byte of it is decompressed; one thread decompresses in order, the calling thread untars.
Every object's sha256 and size are checked too. On any failure the directory is emptied again,
so nothing half-restored can be started. PostgreSQL is never started here.
"""

from __future__ import annotations

import hashlib
import os
import queue
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from pgherd_backup.basefiles import CONTROL, LABEL, check_base_files
from pgherd_backup.catalog import find_snapshot
from pgherd_backup.compression import Codec, read_checked
from pgherd_backup.errors import BackupError, IntegrityError, UsageError
from pgherd_backup.layout import Layout
from pgherd_backup.manifest import LEGACY_FORMAT, DataObject, Manifest
from pgherd_backup.postgres.config import Setting, write_recovery_config
from pgherd_backup.postgres.process import give_to_pg, owner_ids
from pgherd_backup.progress import Progress
from pgherd_backup.store import Store
from pgherd_backup.tarstream import extract
from pgherd_backup.walnames import Segment, format_lsn, parse_lsn, segment_number_of

_BLOCK = 1 << 20


@dataclass(frozen=True)
class RecoveryTarget:
    """Where recovery stops (then promotes); all None: replay the whole archive."""

    time: datetime | None = None
    lsn: str | None = None
    immediate: bool = False

    def __post_init__(self) -> None:
        if sum([self.time is not None, self.lsn is not None, self.immediate]) > 1:
            raise UsageError("give at most one of --target-time, --target-lsn, --target-immediate")
        if self.time is not None and self.time.tzinfo is None:
            raise UsageError("--target-time needs a time zone (e.g. 2025-01-31T12:00:00+00:00)")
        if self.lsn is not None:
            try:
                parse_lsn(self.lsn)
            except ValueError as exc:
                raise UsageError(str(exc)) from None

    @property
    def is_set(self) -> bool:
        return self.time is not None or self.lsn is not None or self.immediate

    def settings(self) -> dict[str, Setting]:
        if self.time is not None:
            return {"recovery_target_time": self.time.isoformat(sep=" ")}
        if self.lsn is not None:
            return {"recovery_target_lsn": format_lsn(parse_lsn(self.lsn))}
        if self.immediate:
            return {"recovery_target": "immediate"}
        return {}


@dataclass(frozen=True)
class RestoreOptions:
    download_workers: int = 4
    prefetch_parts: int = 5
    sync: bool = True
    check_wal: bool = True


def ensure_empty(pgdata: Path) -> None:
    if pgdata.exists() and (not pgdata.is_dir() or any(pgdata.iterdir())):
        raise UsageError(
            f"refusing to restore into {pgdata}: it is not an empty directory. "
            "Restore into an empty or new directory (move the old data aside first)"
        )


def check_target(manifest: Manifest, target: RecoveryTarget) -> None:
    """A target before the end of the snapshot cannot be reached from it."""
    if target.time is not None and target.time < manifest.stopped_at:
        raise BackupError(
            f"the target time {target.time.isoformat()} is before the end of snapshot {manifest.id} "
            f"({manifest.stop_time}): recovery cannot go back in time; pick an older snapshot "
            "(or --snapshot latest, which picks one) or a later target"
        )
    if target.lsn is not None and parse_lsn(target.lsn) < parse_lsn(manifest.stop_lsn):
        raise BackupError(
            f"the target LSN {target.lsn} is before the end of snapshot {manifest.id} ({manifest.stop_lsn}): "
            "pick an older snapshot or a later target"
        )


def check_wal_coverage(store: Store, manifest: Manifest, target: RecoveryTarget) -> None:
    """For a time or LSN target, the archive must hold every segment from the snapshot's end to the
    target: a gap would stop recovery short of it."""
    if target.time is None and target.lsn is None:
        return
    layout = Layout(store.location, manifest.system_id)
    present: dict[int, datetime] = {}
    for info in store.list_objects(layout.wal_prefix):
        name = info.key[len(layout.wal_prefix) :]
        number = segment_number_of(name)
        if number is None or name.endswith((".partial", ".backup")):
            continue
        if int(name[:8], 16) >= manifest.timeline:
            present[number] = max(present.get(number, info.last_modified), info.last_modified)
    number = Segment.parse(manifest.stop_wal).number
    last = Segment.of_lsn(0, parse_lsn(target.lsn)).number if target.lsn is not None else None
    while True:
        if number not in present:
            missing = Segment(manifest.timeline, number).name()
            raise BackupError(
                f"WAL segment {missing} is missing from the archive s3://{store.bucket}/{layout.wal_prefix}: "
                f"recovery from snapshot {manifest.id} cannot reach the requested target. Check that WAL "
                "archiving works (archive_command, pg_stat_archiver) or choose an earlier target"
            )
        if last is not None and number >= last:
            return
        if target.time is not None and present[number] >= target.time:
            return  # archived after the target time: the records around the target are in the archive
        number += 1


def agent_executable() -> str:
    """Absolute path of pgherd-backup (restore_command must not depend on the server's PATH)."""
    import sys

    beside = Path(sys.executable).parent / "pgherd-backup"
    if beside.exists():
        return str(beside)
    found = shutil.which("pgherd-backup")
    return str(Path(found).resolve()) if found else "pgherd-backup"


class PartFetcher:
    """Downloads parts ahead of the reader (bounded), each checked against its sha256."""

    def __init__(self, store: Store, manifest: Manifest, options: RestoreOptions) -> None:
        self.store = store
        self.layout = Layout(store.location, manifest.system_id)
        self.manifest = manifest
        self.pool = ThreadPoolExecutor(options.download_workers, thread_name_prefix="download")
        self.ahead = options.prefetch_parts
        self.tasks: list[tuple[DataObject, int, int]] = []
        for obj in manifest.objects:
            offset = 0
            for index, part in enumerate(obj.parts):
                self.tasks.append((obj, index, offset))
                offset += part.size
        self.futures: dict[int, Future[bytes]] = {}
        self.next_submit = 0

    def url(self, obj: DataObject) -> str:
        return f"s3://{self.store.bucket}/{self.layout.data_key(self.manifest.id, obj.name)}"

    def _download(self, obj: DataObject, index: int, offset: int) -> bytes:
        part = obj.parts[index]
        key = self.layout.data_key(self.manifest.id, obj.name)
        data = self.store.get_bytes(key, (offset, offset + part.size - 1)) if part.size else b""
        if len(data) != part.size or hashlib.sha256(data).hexdigest() != part.sha256:
            raise IntegrityError(
                f"object {self.url(obj)} is corrupted (part {index + 1}: size or sha256 "
                f"mismatch): snapshot {self.manifest.id} cannot be trusted; restore another snapshot "
                "(`pgherd-backup list`) and run `pgherd-backup verify`"
            )
        return data

    def get(self, position: int) -> bytes:
        while self.next_submit < len(self.tasks) and self.next_submit < position + self.ahead:
            self.futures[self.next_submit] = self.pool.submit(self._download, *self.tasks[self.next_submit])
            self.next_submit += 1
        return self.futures.pop(position).result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class ChainSource:
    """File-like view of the snapshot's verified bytes, object after object, in order; each object's
    size and sha256 are checked as it ends (its parts were checked before this sees them)."""

    def __init__(self, fetcher: PartFetcher) -> None:
        self.fetcher = fetcher
        self.objects = fetcher.manifest.objects
        self.index = 0  # the object being read
        self.part = 0  # the next part of the snapshot to fetch
        self.left = len(self.objects[0].parts) if self.objects else 0
        self.buffer = memoryview(b"")
        self.sha256 = hashlib.sha256()
        self.size = 0

    @property
    def current(self) -> str:
        """The object being read (the last one once all are read)."""
        if not self.objects:
            return f"snapshot {self.fetcher.manifest.id}"
        return self.fetcher.url(self.objects[min(self.index, len(self.objects) - 1)])

    def read(self, size: int = -1) -> bytes:
        while not self.buffer:
            if self.index >= len(self.objects):
                return b""
            if not self.left:
                self._end_object()
                continue
            data = self.fetcher.get(self.part)
            self.part += 1
            self.left -= 1
            self.sha256.update(data)
            self.size += len(data)
            self.buffer = memoryview(data)
        size = len(self.buffer) if size is None or size < 0 else size
        chunk, self.buffer = self.buffer[:size], self.buffer[size:]
        return bytes(chunk)

    def _end_object(self) -> None:
        obj = self.objects[self.index]
        if self.size != obj.size or self.sha256.hexdigest() != obj.sha256:
            raise IntegrityError(
                f"object {self.current} does not match its manifest (size or sha256): the snapshot is damaged"
            )
        self.index += 1
        self.sha256, self.size = hashlib.sha256(), 0
        self.left = len(self.objects[self.index].parts) if self.index < len(self.objects) else 0

    def drain(self) -> None:
        """Read (and so check) whatever the decoder did not need, to the last object's end."""
        while self.read(_BLOCK):
            pass


class Decompressor(threading.Thread):
    """Decompresses the snapshot's objects, read as one stream, into a bounded queue of blocks."""

    def __init__(self, fetcher: PartFetcher) -> None:
        super().__init__(daemon=True, name="decompress")
        self.manifest = fetcher.manifest
        self.fetcher = fetcher
        self.blocks: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=8)
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            codec = Codec.get(self.manifest.compression)
            source = ChainSource(self.fetcher)
            reader = codec.reader(source)
            raw = 0
            while not self.stopping.is_set():
                block = read_checked(reader, _BLOCK, source.current)
                if not block:
                    break
                raw += len(block)
                self._put(block)
            if self.stopping.is_set():
                return
            source.drain()
            if self.manifest.format == LEGACY_FORMAT and raw != self.manifest.size:
                raise IntegrityError(
                    f"snapshot {self.manifest.id} decompresses to {raw} bytes, not {self.manifest.size}: "
                    "it is damaged"
                )
            self._put(None)
        except BaseException as exc:  # handed to the reader thread, which raises it
            self._put(exc)

    def _put(self, item: bytes | BaseException | None) -> None:
        while not self.stopping.is_set():
            try:
                self.blocks.put(item, timeout=0.2)
                return
            except queue.Full:
                continue


class QueueReader:
    def __init__(self, blocks: queue.Queue[bytes | BaseException | None]) -> None:
        self.blocks = blocks
        self.item = b""
        self.offset = 0
        self.eof = False

    def read(self, size: int = -1) -> bytes:
        if self.offset >= len(self.item):
            if self.eof:
                return b""
            item = self.blocks.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                self.eof = True
                return b""
            self.item, self.offset = item, 0
        if self.offset == 0 and (size < 0 or size >= len(self.item)):
            self.offset = len(self.item)
            return self.item  # the whole block: no copy
        end = len(self.item) if size < 0 else self.offset + size
        chunk = self.item[self.offset : end]
        self.offset += len(chunk)
        return chunk


def sync_tree(root: Path, workers: int = 8) -> None:
    """fsync every file, then every directory, of `root` (in parallel: the kernel has been writing
    them back in the meantime): the restored files are on disk before anyone starts PostgreSQL."""
    files: list[str] = []
    dirs: list[str] = []
    for current, _subdirs, names in os.walk(root):
        dirs.append(current)
        files.extend(os.path.join(current, n) for n in names if not os.path.islink(os.path.join(current, n)))

    def fsync(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(workers, thread_name_prefix="fsync") as pool:
        list(pool.map(fsync, files))
    for directory in reversed(dirs):
        fsync(directory)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _empty(pgdata: Path) -> None:
    for child in pgdata.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def restore_files(
    store: Store,
    manifest: Manifest,
    pgdata: Path,
    *,
    options: RestoreOptions | None = None,
    progress: Progress | None = None,
) -> None:
    """Download, verify and extract the snapshot's files into the empty directory `pgdata`."""
    options = options or RestoreOptions()
    ensure_empty(pgdata)
    created = not pgdata.exists()
    pgdata.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(pgdata, 0o700)
    give_to_pg(pgdata)
    uid, gid = owner_ids()
    fetcher = PartFetcher(store, manifest, options)
    decompressor = Decompressor(fetcher)
    ok = False
    if progress is not None:
        progress.set_total(manifest.size)
    report: Callable[[int], None] | None = progress.update if progress is not None else None
    try:
        decompressor.start()
        reader = QueueReader(decompressor.blocks)
        extract(reader, pgdata, uid=uid, gid=gid, progress=report)
        while reader.read(_BLOCK):  # past the tar's end marker: the last checks' verdict comes next
            pass
        decompressor.join()
        check_base_files(manifest, _read(pgdata / LABEL), _read(pgdata / CONTROL), f"the restored {pgdata}")
        if options.sync:
            sync_tree(pgdata)
        ok = True
    finally:
        decompressor.stopping.set()
        fetcher.close()
        if not ok:
            _empty(pgdata)
            if created:
                shutil.rmtree(pgdata, ignore_errors=True)
    if progress is not None:
        progress.finish()


def restore(
    store: Store,
    pgdata: Path,
    *,
    snapshot: str = "latest",
    system_id: str | None = None,
    target: RecoveryTarget | None = None,
    options: RestoreOptions | None = None,
    progress: Progress | None = None,
    restore_command: str | None = None,
) -> Manifest:
    """Restore a snapshot into `pgdata` and set it up to recover from the archive to `target`,
    then promote. Returns the snapshot's manifest."""
    from pgherd_backup.postgres.config import restore_command as make_restore_command

    target = target or RecoveryTarget()
    options = options or RestoreOptions()
    ensure_empty(pgdata)
    store.check()
    manifest = find_snapshot(store, snapshot, system_id=system_id, not_after=target.time)
    check_target(manifest, target)
    if options.check_wal:
        check_wal_coverage(store, manifest, target)
    restore_files(store, manifest, pgdata, options=options, progress=progress)
    command = restore_command or make_restore_command(
        agent_executable(), store.location.url(), store.location.cluster
    )
    write_recovery_config(pgdata, restore_command=command, target=target.settings())
    return manifest


def iter_parts(manifest: Manifest) -> Iterator[tuple[DataObject, int]]:
    for obj in manifest.objects:
        for index in range(len(obj.parts)):
            yield obj, index
