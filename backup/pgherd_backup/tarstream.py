"""Streaming tar: a tap that watches a tar stream go by (to pick up a few small files), and an
extractor that writes a tar stream into a directory with large writes and bounded memory.

pg_basebackup writes plain ustar archives (regular files, directories, symlinks); pax and GNU
long-name headers are accepted too. The stream is not trusted: nothing outside the target directory
is ever written, no path crosses a symbolic link, and every link made points inside.
"""

from __future__ import annotations

import errno
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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
_NOT_A_DIRECTORY = (errno.ELOOP, errno.ENOTDIR)  # what O_NOFOLLOW | O_DIRECTORY meets on a link or a file
_REFUSED_TYPES = {b"1": "hard link", b"3": "character device", b"4": "block device", b"6": "FIFO"}


def _member_parts(name: str) -> tuple[str, ...]:
    """A member's path below the target, one component each; () is the target itself."""
    parts = tuple(part for part in name.split("/") if part not in ("", "."))
    if name.startswith("/") or ".." in parts or "\0" in name:
        raise IntegrityError(f"the tar stream holds an unsafe path {name!r}: refusing to extract it")
    return parts


class _Target:
    """The target directory, opened once. Every member is reached from it one component at a time
    with O_NOFOLLOW, so no path the archive names crosses a symbolic link, whatever links it made.
    Links are checked apart: each must point inside without going through another link."""

    def __init__(self, root: Path, uid: int | None, gid: int | None) -> None:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.uid, self.gid = uid, gid
        self.links: set[tuple[str, ...]] = set()
        self.stepped: dict[tuple[str, ...], str] = {}  # paths a link's target steps through: that link

    def close(self) -> None:
        os.close(self.fd)

    def chown(self, fd: int) -> None:
        _chown(fd, self.uid, self.gid)

    def open_dir(self, parts: tuple[str, ...], name: str, mode: int = 0o700) -> int:
        """A new descriptor of the directory `parts`, made (with `mode` for the last) if missing."""
        fd = os.dup(self.fd)
        try:
            for depth, part in enumerate(parts):
                inner = self._enter(
                    fd, part, mode if depth == len(parts) - 1 else 0o700, name, parts[: depth + 1]
                )
                os.close(fd)
                fd = inner
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _enter(self, fd: int, part: str, mode: int, name: str, path: tuple[str, ...]) -> int:
        try:
            return _open_dir_at(fd, part, name, path)
        except FileNotFoundError:
            try:
                os.mkdir(part, mode, dir_fd=fd)
            except FileExistsError:  # a writer thread made a file of that name meanwhile
                return _open_dir_at(fd, part, name, path)
        inner = _open_dir_at(fd, part, name, path)
        self.chown(inner)
        return inner

    def symlink(self, parts: tuple[str, ...], link: str, name: str) -> None:
        self._check_link(parts, link, name)
        parent = self.open_dir(parts[:-1], name)
        try:
            os.symlink(link, parts[-1], dir_fd=parent)
            if self.uid is not None:
                os.chown(
                    parts[-1],
                    self.uid,
                    self.gid if self.gid is not None else -1,
                    dir_fd=parent,
                    follow_symlinks=False,
                )
        except FileExistsError:
            raise IntegrityError(
                f"the tar stream holds the symbolic link {name!r} where something already is: refusing to extract it"
            ) from None
        finally:
            os.close(parent)
        self.links.add(parts)

    def _check_link(self, parts: tuple[str, ...], link: str, name: str) -> None:
        """Refuse a link unless, read from its directory, it names a place inside the target
        without stepping through a link: ".." taken after a link climbs from where that link points."""
        refuse = f"the tar stream holds the symbolic link {name!r} to {link!r}"
        if not link or "\0" in link:
            raise IntegrityError(f"{refuse}, which is not a usable target: refusing to extract it")
        if link.startswith("/"):
            if len(parts) == 2 and parts[0] == "pg_tblspc":
                raise IntegrityError(
                    f"{refuse}, a tablespace: tablespaces outside the data directory are not supported by "
                    "restore (nor by snapshot: pg_basebackup cannot stream their files into one archive). "
                    "Move the tablespace's tables to pg_default and drop it, then take a new snapshot"
                )
            raise IntegrityError(
                f"{refuse}, an absolute path: a restore makes only links that stay inside the target "
                "directory; refusing to extract it"
            )
        here = list(parts[:-1])
        steps = [step for step in link.split("/") if step not in ("", ".")]
        crossed: list[tuple[str, ...]] = []
        for index, step in enumerate(steps):
            if step != "..":
                here.append(step)
                if index < len(steps) - 1:
                    crossed.append(tuple(here))
            elif here:
                here.pop()
            else:
                raise IntegrityError(f"{refuse}, outside the target directory: refusing to extract it")
        for path in crossed:
            if path in self.links:
                raise IntegrityError(
                    f"{refuse}, which goes through the symbolic link {'/'.join(path)!r}: refusing to extract it"
                )
        if parts in self.stepped:
            raise IntegrityError(
                f"the tar stream holds the symbolic link {name!r} where the earlier link "
                f"{self.stepped[parts]!r} steps through: refusing to extract it"
            )
        for path in crossed:
            self.stepped.setdefault(path, name)


def _open_dir_at(fd: int, part: str, name: str, path: tuple[str, ...]) -> int:
    try:
        return os.open(part, _DIR_FLAGS, dir_fd=fd)
    except OSError as error:
        if error.errno in _NOT_A_DIRECTORY:
            raise IntegrityError(
                f"the tar stream holds {name!r}, whose path goes through {'/'.join(path)!r}, a symbolic "
                "link or a file rather than a directory: refusing to extract it"
            ) from None
        raise


def _chown(fd: int, uid: int | None, gid: int | None) -> None:
    if uid is not None:
        os.fchown(fd, uid, gid if gid is not None else -1)


def _create(parent: int, leaf: str, mode: int, name: str) -> int:
    try:
        return os.open(leaf, _FILE_FLAGS, mode, dir_fd=parent)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EISDIR):
            raise IntegrityError(
                f"the tar stream holds the file {name!r} where a symbolic link or a directory already is: "
                "refusing to extract it"
            ) from None
        raise


class _Writers:
    """Writes small files on a few threads: creating a file costs far more than writing a few
    kilobytes, and a data directory holds thousands of small files. Bounded in bytes."""

    def __init__(self, uid: int | None, gid: int | None, threads: int = 4, budget: int = 16 << 20) -> None:
        self.uid, self.gid = uid, gid
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="untar")
        self.budget = threading.Semaphore(budget // _SMALL)
        self.futures: list[Future[None]] = []

    def submit(self, parent: int, leaf: str, data: bytes, mode: int, name: str) -> None:
        """Write `leaf` in the directory `parent`, a descriptor this takes over."""
        try:
            self.budget.acquire()
            self.futures = [f for f in self.futures if not f.done() or f.result() is not None]
            self.futures.append(self.pool.submit(self._write, parent, leaf, data, mode, name))
        except BaseException:
            os.close(parent)
            raise

    def _write(self, parent: int, leaf: str, data: bytes, mode: int, name: str) -> None:
        try:
            _write_file(parent, leaf, data, mode, self.uid, self.gid, name)
        finally:
            self.budget.release()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for future in self.futures:
            future.result()


def _write_file(
    parent: int, leaf: str, data: bytes, mode: int, uid: int | None, gid: int | None, name: str
) -> None:
    try:
        fd = _create(parent, leaf, mode, name)
    finally:
        os.close(parent)
    try:
        _chown(fd, uid, gid)
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
    tree = _Target(target, uid, gid)
    writers = _Writers(uid, gid)
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
            parts = _member_parts(name)
            if header.type in _REFUSED_TYPES:
                raise IntegrityError(
                    f"the tar stream holds {name!r}, a {_REFUSED_TYPES[header.type]}: a restore makes only "
                    "files, directories and symbolic links (all pg_basebackup writes); refusing to extract it"
                )
            if header.type == b"5":
                fd = tree.open_dir(parts, name, header.mode & 0o777 or 0o700)
                try:
                    tree.chown(fd)
                finally:
                    os.close(fd)
            elif not parts:
                raise IntegrityError(f"the tar stream holds an unsafe path {name!r}: refusing to extract it")
            elif header.type == b"2":
                tree.symlink(parts, header.linkname, name)
            elif header.type in (b"0", b"\0", b"7"):
                mode = header.mode & 0o777 or 0o600
                if header.size <= _SMALL:
                    data = pull.read_exact(header.size) if header.size else b""
                    writers.submit(tree.open_dir(parts[:-1], name), parts[-1], data, mode, name)
                else:
                    _write_stream(
                        pull, tree.open_dir(parts[:-1], name), parts[-1], header.size, mode, uid, gid, name
                    )
                written += header.size
                pull.skip(_padded(header.size) - header.size)
            else:
                raise IntegrityError(f"the tar stream holds {name!r} of unsupported type {header.type!r}")
            if progress is not None:
                progress(pull.position)
    finally:
        try:
            writers.close()
        finally:
            tree.close()
    return written


def _write_stream(
    pull: _Pull, parent: int, leaf: str, size: int, mode: int, uid: int | None, gid: int | None, name: str
) -> None:
    try:
        fd = _create(parent, leaf, mode, name)
    finally:
        os.close(parent)
    try:
        _chown(fd, uid, gid)
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
