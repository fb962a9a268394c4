"""Where valid WAL ends in a data directory: the most WAL a member provably holds.

The positions PostgreSQL reports are not that: after a restart pg_last_wal_receive_lsn() is NULL, or
restarts at the segment where streaming resumed; pg_control's latest checkpoint is behind everything
written after it, which an unclean shutdown leaves in pg_wal. The end of the last valid record in
pg_wal is what the member holds: what its recovery would replay, and after a clean shutdown of a
primary the end of its shutdown checkpoint record, which is exactly what its connected standbys
received.

pg_waldump judges validity exactly as recovery does (CRC, back-links, page headers). Only the newest
segment written at its own position is read (recycled segments carry an older address in their first
page header): tens of milliseconds, and `WalEndReader` keeps the answer until that segment changes.
After a primary's clean shutdown only its shutdown checkpoint record is read (pg_control names it).
"""

from __future__ import annotations

import re
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pgherd_backup.errors import PostgresError
from pgherd_backup.postgres.binaries import PgBinaries
from pgherd_backup.postgres.control import ControlData, read_controldata
from pgherd_backup.postgres.process import pg_run
from pgherd_backup.walnames import Segment, format_lsn, is_segment, parse_lsn

# XLogLongPageHeaderData, the header of a segment's first page: magic, info, timeline, page address,
# remaining length of a continued record, (padding), system identifier, segment size, block size.
_LONG_HEADER = struct.Struct("=HHIQI4xQII")
_XLP_LONG_HEADER = 0x0002
SHORT_PAGE_HEADER = 24  # MAXALIGN(sizeof(XLogPageHeaderData))
LONG_PAGE_HEADER = 40  # MAXALIGN(sizeof(XLogLongPageHeaderData))
_MAXALIGN = 8

_RECORD = re.compile(
    r"^rmgr: (?P<rmgr>\S+)\s+len \(rec/tot\):\s*\d+/\s*(?P<total>\d+), tx:\s*\d+,"
    r" lsn: (?P<lsn>[0-9A-F]+/[0-9A-F]+), prev [0-9A-F]+/[0-9A-F]+, desc: (?P<desc>\S*)"
)
# pg_waldump's last words name the start of the last record it read whole ("error in WAL record at").
_LAST_VALID = re.compile(r"error in WAL record at ([0-9A-F]+/[0-9A-F]+):")
_NOTHING_VALID = "could not find a valid record after"


@dataclass(frozen=True)
class LiveSegment:
    """A WAL segment file whose first page was written at the position its name says."""

    path: Path
    timeline: int
    number: int
    segment_size: int
    block_size: int

    @property
    def start(self) -> int:
        return self.number * self.segment_size


@dataclass(frozen=True)
class WalRecord:
    lsn: int
    total_length: int
    switch: bool  # an XLOG SWITCH record: the rest of its segment belongs to it


@dataclass(frozen=True)
class WalEnd:
    timeline: int
    lsn: int


def record_end(record: WalRecord, *, segment_size: int, block_size: int) -> int:
    """The position right after a record (where the next one starts, page headers aside), as recovery
    and walreceivers count it: its bytes laid over the pages, each page after the first beginning with
    a header, then MAXALIGNed; a SWITCH record runs to the end of its segment."""
    position, remaining = record.lsn, record.total_length
    while True:
        room = block_size - position % block_size
        taken = min(room, remaining)
        position += taken
        remaining -= taken
        if remaining == 0:
            break
        position += LONG_PAGE_HEADER if position % segment_size == 0 else SHORT_PAGE_HEADER
    end = -(-position // _MAXALIGN) * _MAXALIGN
    if record.switch:
        end = -(-end // segment_size) * segment_size
    return end


def _live(path: Path) -> LiveSegment | None:
    try:
        with path.open("rb") as handle:
            raw = handle.read(_LONG_HEADER.size)
        size = path.stat().st_size
    except OSError:
        return None
    if len(raw) < _LONG_HEADER.size:
        return None
    _magic, info, _tli, page_address, _rem, _sysid, segment_size, block_size = _LONG_HEADER.unpack(raw)
    if not info & _XLP_LONG_HEADER or segment_size <= 0 or segment_size & (segment_size - 1):
        return None  # never written (zeros) or not a first page
    if size != segment_size or block_size <= 0:
        return None
    segment = Segment.parse(path.name, segment_size)
    if segment.number == 0 or page_address != segment.number * segment_size:
        return None  # a recycled segment still holds the WAL of its former position
    return LiveSegment(path, segment.timeline, segment.number, segment_size, block_size)


def newest_live_segment(pg_wal: Path, timeline: int | None = None) -> LiveSegment | None:
    """The newest live segment on `timeline`, or on the newest timeline that has one."""
    try:
        names = [name.name for name in Path(pg_wal).iterdir() if is_segment(name.name)]
    except OSError:
        return None
    # Within a timeline, names sort by position (fixed-width hexadecimal).
    for name in sorted(names, reverse=True):
        if timeline is not None and int(name[:8], 16) != timeline:
            continue
        segment = _live(Path(pg_wal) / name)
        if segment is not None:
            return segment
    return None


def _previous(segment: LiveSegment) -> LiveSegment | None:
    name = Segment(segment.timeline, segment.number - 1).name(segment.segment_size)
    return _live(segment.path.parent / name)


def _parse_record(line: str) -> WalRecord | None:
    match = _RECORD.match(line)
    if match is None:
        return None
    switch = match["rmgr"] == "XLOG" and match["desc"] == "SWITCH"
    return WalRecord(parse_lsn(match["lsn"]), int(match["total"]), switch)


class WalEndReader:
    """Reads where valid WAL ends and whether the last shutdown was clean; cached per file version,
    cheap enough to ask every observation tick."""

    def __init__(self, bins: PgBinaries | None = None) -> None:
        self.bins = bins or PgBinaries.find()
        self._ends: dict[tuple[str, int, int], WalEnd | None] = {}
        self._controls: dict[tuple[str, int, int], ControlData | None] = {}

    def end(
        self, pgdata: Path | str, timeline: int | None = None, *, known: int | None = None
    ) -> WalEnd | None:
        """The end of the last valid record on `timeline` (default: the newest timeline with WAL),
        or None when it cannot be established. `known`: a position valid WAL reaches on it (where a
        running replica replayed to): read from there, not from the start of the segment."""
        newest = newest_live_segment(Path(pgdata) / "pg_wal", timeline)
        if newest is None:
            return None
        try:
            stat = newest.path.stat()
        except OSError:
            return None
        key = (str(newest.path), stat.st_size, stat.st_mtime_ns)
        if key not in self._ends:
            if len(self._ends) > 256:
                self._ends.clear()
            self._ends[key] = (
                self._after_clean_shutdown(pgdata, newest)
                or self._scan_from(newest, known)
                or self._scan(newest)
            )
        return self._ends[key]

    def _scan_from(self, segment: LiveSegment, known: int | None) -> WalEnd | None:
        """The end of valid WAL read from `known` on (within the segment), or None to scan it whole."""
        if known is None or not segment.start < known < segment.start + segment.segment_size:
            return None
        quiet = self._waldump(segment, known, "--quiet")
        if quiet is None:
            return None
        if _NOTHING_VALID in quiet.stderr:
            return WalEnd(segment.timeline, known)  # nothing valid after what is known to be
        found = _LAST_VALID.search(quiet.stderr)
        if found is None or parse_lsn(found.group(1)) < known:
            return None
        listed = self._waldump(segment, parse_lsn(found.group(1)), "--limit=1")
        record = None if listed is None else _parse_record(listed.stdout.split("\n", 1)[0])
        if record is None:
            return None
        end = record_end(record, segment_size=segment.segment_size, block_size=segment.block_size)
        return WalEnd(segment.timeline, max(end, known))

    def _after_clean_shutdown(self, pgdata: Path | str, newest: LiveSegment) -> WalEnd | None:
        """A primary shut down cleanly wrote its shutdown checkpoint record last: its WAL ends where
        that record ends, read alone (a fence's answer and the switchover after it wait for this)
        instead of scanning the segment from its start. None when that does not hold."""
        control = self.control(pgdata)
        if control is None or control.state != "shut down" or control.timeline != newest.timeline:
            return None
        try:
            checkpoint = parse_lsn(control.checkpoint_lsn)
        except ValueError:
            return None
        if not newest.start <= checkpoint < newest.start + newest.segment_size:
            return None
        listed = self._waldump(newest, checkpoint, "--limit=1")
        line = listed.stdout.split("\n", 1)[0] if listed is not None else ""
        record = _parse_record(line)
        if record is None or record.lsn != checkpoint or "desc: CHECKPOINT_SHUTDOWN" not in line:
            return None
        end = record_end(record, segment_size=newest.segment_size, block_size=newest.block_size)
        return WalEnd(newest.timeline, end)

    def shutdown_clean(self, pgdata: Path | str) -> bool | None:
        """pg_control's cluster state is "shut down" (in recovery or not); None when unreadable.
        Meaningful only while PostgreSQL is stopped."""
        control = self.control(pgdata)
        return None if control is None else control.cleanly_shut_down

    def control(self, pgdata: Path | str) -> ControlData | None:
        """pg_controldata of a data directory, kept until pg_control changes; None when unreadable.
        Meaningful only while PostgreSQL is stopped (a running server rewrites it)."""
        control = Path(pgdata) / "global" / "pg_control"
        try:
            stat = control.stat()
        except OSError:
            return None
        key = (str(control), stat.st_size, stat.st_mtime_ns)
        if key not in self._controls:
            if len(self._controls) > 256:
                self._controls.clear()
            try:
                self._controls[key] = read_controldata(pgdata, self.bins)
            except PostgresError:
                self._controls[key] = None
        return self._controls[key]

    def _scan(self, newest: LiveSegment) -> WalEnd | None:
        # The newest segment may hold nothing but the start of a record that never ended: then the end
        # is in the segment before it.
        for segment in (newest, _previous(newest)):
            if segment is None:
                return None
            record = self._last_record(segment)
            if record is not None:
                end = record_end(record, segment_size=segment.segment_size, block_size=segment.block_size)
                return WalEnd(segment.timeline, end)
        return None

    def _last_record(self, segment: LiveSegment) -> WalRecord | None:
        quiet = self._waldump(segment, segment.start, "--quiet")
        if quiet is None:
            return None
        found = _LAST_VALID.search(quiet.stderr)
        if found is not None and parse_lsn(found.group(1)) != 0:
            listed = self._waldump(segment, parse_lsn(found.group(1)), "--limit=1")
            return None if listed is None else _parse_record(listed.stdout.split("\n", 1)[0])
        if _NOTHING_VALID in quiet.stderr:
            return None
        # It stopped at a missing next segment without naming the last record: list them all.
        full = self._waldump(segment, segment.start)
        if full is None or not full.stdout.strip():
            return None
        return _parse_record(full.stdout.rstrip("\n").rsplit("\n", 1)[-1])

    def _waldump(
        self, segment: LiveSegment, start: int, *extra: str
    ) -> subprocess.CompletedProcess[str] | None:
        args = [
            self.bins.pg_waldump,
            f"--path={segment.path.parent}",
            f"--timeline={segment.timeline}",
            f"--start={format_lsn(start)}",
            # Never past this segment: pg_waldump retries a missing next segment for 5 s (the newest
            # segment of a base backup, or any that ends with a SWITCH record, is complete).
            f"--end={format_lsn(segment.start + segment.segment_size)}",
            *extra,
        ]
        try:
            return pg_run(args, env={"LC_ALL": "C"}, timeout=60, check=False, what="pg_waldump")
        except PostgresError:
            return None
