"""Compression codecs: zstd (default, multi-threaded), lz4, gzip and none.

Compression is a push API (feed blocks, collect output); decompression is a pull API over a
file-like source so that the output is always read in bounded blocks (a few megabytes of
compressed zero pages can expand to a gigabyte).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import IO, Any, Protocol

from pgherd_backup.errors import BackupError, IntegrityError, UsageError

CODECS = ("zstd", "lz4", "gzip", "none")
DEFAULT_LEVELS = {"zstd": 1, "lz4": 0, "gzip": 1, "none": 0}


class Compressor(Protocol):
    def compress(self, data: bytes | memoryview) -> bytes: ...
    def flush(self) -> bytes: ...


class Reader(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class _Identity:
    def compress(self, data: bytes | memoryview) -> bytes:
        return bytes(data)

    def flush(self) -> bytes:
        return b""


class _GzipCompressor:
    def __init__(self, level: int) -> None:
        self._z = zlib.compressobj(level, zlib.DEFLATED, 31)

    def compress(self, data: bytes | memoryview) -> bytes:
        return self._z.compress(data)

    def flush(self) -> bytes:
        return self._z.flush()


@dataclass(frozen=True)
class Codec:
    name: str
    level: int
    threads: int = 0

    @classmethod
    def get(cls, name: str, level: int | None = None, threads: int | None = None) -> Codec:
        if name not in CODECS:
            raise UsageError(f"unknown compression {name!r}: choose one of {', '.join(CODECS)}")
        if threads is None:
            threads = os.cpu_count() or 1
        return cls(name, DEFAULT_LEVELS[name] if level is None else level, threads)

    @property
    def extension(self) -> str:
        return {"zstd": ".zst", "lz4": ".lz4", "gzip": ".gz", "none": ""}[self.name]

    def compressor(self) -> Compressor:
        if self.name == "zstd":
            import zstandard

            params = zstandard.ZstdCompressionParameters.from_level(
                self.level, threads=self.threads if self.threads > 1 else 0, write_checksum=True
            )
            c: Compressor = zstandard.ZstdCompressor(compression_params=params).compressobj()
            return c
        if self.name == "lz4":
            import lz4.frame

            return _Lz4Compressor(
                lz4.frame.LZ4FrameCompressor(compression_level=self.level, content_checksum=True)
            )
        if self.name == "gzip":
            return _GzipCompressor(self.level or 1)
        return _Identity()

    def compress(self, data: bytes) -> bytes:
        """One whole frame (one-shot APIs: several times faster than the streaming ones)."""
        if self.name == "zstd":
            import zstandard

            return zstandard.ZstdCompressor(level=self.level, write_checksum=True).compress(data)
        if self.name == "lz4":
            import lz4.frame

            packed: bytes = lz4.frame.compress(data, compression_level=self.level, content_checksum=True)
            return packed
        c = self.compressor()
        return c.compress(data) + c.flush()

    def reader(self, source: IO[bytes] | Reader) -> Reader:
        """A reader of the decompressed bytes of `source` (one or more whole frames)."""
        if self.name == "zstd":
            import zstandard

            stream: Any = source
            r: Reader = zstandard.ZstdDecompressor().stream_reader(
                stream, read_size=1 << 20, read_across_frames=True
            )
            return r
        if self.name == "lz4":
            import lz4.frame

            return _PullReader(source, lz4.frame.LZ4FrameDecompressor)
        if self.name == "gzip":
            return _PullReader(source, lambda: zlib.decompressobj(31))
        return source

    def decompress(self, data: bytes, origin: str = "data") -> bytes:
        import io

        reader = self.reader(io.BytesIO(data))
        out = bytearray()
        while True:
            block = read_checked(reader, 1 << 22, origin)
            if not block:
                return bytes(out)
            out += block


def read_checked(reader: Reader, size: int, origin: str) -> bytes:
    """`reader.read(size)`, with a decoder's complaint turned into an IntegrityError naming `origin`."""
    try:
        return reader.read(size)
    except BackupError:
        raise
    except Exception as exc:  # zstandard.ZstdError, lz4's RuntimeError, zlib.error, EOFError...
        raise IntegrityError(f"{origin} cannot be decompressed ({exc}): it is damaged") from None


class _Lz4Compressor:
    def __init__(self, inner: object) -> None:
        self._inner = inner
        self._started = False

    def compress(self, data: bytes | memoryview) -> bytes:
        prefix = b""
        if not self._started:
            prefix = self._inner.begin()  # type: ignore[attr-defined]
            self._started = True
        return prefix + self._inner.compress(data)  # type: ignore[attr-defined,no-any-return]

    def flush(self) -> bytes:
        prefix = b""
        if not self._started:
            prefix = self._inner.begin()  # type: ignore[attr-defined]
            self._started = True
        return prefix + self._inner.flush()  # type: ignore[attr-defined,no-any-return]


class _PullReader:
    """Bounded reads over a push decompressor (zlib's or lz4's) fed in 1 MiB input blocks."""

    def __init__(self, source: IO[bytes] | Reader, make: Any) -> None:
        self._source = source
        self._fresh = make
        self._d = make()
        self._input = b""

    def read(self, size: int = -1, /) -> bytes:
        size = size if size and size > 0 else 1 << 20
        while True:
            if self._d.eof:
                # one frame ends; objects of the non-zstd codecs are runs of independent frames
                leftover = self._d.unused_data
                data = leftover or self._pending_input() or self._source.read(1 << 20)
                if not data:
                    return b""
                self._d = self._fresh()
            elif not getattr(self._d, "needs_input", True):
                data = b""  # output is still pending from the input already given: no more input yet
            else:
                data = self._pending_input() or self._source.read(1 << 20)
                if not data:
                    raise IntegrityError("the compressed stream ends early: it is truncated")
            out: bytes = self._d.decompress(data, size)
            if hasattr(self._d, "unconsumed_tail"):
                self._input = self._d.unconsumed_tail
            if out:
                return out

    def _pending_input(self) -> bytes:
        data, self._input = self._input, b""
        return data
