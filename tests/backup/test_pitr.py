"""Point-in-time recovery: to a time or an LSN between two transactions, and the refusals
(a target before the snapshot, a WAL segment missing from the archive)."""

from __future__ import annotations

import time

from backup_helpers import TRACEBACK, set_port


def _two_transactions(primary):
    """Commit A, note the time and LSN after it, commit B, archive everything; returns (time, lsn)."""
    primary.sql("CREATE TABLE marks (name text, at timestamptz DEFAULT clock_timestamp())")
    primary.sql("INSERT INTO marks (name) VALUES ('A')")
    lsn_after_a = primary.value("SELECT pg_current_wal_insert_lsn()::text")
    time.sleep(0.3)
    between = primary.value("SELECT clock_timestamp()")
    time.sleep(0.3)
    primary.sql("INSERT INTO marks (name) VALUES ('B')")
    primary.switch_and_wait_archived()
    return between, lsn_after_a


def test_pitr_lands_exactly_between_two_transactions(pg_factory, s3_store, agent):
    primary = pg_factory("primary", env=s3_store.env()).initdb(archive=True).start()
    primary.sql("CREATE TABLE base AS SELECT g FROM generate_series(1, 1000) g")
    assert agent("snapshot", "--source", primary.dsn).returncode == 0
    between, lsn_after_a = _two_transactions(primary)

    by_time = pg_factory("by_time", env=s3_store.env())
    result = agent("restore", "--pgdata", str(by_time.pgdata), "--target-time", between.isoformat())
    assert result.returncode == 0, result.stderr
    set_port(by_time)
    by_time.start()
    by_time.wait_promoted()
    assert [r[0] for r in by_time.sql("SELECT name FROM marks ORDER BY at")] == ["A"]
    assert by_time.value("SELECT count(*) FROM base") == 1000

    by_lsn = pg_factory("by_lsn", env=s3_store.env())
    result = agent("restore", "--pgdata", str(by_lsn.pgdata), "--target-lsn", lsn_after_a)
    assert result.returncode == 0, result.stderr
    set_port(by_lsn)
    by_lsn.start()
    by_lsn.wait_promoted()
    assert [r[0] for r in by_lsn.sql("SELECT name FROM marks ORDER BY at")] == ["A"]


def test_target_time_before_the_snapshot_is_refused(pg_factory, s3_store, agent):
    primary = pg_factory("primary").initdb().start()
    early = primary.value("SELECT clock_timestamp()")
    time.sleep(0.2)
    snap = agent("snapshot", "--source", primary.dsn).json()
    target = pg_factory("target").pgdata
    for args in (["--snapshot", snap["id"]], []):
        result = agent("restore", "--pgdata", str(target), "--target-time", early.isoformat(), *args)
        assert result.returncode != 0
        assert "before the end of" in result.stderr and TRACEBACK not in result.stderr
        assert not target.exists()
    zoneless = agent("restore", "--pgdata", str(target), "--target-time", "2030-01-01T00:00:00")
    assert zoneless.returncode != 0 and "zone" in zoneless.stderr


def test_missing_wal_segment_for_the_target_is_reported(pg_factory, s3_store, agent):
    primary = pg_factory("primary", env=s3_store.env()).initdb(archive=True).start()
    assert agent("snapshot", "--source", primary.dsn).returncode == 0
    primary.sql("CREATE TABLE t (x int)")
    segments = []
    for i in range(3):
        primary.sql(f"INSERT INTO t VALUES ({i})")
        segments.append(primary.switch_and_wait_archived())
    target_time = primary.value("SELECT clock_timestamp()")
    primary.sql("INSERT INTO t VALUES (99)")
    primary.switch_and_wait_archived()
    missing = segments[1]
    key = next(k for k in s3_store.keys("") if k.endswith("/wal/" + missing))
    s3_store.endpoint.client().delete_object(Bucket=s3_store.endpoint.bucket, Key=key)

    target = pg_factory("target").pgdata
    result = agent("restore", "--pgdata", str(target), "--target-time", target_time.isoformat())
    assert result.returncode != 0
    assert f"WAL segment {missing} is missing" in result.stderr and TRACEBACK not in result.stderr
    assert not target.exists()
