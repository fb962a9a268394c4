"""Take a snapshot: pg_basebackup's tar stream, compressed, cut into objects and sent as S3
multipart uploads (parts uploaded in parallel), then the manifest, written last.

Where the compression runs (`compress_on`):
- "server" (the default from PostgreSQL 15 on): the source server compresses (`--compress=server-*`)
  and pg_basebackup hands the compressed stream through untouched; only compressed bytes cross the
  network and the pipe. The snapshot is one compressed stream cut into objects (manifest format 2).
- "client": pg_basebackup compresses (`--compress=client-*`); same stream layout.
- "agent" (servers before 15): pg_basebackup sends the raw tar and pgherd-backup compresses it,
  one frame (or run of frames) per object (manifest format 1).

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
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime

from pgherd_backup.basefiles import parse_label
from pgherd_backup.compression import Codec, Compressor
from pgherd_backup.errors import BackupError, IntegrityError, PostgresError, UsageError
from pgherd_backup.layout import Layout
from pgherd_backup.manifest import (
    LEGACY_FORMAT,
    STREAM_FORMAT,
    DataObject,
    Manifest,
    Part,
    format_time,
    now_utc,
    snapshot_id,
)
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


COMPRESS_ON = ("auto", "server", "client", "agent")
# a PostgreSQL built without the codec (basebackup_zstd.c and friends; common/compression.c)
_UNSUPPORTED = ("compression is not supported by this build", "does not support compression with")


@dataclass(frozen=True)
class SnapshotOptions:
    codec: Codec = field(default_factory=lambda: Codec.get("zstd"))
    compress_on: str = "auto"  # see the module's docstring; "auto": "server" from PostgreSQL 15 on
    compress_workers: int = 2  # zstd worker threads where pg_basebackup or the server compresses
    object_size: int = 1 << 30  # bytes per object: compressed in a stream, uncompressed with "agent"
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
    """One data object, uploaded part by part: a slice of an already compressed stream (`passthrough`),
    or a single multi-threaded zstd frame, or for the other codecs a run of independent frames (4 MiB
    of input each) compressed on a thread pool."""

    def __init__(
        self,
        store: Store,
        uploads: _Uploads,
        key: str,
        name: str,
        options: SnapshotOptions,
        pool: ThreadPoolExecutor,
        hasher: ThreadPoolExecutor,
        passthrough: bool,
    ) -> None:
        self.passthrough = passthrough
        self.store = store
        self.uploads = uploads
        self.key = key
        self.name = name
        self.options = options
        codec = options.codec
        self.compressor: Compressor | None = (
            codec.compressor() if codec.name == "zstd" and not passthrough else None
        )
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
        if self.passthrough:
            self.buffer += data
        elif self.compressor is not None:
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
        elif not self.passthrough:
            if self.block:
                self._submit_block()
            while self.blocks:
                self._collect(wait=True)
        if self.buffer or not self.futures:  # no empty last part (some S3 servers refuse those)
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
            raw_size=0 if self.passthrough else self.raw_size,  # unknown inside a compressed stream
            sha256=self.sha256.hexdigest(),
            parts=tuple(part for _, part in results),
        )

    def abort(self) -> None:
        if self.upload_id is not None:
            self.store.abort_multipart(self.key, self.upload_id)


class _StderrWatcher(threading.Thread):
    """Collects pg_basebackup's messages and its progress lines (-P) without blocking it. With
    `counts_progress`, the progress lines (uncompressed kB sent by the server) drive `progress`."""

    def __init__(self, stream: object, progress: Progress | None, counts_progress: bool) -> None:
        super().__init__(daemon=True, name="pg_basebackup-stderr")
        self.stream = stream
        self.progress = progress
        self.counts_progress = counts_progress
        self.lines: list[str] = []
        self.done_kb: int | None = None

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
        match = re.match(r"\s*(\d+)/(\d+) kB", line)
        if match:
            self.done_kb = int(match.group(1))
            if self.progress is not None:
                self.progress.set_total(max(int(match.group(2)), self.done_kb) * 1024)
                if self.counts_progress:
                    self.progress.update(self.done_kb * 1024)
            return
        if line.strip():
            self.lines.append(line.strip())

    def tail(self, count: int = 6) -> str:
        useful = [line for line in self.lines if "pg_basebackup: " in line or "error" in line.lower()]
        return " | ".join((useful or self.lines)[-count:])

    def start_point(self) -> tuple[str, int] | None:
        for line in self.lines:
            match = re.search(r"write-ahead log start point: ([0-9A-F]+/[0-9A-F]+) on timeline (\d+)", line)
            if match:
                return match.group(1), int(match.group(2))
        return None

    def end_lsn(self) -> str | None:
        for line in self.lines:
            match = re.search(r"write-ahead log end point: ([0-9A-F]+/[0-9A-F]+)", line)
            if match:
                return match.group(1)
        return None


def compression_site(options: SnapshotOptions, info: SourceInfo, bins: PgBinaries) -> str:
    """Where the compression runs: "server", "client" or "agent" (see the module's docstring)."""
    if options.compress_on not in COMPRESS_ON:
        raise UsageError(
            f"unknown --compress-on {options.compress_on!r}: choose one of {', '.join(COMPRESS_ON)}"
        )
    # pg_basebackup reports the start and end points the manifest needs only when it fetches the WAL
    client_major = bins.program_major("pg_basebackup")
    stream_capable = info.major >= 15 and client_major >= 15 and options.wal_method != "none"
    if options.compress_on == "auto":
        return "server" if stream_capable else "agent"
    if options.compress_on != "agent" and not stream_capable:
        raise UsageError(
            f"--compress-on {options.compress_on} needs PostgreSQL 15 or later on the source "
            f"(it runs {info.server_version or 'an unknown version'}) and for pg_basebackup "
            f"({client_major}), and --wal-method fetch: use --compress-on agent"
        )
    return options.compress_on


def _compress_flags(site: str, options: SnapshotOptions) -> list[str]:
    codec = options.codec
    if site == "agent":
        return ["--manifest-checksums=NONE"]  # every object carries a sha256; spare the server a CRC pass
    if codec.name == "none":
        return ["--manifest-checksums=NONE"]
    detail = [f"level={codec.level}"] if codec.level > 0 or codec.name == "zstd" else []  # zstd: -1 too
    if codec.name == "zstd" and options.compress_workers > 0:
        detail.append(f"workers={options.compress_workers}")
    spec = f"{site}-{codec.name}" + (":" + ",".join(detail) if detail else "")
    # pg_basebackup cannot add its backup_manifest to a server-compressed stream it does not parse;
    # the snapshot's own manifest has a sha256 for every object.
    extra = ["--no-manifest"] if site == "server" else ["--manifest-checksums=NONE"]
    return [f"--compress={spec}", *extra]


def _client_for(info: SourceInfo) -> PgBinaries:
    """pg_basebackup of the source's own major when it is here (a cluster upgraded to a major newer
    than the default programs: an older pg_basebackup refuses a newer server), else the default."""
    default = PgBinaries.find()
    if info.major and info.major != default.major:
        try:
            return PgBinaries.for_major(info.major)
        except PostgresError:
            pass
    return default


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
    store.check()
    info = identify(source_dsn)
    bins = bins or _client_for(info)
    site = compression_site(options, info, bins)
    try:
        return _take(store, source_dsn, bins, info, site, options, progress)
    except PostgresError as exc:
        if options.compress_on != "auto" or site == "agent" or not any(m in str(exc) for m in _UNSUPPORTED):
            raise
    # a server built without this codec: compress here instead (it failed before sending any data)
    sys.stderr.write(
        f"pgherd-backup: the source server cannot compress with {options.codec.name}; "
        "compressing in pgherd-backup instead\n"
    )
    return _take(store, source_dsn, bins, info, "agent", options, progress)


def _take(
    store: Store,
    source_dsn: str,
    bins: PgBinaries,
    info: SourceInfo,
    site: str,
    options: SnapshotOptions,
    progress: Progress | None,
) -> Manifest:
    stream = site != "agent"
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
        *_compress_flags(site, options),
    ]
    if options.max_rate:
        args.append(f"--max-rate={options.max_rate}")
    if stream or (progress is not None and progress.enabled):
        # the server's progress counts uncompressed bytes: the snapshot's size, and the ETA (the size
        # estimate costs the server a pass over the directory entries, not over the data)
        args.append("-P")
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
    watcher = _StderrWatcher(proc.stderr, progress, counts_progress=stream)
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
    extension = ".tar" + options.codec.extension

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
            if not stream:
                tap.feed(block)
            if writer is None:
                name = f"data/{len(sealed):05d}{extension}"
                writer = _ObjectWriter(
                    store, uploads, layout.data_key(snap_id, name), name, options, compressors, hasher, stream
                )
            writer.write(block)
            total += n
            if progress is not None and not stream:
                progress.update(total)
            if writer.raw_size >= options.object_size:
                seal(writer)
                writer = None
        returncode = proc.wait()
        watcher.join(timeout=30)
        if returncode != 0:
            raise PostgresError(f"pg_basebackup failed (exit {returncode}): {watcher.tail()}")
        if watcher.is_alive():
            raise PostgresError("pg_basebackup's messages did not end with it: the snapshot is not recorded")
        if not stream and not tap.ended:
            raise IntegrityError("pg_basebackup's tar stream ended early: the snapshot is incomplete")
        if writer is not None:
            seal(writer)
            writer = None
        if not sealed:
            raise IntegrityError("pg_basebackup wrote nothing: the snapshot is empty")
        objects = [future.result() for future in completions]
        uploads.raise_failures()
        if stream:
            manifest = _stream_manifest(
                store, source_dsn, info, snap_id, started, watcher, objects, site, options
            )
        else:
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
        proc.stdout.close()
        watcher.join(timeout=5)
        if not watcher.is_alive():  # never under the thread's feet
            proc.stderr.close()
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
    """Untranslated messages: the manifest is built from them (start and end points, progress)."""
    env = dict(os.environ)
    env.setdefault("PGAPPNAME", "pgherd-backup")
    env.pop("LANGUAGE", None)
    env["LC_ALL"] = "C"
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
    start_lsn, start_wal, timeline = parse_label(files["backup_label"])
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
        format=LEGACY_FORMAT,
        extra={"wal_method": options.wal_method, "stop_timeline": stop_timeline, "compressed_by": "agent"},
    )


def _stream_manifest(
    store: Store,
    source_dsn: str,
    info: SourceInfo,
    snap_id: str,
    started: datetime,
    watcher: _StderrWatcher,
    objects: list[DataObject],
    site: str,
    options: SnapshotOptions,
) -> Manifest:
    """The manifest of a compressed stream, from pg_basebackup's messages (start and end points) and
    the source's identity, asked again now: a source that changed under us is refused. Restore and
    verify check the backup's own backup_label and pg_control against it."""
    start = watcher.start_point()
    stop_lsn = watcher.end_lsn()
    if start is None or stop_lsn is None:
        raise IntegrityError(
            "pg_basebackup did not report the backup's start and end points: the snapshot is not usable "
            f"({watcher.tail()})"
        )
    start_lsn, timeline = start
    after = identify(source_dsn)
    if after.system_id != info.system_id:
        raise IntegrityError(
            f"the source's system id changed during the snapshot ({info.system_id} -> {after.system_id}): "
            "the DSN reached another cluster; aborting"
        )
    # a standby can switch timelines under a backup (its upstream was promoted); a primary cannot
    stop_timeline = max(timeline, after.timeline) if info.in_recovery else timeline
    return Manifest(
        id=snap_id,
        cluster=store.location.cluster,
        system_id=info.system_id,
        timeline=timeline,
        start_lsn=start_lsn,
        stop_lsn=stop_lsn,
        start_wal=Segment.of_lsn(timeline, parse_lsn(start_lsn)).name(),
        stop_wal=Segment.of_lsn(stop_timeline, max(parse_lsn(stop_lsn) - 1, 0)).name(),
        start_time=format_time(started),
        stop_time=format_time(now_utc()),
        pg_version=info.server_version,
        pg_major=info.major,
        compression=options.codec.name,
        source="standby" if info.in_recovery else "primary",
        size=(watcher.done_kb or 0) * 1024,  # the server's count, to the kB
        stored_size=sum(o.size for o in objects),
        objects=tuple(objects),
        format=STREAM_FORMAT,
        extra={
            "wal_method": options.wal_method,
            "stop_timeline": stop_timeline,
            "compressed_by": site if options.codec.name != "none" else "none",
        },
    )
