"""Streaming tar: a tap that watches a tar stream go by (to pick up a few small files), and an
extractor that writes a tar stream into a directory with large writes and bounded memory.

pg_basebackup writes plain ustar archives (regular files, directories, symlinks); pax and GNU
long-name headers are accepted too. Nothing outside the target directory is ever written.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from pgherd_backup.compression import Reader
from pgherd_backup.errors import IntegrityError

BLOCK = 512
_IO_BLOCK = 1 << 20
_SMALL = 1 << 20  # files up to this size are written by the writer threads


def _octal(field: bytes) -> int:
    if field and field[0] & 0x80:  # base-256 (GNU) for large values
        value = field[0] & 0x3F
        for byte in field[1:]:
            value = (value << 8) | byte
        return value
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _padded(size: int) -> int:
    return (size + BLOCK - 1) // BLOCK * BLOCK


class _Header:
    __slots__ = ("linkname", "mode", "name", "size", "type")

    def __init__(self, raw: bytes) -> None:
        name = raw[0:100].split(b"\0", 1)[0]
        prefix = raw[345:500].split(b"\0", 1)[0] if raw[257:262] == b"ustar" else b""
        if prefix:
            name = prefix + b"/" + name
        self.name = name.decode("utf-8", "surrogateescape")
        self.mode = _octal(raw[100:108])
        self.size = _octal(raw[124:136])
        self.type = raw[156:157] or b"0"
        self.linkname = raw[157:257].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        checksum = _octal(raw[148:156])
        computed = sum(raw[:148]) + 8 * 32 + sum(raw[156:])
        if checksum != computed:
            raise IntegrityError("the tar stream is damaged (bad header checksum)")


def _pax_path(data: bytes) -> dict[str, str]:
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        records[key.decode()] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


class TarTap:
    """Watches a tar stream fed in arbitrary slices and keeps the content of a few named files."""

    def __init__(self, wanted: Collection[str], max_capture: int = 64 << 20) -> None:
        self.wanted = set(wanted)
        self.files: dict[str, bytes] = {}
        self.members = 0
        self.ended = False
        self._max = max_capture
        self._header = bytearray()
        self._skip = 0
        self._capture: bytearray | None = None
        self._capture_name = ""
        self._capture_left = 0

    def feed(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        pos, end = 0, len(view)
        while pos < end:
            if self._skip:
                take = min(self._skip, end - pos)
                if self._capture is not None and self._capture_left:
                    grab = min(take, self._capture_left)
                    self._capture += view[pos : pos + grab]
                    self._capture_left -= grab
                    if not self._capture_left:
                        self.files[self._capture_name] = bytes(self._capture)
                        self._capture = None
                self._skip -= take
                pos += take
                continue
            take = min(BLOCK - len(self._header), end - pos)
            self._header += view[pos : pos + take]
            pos += take
            if len(self._header) == BLOCK:
                raw = bytes(self._header)
                self._header.clear()
                self._on_header(raw)

    def _on_header(self, raw: bytes) -> None:
        if raw == bytes(BLOCK):
            self.ended = True
            return
        header = _Header(raw)
        self.members += 1
        self._skip = _padded(header.size)
        name = header.name.removeprefix("./")
        if header.type in (b"0", b"\0") and name in self.wanted and 0 < header.size <= self._max:
            self._capture = bytearray()
            self._capture_name = name
            self._capture_left = header.size
        elif header.type in (b"0", b"\0") and name in self.wanted and header.size == 0:
            self.files[name] = b""


class _Pull:
    """Exact reads over a reader that may return short reads."""

    def __init__(self, reader: Reader) -> None:
        self._reader = reader
        self._pending = b""
        self.position = 0

    def read_some(self, limit: int) -> bytes:
        if self._pending:
            data, self._pending = self._pending[:limit], self._pending[limit:]
        else:
            data = self._reader.read(limit)
        self.position += len(data)
        return data

    def read_exact(self, size: int) -> bytes:
        parts: list[bytes] = []
        left = size
        while left:
            data = self.read_some(left)
            if not data:
                raise IntegrityError(
                    f"the tar stream ends early (at byte {self.position}, {left} bytes missing)"
                )
            parts.append(data)
            left -= len(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def skip(self, size: int) -> None:
        while size:
            data = self.read_some(min(size, _IO_BLOCK))
            if not data:
                raise IntegrityError("the tar stream ends early")
            size -= len(data)

    def at_eof(self) -> bool:
        if self._pending:
            return False
        self._pending = self._reader.read(_IO_BLOCK)
        return not self._pending


def _safe_path(root: Path, name: str) -> Path:
    clean = name.removeprefix("./").rstrip("/")
    parts = clean.split("/")
    if not clean or clean.startswith("/") or ".." in parts:
        raise IntegrityError(f"the tar stream holds an unsafe path {name!r}: refusing to extract it")
    return root.joinpath(*parts)


class _Writers:
    """Writes small files on a few threads: creating a file costs far more than writing a few
    kilobytes, and a data directory holds thousands of small files. Bounded in bytes."""

    def __init__(self, uid: int | None, gid: int | None, threads: int = 4, budget: int = 16 << 20) -> None:
        self.uid, self.gid = uid, gid
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="untar")
        self.budget = threading.Semaphore(budget // _SMALL)
        self.futures: list[Future[None]] = []

    def submit(self, path: Path, data: bytes, mode: int) -> None:
        self.budget.acquire()
        self.futures = [f for f in self.futures if not f.done() or f.result() is not None]
        self.futures.append(self.pool.submit(self._write, path, data, mode))

    def _write(self, path: Path, data: bytes, mode: int) -> None:
        try:
            _write_file(path, data, mode, self.uid, self.gid)
        finally:
            self.budget.release()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for future in self.futures:
            future.result()


def _write_file(path: Path, data: bytes, mode: int, uid: int | None, gid: int | None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        if uid is not None:
            os.fchown(fd, uid, gid if gid is not None else -1)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def extract(
    reader: Reader,
    target: Path,
    *,
    uid: int | None = None,
    gid: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Extract a whole tar stream into `target`; returns the number of bytes of file data written.

    `progress`, when given, is called with the number of bytes consumed so far.
    """
    pull = _Pull(reader)
    written = 0
    long_name: str | None = None
    target.mkdir(mode=0o700, parents=True, exist_ok=True)
    made: set[Path] = {target}
    writers = _Writers(uid, gid)

    def parent_of(path: Path) -> None:
        if path.parent not in made:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            made.add(path.parent)

    try:
        while True:
            raw = pull.read_exact(BLOCK)
            if raw == bytes(BLOCK):
                break  # end of archive: two zero blocks; the second one is padding we do not need
            header = _Header(raw)
            name = long_name or header.name
            long_name = None
            if header.type in (b"x", b"g", b"L"):
                data = pull.read_exact(header.size)
                pull.skip(_padded(header.size) - header.size)
                if header.type == b"x":
                    long_name = _pax_path(data).get("path")
                elif header.type == b"L":
                    long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                continue
            path = _safe_path(target, name) if name not in (".", "./") else target
            if header.type == b"5":
                path.mkdir(mode=header.mode & 0o777 or 0o700, parents=True, exist_ok=True)
                made.add(path)
                if uid is not None:
                    os.chown(path, uid, gid if gid is not None else -1)
            elif header.type == b"2":
                parent_of(path)
                os.symlink(header.linkname, path)
                if uid is not None:
                    os.lchown(path, uid, gid if gid is not None else -1)
            elif header.type in (b"0", b"\0", b"7"):
                parent_of(path)
                mode = header.mode & 0o777 or 0o600
                if header.size <= _SMALL:
                    writers.submit(path, pull.read_exact(header.size) if header.size else b"", mode)
                else:
                    _write_stream(pull, path, header.size, mode, uid, gid, name)
                written += header.size
                pull.skip(_padded(header.size) - header.size)
            else:
                raise IntegrityError(f"the tar stream holds {name!r} of unsupported type {header.type!r}")
            if progress is not None:
                progress(pull.position)
    finally:
        writers.close()
    return written


def _write_stream(
    pull: _Pull, path: Path, size: int, mode: int, uid: int | None, gid: int | None, name: str
) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        if uid is not None:
            os.fchown(fd, uid, gid if gid is not None else -1)
        left = size
        while left:
            data = pull.read_some(min(left, _IO_BLOCK))
            if not data:
                raise IntegrityError(f"the tar stream ends in the middle of {name!r}")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            left -= len(data)
    finally:
        os.close(fd)
