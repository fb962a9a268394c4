"""Take a snapshot: pg_basebackup's tar stream, cut into objects, compressed on the fly and sent
as S3 multipart uploads (parts uploaded in parallel), then the manifest, written last.

Memory is bounded by `max_inflight_parts * part_size` plus the compressor's buffers, whatever
the database size: the reader blocks when uploads fall behind, and pg_basebackup blocks on its
pipe in turn.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime

from pgherd_backup.compression import Codec, Compressor
from pgherd_backup.errors import BackupError, IntegrityError, PostgresError
from pgherd_backup.layout import Layout
from pgherd_backup.manifest import DataObject, Manifest, Part, format_time, now_utc, snapshot_id
from pgherd_backup.postgres.binaries import PgBinaries
from pgherd_backup.postgres.control import system_id_from_control
from pgherd_backup.progress import Progress
from pgherd_backup.source import SourceInfo, identify
from pgherd_backup.store import Store
from pgherd_backup.tarstream import TarTap
from pgherd_backup.walnames import Segment, parse_lsn

_F_SETPIPE_SZ = 1031
_READ_BLOCK = 1 << 20
_FRAME_INPUT = 4 << 20  # input per independent frame for the codecs without multi-threading
_TAPPED = ("backup_label", "backup_manifest", "PG_VERSION", "global/pg_control")


@dataclass(frozen=True)
class SnapshotOptions:
    codec: Codec = field(default_factory=lambda: Codec.get("zstd"))
    object_raw_size: int = 1 << 30
    part_size: int = 8 << 20
    upload_workers: int = 4
    max_inflight_parts: int = 6
    wal_method: str = "fetch"
    checkpoint: str = "fast"
    max_rate: str | None = None  # pg_basebackup --max-rate, e.g. "100M": spare the source's disks
    archive_wait: float = 120.0  # with wal_method "none": how long to wait for start..stop to be archived
    verify_checksums: bool = True  # the server checks every page's checksum while sending it


class _Uploads:
    """Bounded, parallel part uploads; the first failure is raised in the reader thread."""

    def __init__(self, store: Store, options: SnapshotOptions) -> None:
        self.store = store
        self.pool = ThreadPoolExecutor(options.upload_workers, thread_name_prefix="upload")
        self.slots = threading.Semaphore(options.max_inflight_parts)
        self.pending: deque[Future[tuple[str, Part]]] = deque()
        self.uploaded = 0

    def submit(self, key: str, upload_id: str, number: int, data: bytes) -> Future[tuple[str, Part]]:
        self.raise_failures()
        self.slots.acquire()

        def work() -> tuple[str, Part]:
            try:
                digest = hashlib.sha256(data).hexdigest()
                etag = self.store.upload_part(key, upload_id, number, data, digest)
                self.uploaded += len(data)
                return etag, Part(len(data), digest)
            finally:
                self.slots.release()

        future = self.pool.submit(work)
        self.pending.append(future)
        return future

    def raise_failures(self) -> None:
        while self.pending and self.pending[0].done():
            self.pending.popleft().result()
        for future in self.pending:
            if future.done() and future.exception() is not None:
                future.result()

    def close(self, cancel: bool) -> None:
        self.pool.shutdown(wait=True, cancel_futures=cancel)


class _ObjectWriter:
    """One data object, uploaded part by part: a single multi-threaded zstd frame, or for the
    other codecs a run of independent frames (4 MiB of input each) compressed on a thread pool."""

    def __init__(
        self,
        store: Store,
        uploads: _Uploads,
        key: str,
        name: str,
        options: SnapshotOptions,
        pool: ThreadPoolExecutor,
        hasher: ThreadPoolExecutor,
    ) -> None:
        self.store = store
        self.uploads = uploads
        self.key = key
        self.name = name
        self.options = options
        codec = options.codec
        self.compressor: Compressor | None = codec.compressor() if codec.name == "zstd" else None
        self.pool = pool
        self.hasher = hasher  # one thread: hashes the parts in order, off the reading thread
        self.block = bytearray()
        self.blocks: deque[Future[bytes]] = deque()
        self.buffer = bytearray()
        self.raw_size = 0
        self.size = 0
        self.sha256 = hashlib.sha256()
        self.hashing: Future[None] | None = None
        self.upload_id: str | None = None
        self.futures: list[Future[tuple[str, Part]]] = []

    def write(self, data: memoryview) -> None:
        self.raw_size += len(data)
        if self.compressor is not None:
            self.buffer += self.compressor.compress(data)
        else:
            self.block += data
            if len(self.block) >= _FRAME_INPUT:
                self._submit_block()
            self._collect(wait=len(self.blocks) > 2 * (os.cpu_count() or 1))
        if len(self.buffer) >= self.options.part_size:
            self._cut()

    def _submit_block(self) -> None:
        block = bytes(self.block)
        self.block.clear()
        self.blocks.append(self.pool.submit(self.options.codec.compress, block))

    def _collect(self, wait: bool) -> None:
        while self.blocks and (wait or self.blocks[0].done()):
            self.buffer += self.blocks.popleft().result()
            wait = False

    def _cut(self) -> None:
        part = bytes(self.buffer)
        self.buffer.clear()
        if self.upload_id is None:
            self.upload_id = self.store.start_multipart(self.key)
        self.hashing = self.hasher.submit(self.sha256.update, part)
        self.size += len(part)
        self.futures.append(self.uploads.submit(self.key, self.upload_id, len(self.futures) + 1, part))

    def seal(self) -> None:
        """The end of this object's input: compress what is left and send the last part."""
        if self.compressor is not None:
            self.buffer += self.compressor.flush()
        else:
            if self.block:
                self._submit_block()
            while self.blocks:
                self._collect(wait=True)
        self._cut()

    def complete(self) -> DataObject:
        """Wait for the parts, then complete the upload (runs beside the reader: on some servers
        completing assembles the object, which takes a while)."""
        assert self.upload_id is not None and self.hashing is not None
        results = [f.result() for f in self.futures]
        self.hashing.result()
        self.store.complete_multipart(self.key, self.upload_id, [etag for etag, _ in results])
        self.upload_id = None
        return DataObject(
            name=self.name,
            size=self.size,
            raw_size=self.raw_size,
            sha256=self.sha256.hexdigest(),
            parts=tuple(part for _, part in results),
        )

    def abort(self) -> None:
        if self.upload_id is not None:
            self.store.abort_multipart(self.key, self.upload_id)


class _StderrWatcher(threading.Thread):
    """Collects pg_basebackup's messages and its progress estimate (-P) without blocking it."""

    def __init__(self, stream: object, progress: Progress | None) -> None:
        super().__init__(daemon=True, name="pg_basebackup-stderr")
        self.stream = stream
        self.progress = progress
        self.lines: list[str] = []

    def run(self) -> None:
        pending = b""
        read = self.stream.read1 if hasattr(self.stream, "read1") else self.stream.read  # type: ignore[attr-defined]
        while True:
            data: bytes = read(4096)
            if not data:
                break
            pending += data
            *complete, pending = re.split(rb"[\r\n]", pending)
            for raw in complete:
                self._line(raw.decode(errors="replace"))
        if pending:
            self._line(pending.decode(errors="replace"))

    def _line(self, line: str) -> None:
        match = re.match(r"\s*\d+/(\d+) kB", line)
        if match:
            if self.progress is not None:
                self.progress.set_total(int(match.group(1)) * 1024)
            return
        if line.strip():
            self.lines.append(line.strip())

    def tail(self, count: int = 6) -> str:
        useful = [line for line in self.lines if "pg_basebackup: " in line or "error" in line.lower()]
        return " | ".join((useful or self.lines)[-count:])

    def end_lsn(self) -> str | None:
        for line in self.lines:
            match = re.search(r"write-ahead log end point: ([0-9A-F]+/[0-9A-F]+)", line)
            if match:
                return match.group(1)
        return None


def _parse_label(label: str) -> tuple[str, str, int]:
    start = re.search(r"START WAL LOCATION: ([0-9A-F]+/[0-9A-F]+) \(file ([0-9A-F]{24})\)", label)
    timeline = re.search(r"START TIMELINE: (\d+)", label)
    if not start or not timeline:
        raise IntegrityError("the base backup's backup_label is not understood: the snapshot is not usable")
    return start.group(1), start.group(2), int(timeline.group(1))


def take_snapshot(
    store: Store,
    source_dsn: str,
    *,
    bins: PgBinaries | None = None,
    options: SnapshotOptions | None = None,
    progress: Progress | None = None,
) -> Manifest:
    """Stream a base backup of `source_dsn` into the store; returns the manifest (written last)."""
    options = options or SnapshotOptions()
    bins = bins or PgBinaries.find()
    store.check()
    info = identify(source_dsn)
    started = now_utc()
    snap_id = snapshot_id(started)
    layout = Layout(store.location, info.system_id)
    args = [
        bins.pg_basebackup,
        "-d",
        source_dsn,
        "-D",
        "-",
        "-F",
        "t",
        "-X",
        options.wal_method,
        "-c",
        options.checkpoint,
        "-v",
        "-w",
        "--manifest-checksums=NONE",  # every object carries a sha256; spare the server a CRC pass
    ]
    if options.max_rate:
        args.append(f"--max-rate={options.max_rate}")
    if progress is not None and progress.enabled:
        args.append("-P")  # the size estimate (for the ETA) costs the server a pass over the files
    if not options.verify_checksums:
        args.append("--no-verify-checksums")
    proc = subprocess.Popen(
        _large_stdout_writes(args),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
        env=_basebackup_env(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    with contextlib.suppress(OSError):
        fcntl.fcntl(proc.stdout.fileno(), _F_SETPIPE_SZ, 1 << 20)
    watcher = _StderrWatcher(proc.stderr, progress)
    watcher.start()
    uploads = _Uploads(store, options)
    compressors = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="compress")
    hasher = ThreadPoolExecutor(1, thread_name_prefix="sha256")
    completer = ThreadPoolExecutor(1, thread_name_prefix="complete")
    tap = TarTap(_TAPPED)
    sealed: list[_ObjectWriter] = []
    completions: list[Future[DataObject]] = []
    writer: _ObjectWriter | None = None
    ok = False

    def seal(current: _ObjectWriter) -> None:
        current.seal()
        sealed.append(current)
        completions.append(completer.submit(current.complete))

    try:
        buf = bytearray(_READ_BLOCK)
        view = memoryview(buf)
        total = 0
        while True:
            n = proc.stdout.readinto(buf)  # type: ignore[attr-defined]
            if not n:
                break
            block = view[:n]
            tap.feed(block)
            if writer is None:
                name = f"data/{len(sealed):05d}.tar{options.codec.extension}"
                writer = _ObjectWriter(
                    store, uploads, layout.data_key(snap_id, name), name, options, compressors, hasher
                )
            writer.write(block)
            total += n
            if progress is not None:
                progress.update(total)
            if writer.raw_size >= options.object_raw_size:
                seal(writer)
                writer = None
        returncode = proc.wait()
        watcher.join(timeout=10)
        if returncode != 0:
            raise PostgresError(f"pg_basebackup failed (exit {returncode}): {watcher.tail()}")
        if not tap.ended:
            raise IntegrityError("pg_basebackup's tar stream ended early: the snapshot is incomplete")
        if writer is not None:
            seal(writer)
            writer = None
        objects = [future.result() for future in completions]
        uploads.raise_failures()
        manifest = _build_manifest(store, info, snap_id, started, tap.files, watcher, objects, options)
        if options.wal_method == "none":
            wait_for_archived_wal(store, manifest, options.archive_wait)
        store.put_bytes(layout.manifest_key(snap_id), manifest.to_json().encode(), "application/json")
        ok = True
        if progress is not None:
            progress.finish()
        return manifest
    except BaseException as exc:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if isinstance(exc, KeyboardInterrupt):
            raise BackupError(f"snapshot {snap_id} interrupted: nothing was recorded as complete") from None
        raise
    finally:
        uploads.close(cancel=not ok)
        completer.shutdown(wait=True, cancel_futures=True)
        compressors.shutdown(wait=True, cancel_futures=True)
        hasher.shutdown(wait=True, cancel_futures=True)
        if not ok:
            for unfinished in [*sealed, *([writer] if writer is not None else [])]:
                unfinished.abort()
            _forget(store, [w.key for w in sealed])


def wait_for_archived_wal(store: Store, manifest: Manifest, timeout: float) -> None:
    """Without WAL in the snapshot (-X none) it is consistent only with start..stop archived."""
    layout = Layout(store.location, manifest.system_id)
    first, last = Segment.parse(manifest.start_wal), Segment.parse(manifest.stop_wal)
    missing = [Segment(first.timeline, n).name() for n in range(first.number, last.number + 1)]
    deadline = time.monotonic() + timeout
    while missing:
        missing = [name for name in missing if not store.exists(layout.wal_key(name))]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise IntegrityError(
                f"WAL segment {missing[0]} needed to make snapshot {manifest.id} consistent is not in the archive "
                f"after {timeout:.0f}s (the snapshot was taken with --wal-method none): check archive_command "
                "on the primary, or use --wal-method fetch; the snapshot was not recorded"
            )
        time.sleep(1)


def _forget(store: Store, keys: list[str]) -> None:
    """Best effort: remove the objects of a failed snapshot (without a manifest they are ignored anyway)."""
    with contextlib.suppress(BackupError):
        if keys:
            store.delete(keys)


def _large_stdout_writes(args: list[str]) -> list[str]:
    """pg_basebackup writes the tar to stdout through stdio in chunks of a few kB: about 140,000 write
    calls for 2 GB, a second of system CPU on each side of the pipe. coreutils' stdbuf gives its stdout
    a 1 MiB buffer (where stdbuf is missing, the stream is the same, only slower)."""
    stdbuf = shutil.which("stdbuf")
    return [stdbuf, "-o", "1M", *args] if stdbuf else args


def _basebackup_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PGAPPNAME", "pgherd-backup")
    return env


def _build_manifest(
    store: Store,
    info: SourceInfo,
    snap_id: str,
    started: datetime,
    files: dict[str, bytes],
    watcher: _StderrWatcher,
    objects: list[DataObject],
    options: SnapshotOptions,
) -> Manifest:
    if "backup_label" not in files or "global/pg_control" not in files:
        raise IntegrityError("the base backup lacks backup_label or global/pg_control: not a usable snapshot")
    start_lsn, start_wal, timeline = _parse_label(files["backup_label"].decode(errors="replace"))
    system_id = system_id_from_control(files["global/pg_control"])
    if system_id != info.system_id:
        raise IntegrityError(
            f"the base backup's system id {system_id} differs from the server's {info.system_id}: aborting"
        )
    stop_lsn, stop_timeline = watcher.end_lsn(), timeline
    if "backup_manifest" in files:
        with contextlib.suppress(ValueError, KeyError, IndexError):
            ranges = json.loads(files["backup_manifest"])["WAL-Ranges"]
            stop_lsn, stop_timeline = ranges[-1]["End-LSN"], int(ranges[-1]["Timeline"])
    if stop_lsn is None:
        raise IntegrityError(
            "cannot tell where the base backup ends (no end LSN): the snapshot is not usable"
        )
    pg_major = int(files.get("PG_VERSION", b"0").decode().strip() or 0)
    return Manifest(
        id=snap_id,
        cluster=store.location.cluster,
        system_id=system_id,
        timeline=timeline,
        start_lsn=start_lsn,
        stop_lsn=stop_lsn,
        start_wal=start_wal,
        stop_wal=Segment.of_lsn(stop_timeline, max(parse_lsn(stop_lsn) - 1, 0)).name(),
        start_time=format_time(started),
        stop_time=format_time(now_utc()),
        pg_version=info.server_version or str(pg_major),
        pg_major=pg_major,
        compression=options.codec.name,
        source="standby" if b"BACKUP FROM: standby" in files["backup_label"] else "primary",
        size=sum(o.raw_size for o in objects),
        stored_size=sum(o.size for o in objects),
        objects=tuple(objects),
        extra={"wal_method": options.wal_method, "stop_timeline": stop_timeline},
    )
