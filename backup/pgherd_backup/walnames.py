"""LSNs and WAL file names: pure arithmetic, no I/O."""

from __future__ import annotations

import re
from dataclasses import dataclass

SEGMENT_SIZE = 16 * 1024 * 1024
_SEGMENT_RE = re.compile(r"^([0-9A-F]{8})([0-9A-F]{8})([0-9A-F]{8})$")
_HISTORY_RE = re.compile(r"^([0-9A-F]{8})\.history$")
_WAL_NAME_RE = re.compile(r"^[0-9A-F]{8}([0-9A-F]{16}(\.partial|\.[0-9A-F]{8}\.backup)?|\.history)$")


def parse_lsn(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})\s*", text)
    if not match:
        raise ValueError(f"invalid LSN {text!r}: expected the form 0/16B3748")
    return (int(match.group(1), 16) << 32) | int(match.group(2), 16)


def format_lsn(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


@dataclass(frozen=True, order=True)
class Segment:
    """A WAL segment: its timeline and its position (segment number) in the WAL stream."""

    timeline: int
    number: int

    @classmethod
    def parse(cls, name: str, segment_size: int = SEGMENT_SIZE) -> Segment:
        match = _SEGMENT_RE.match(name)
        if not match:
            raise ValueError(f"{name!r} is not a WAL segment name")
        per_log = 0x100000000 // segment_size
        return cls(int(match.group(1), 16), int(match.group(2), 16) * per_log + int(match.group(3), 16))

    @classmethod
    def of_lsn(cls, timeline: int, lsn: int, segment_size: int = SEGMENT_SIZE) -> Segment:
        return cls(timeline, lsn // segment_size)

    def name(self, segment_size: int = SEGMENT_SIZE) -> str:
        per_log = 0x100000000 // segment_size
        return f"{self.timeline:08X}{self.number // per_log:08X}{self.number % per_log:08X}"


def is_segment(name: str) -> bool:
    return bool(_SEGMENT_RE.match(name))


def is_history(name: str) -> bool:
    return bool(_HISTORY_RE.match(name))


def is_wal_name(name: str) -> bool:
    """A name PostgreSQL may archive: segment, partial segment, backup history or timeline history."""
    return bool(_WAL_NAME_RE.match(name))


def segment_number_of(name: str, segment_size: int = SEGMENT_SIZE) -> int | None:
    """The segment number a WAL file name refers to (also for .partial and .backup files)."""
    if len(name) >= 24 and _SEGMENT_RE.match(name[:24]):
        return Segment.parse(name[:24], segment_size).number
    return None
