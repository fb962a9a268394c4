"""The end of valid WAL in a data directory (pgherd_backup.postgres.walend), on real PostgreSQL WAL."""

from __future__ import annotations

import itertools
import shutil
import subprocess

from pgherd_backup.postgres import postmaster
from pgherd_backup.postgres.control import read_controldata
from pgherd_backup.postgres.process import give_to_pg
from pgherd_backup.postgres.walend import (
    LONG_PAGE_HEADER,
    SHORT_PAGE_HEADER,
    WalEndReader,
    WalRecord,
    newest_live_segment,
    record_end,
)
from pgherd_backup.walnames import Segment, format_lsn, parse_lsn

WIDE_ROWS = "CREATE TABLE IF NOT EXISTS wide (x text); INSERT INTO wide SELECT repeat(md5(g::text), 300) FROM generate_series(1, 300) g"


def _lsn(instance, query: str) -> int:
    return parse_lsn(str(instance.value(query)))


def test_record_end_is_where_the_next_record_starts(pg_factory) -> None:
    pg = pg_factory("waldump").initdb().start()
    start = _lsn(pg, "SELECT pg_current_wal_lsn()")
    pg.sql(WIDE_ROWS)  # records of ~10 kB: they cross page boundaries
    pg.sql("CHECKPOINT")
    segment = newest_live_segment(pg.pgdata / "pg_wal")
    assert segment is not None
    listed = subprocess.run(
        [pg.bins.pg_waldump, f"--path={pg.pgdata / 'pg_wal'}", f"--start={format_lsn(start)}"],
        capture_output=True,
        text=True,
        env={"LC_ALL": "C"},
        check=False,
    ).stdout.splitlines()
    records = []
    for line in listed:
        lsn = parse_lsn(line.split(" lsn: ", 1)[1].split(",", 1)[0])
        total = int(line.split("len (rec/tot):", 1)[1].split("/", 1)[1].split(",", 1)[0])
        records.append(WalRecord(lsn, total, switch=False))
    assert len(records) > 100
    crossing = 0
    for record, following in itertools.pairwise(records):
        end = record_end(record, segment_size=segment.segment_size, block_size=segment.block_size)
        if end // segment.block_size != record.lsn // segment.block_size:
            crossing += 1
        if end % segment.block_size == 0:  # the next record starts after the next page's header
            header = LONG_PAGE_HEADER if end % segment.segment_size == 0 else SHORT_PAGE_HEADER
            assert following.lsn == end + header
        else:
            assert following.lsn == end, f"record at {format_lsn(record.lsn)}"
    assert crossing > 10


def test_the_wal_end_of_a_killed_server_is_past_its_last_commit(pg_factory) -> None:
    pg = pg_factory("killed").initdb().start()
    pg.sql("CHECKPOINT")
    pg.sql(WIDE_ROWS)
    last_commit = _lsn(pg, "SELECT pg_current_wal_lsn()")
    pg.kill()
    checkpoint = parse_lsn(read_controldata(pg.pgdata, pg.bins).checkpoint_lsn)
    reader = WalEndReader(pg.bins)

    end = reader.end(pg.pgdata)
    assert end is not None and end.timeline == 1
    assert checkpoint < last_commit <= end.lsn < last_commit + 64 * 1024
    assert reader.shutdown_clean(pg.pgdata) is False


def test_recycled_and_preallocated_segments_are_not_taken_for_wal(pg_factory) -> None:
    pg = pg_factory("recycled").initdb().start()
    pg.sql(WIDE_ROWS)
    pg.sql("SELECT pg_switch_wal()")
    pg.sql(WIDE_ROWS)
    last_commit = _lsn(pg, "SELECT pg_current_wal_lsn()")
    pg.kill()
    pg_wal = pg.pgdata / "pg_wal"
    live = newest_live_segment(pg_wal)
    assert live is not None
    # What a checkpoint leaves ahead of the insert position: an old segment renamed to a future name
    # (its pages still carry their old addresses), and a zero-filled preallocated one.
    older = Segment(1, live.number - 1).name(live.segment_size)
    recycled = pg_wal / Segment(1, live.number + 1).name(live.segment_size)
    preallocated = pg_wal / Segment(1, live.number + 2).name(live.segment_size)
    shutil.copy(pg_wal / older, recycled)
    with preallocated.open("wb") as handle:
        handle.truncate(live.segment_size)
    give_to_pg(recycled)
    give_to_pg(preallocated)

    assert newest_live_segment(pg_wal) == live
    end = WalEndReader(pg.bins).end(pg.pgdata)
    assert end is not None and last_commit <= end.lsn < last_commit + 64 * 1024


def test_a_segment_switch_ends_at_the_segment_boundary(pg_factory) -> None:
    pg = pg_factory("switched").initdb().start()
    pg.sql("CREATE TABLE t AS SELECT 1 AS x")
    pg.sql("SELECT pg_switch_wal()")
    boundary = _lsn(pg, "SELECT pg_current_wal_lsn()")
    pg.kill()
    live = newest_live_segment(pg.pgdata / "pg_wal")
    assert live is not None and boundary % live.segment_size == 0

    end = WalEndReader(pg.bins).end(pg.pgdata)
    assert end is not None and end.lsn >= boundary


def test_a_clean_shutdown_ends_with_its_checkpoint_record(pg_factory) -> None:
    pg = pg_factory("clean").initdb().start()
    pg.sql(WIDE_ROWS)
    before_shutdown = _lsn(pg, "SELECT pg_current_wal_lsn()")
    postmaster.stop(pg.pgdata, bins=pg.bins, mode="fast")
    control = read_controldata(pg.pgdata, pg.bins)
    reader = WalEndReader(pg.bins)

    end = reader.end(pg.pgdata)
    assert reader.shutdown_clean(pg.pgdata) is True
    assert end is not None
    # The shutdown checkpoint is the last record: the end lies right after it, past pg_control's
    # checkpoint location (the record's start) by the size of one checkpoint record.
    assert (
        before_shutdown
        <= parse_lsn(control.checkpoint_lsn)
        < end.lsn
        <= parse_lsn(control.checkpoint_lsn) + 256
    )
    pg.start()
    assert reader.shutdown_clean(pg.pgdata) is False  # running: pg_control says "in production"
