"""Retention: prune really deletes snapshots and the WAL only they needed, never the newest."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from pgherd_backup.errors import UsageError
from pgherd_backup.manifest import Manifest, format_time
from pgherd_backup.retention import parse_duration, plan_retention
from pgherd_backup.walnames import Segment


def _manifest(snapshot_id: str, stopped: datetime) -> Manifest:
    return Manifest(
        id=snapshot_id,
        cluster="c",
        system_id="1",
        timeline=1,
        start_lsn="0/1",
        stop_lsn="0/2",
        start_wal="000000010000000000000001",
        stop_wal="000000010000000000000001",
        start_time=format_time(stopped),
        stop_time=format_time(stopped),
        pg_version="15",
        pg_major=15,
        compression="zstd",
        source="primary",
        size=1,
        stored_size=1,
        objects=(),
    )


def test_plan_keeps_the_union_of_rules_and_always_the_newest():
    now = datetime(2025, 1, 10, tzinfo=UTC)
    snaps = [_manifest(f"s{i}", now - timedelta(days=10 - i)) for i in range(10)]
    plan = plan_retention(snaps, keep_last=2, keep_within=timedelta(days=3), now=now)
    assert [m.id for m in plan.keep] == ["s7", "s8", "s9"]
    plan = plan_retention(snaps, keep_last=0, keep_within=timedelta(seconds=1), now=now)
    assert [m.id for m in plan.keep] == ["s9"]
    with pytest.raises(UsageError):
        plan_retention(snaps, keep_last=None, keep_within=None)


def test_durations():
    assert parse_duration("7d") == timedelta(days=7)
    assert parse_duration("1w2d") == timedelta(days=9)
    assert parse_duration("PT12H") == timedelta(hours=12)
    assert parse_duration("P1D") == timedelta(days=1)
    with pytest.raises(UsageError):
        parse_duration("seven days")


def test_prune_deletes_old_snapshots_and_their_wal(pg_factory, s3_store, agent):
    primary = pg_factory("primary", env=s3_store.env()).initdb(archive=True).start()
    primary.sql("CREATE TABLE t (x int)")
    ids = []
    for i in range(3):
        primary.sql(f"INSERT INTO t VALUES ({i})")
        primary.switch_and_wait_archived()
        snap = agent("snapshot", "--source", primary.dsn)
        assert snap.returncode == 0, snap.stderr
        ids.append(snap.json())
    primary.switch_and_wait_archived()
    wal_before = s3_store.keys("/wal/")

    report = agent("prune", "--keep-last", "1")
    assert report.returncode == 0, report.stderr
    assert report.json()["kept"] == [ids[-1]["id"]]
    assert sorted(report.json()["deleted_snapshots"]) == sorted(s["id"] for s in ids[:-1])
    assert [s["id"] for s in agent("list", "--json").json()] == [ids[-1]["id"]]
    for old in ids[:-1]:
        assert s3_store.keys(f"/snapshots/{old['id']}/") == []

    oldest_kept = Segment.parse(ids[-1]["start_wal"]).number
    wal_after = s3_store.keys("/wal/")
    assert len(wal_after) < len(wal_before)
    for key in wal_after:
        name = key.rsplit("/", 1)[1]
        assert Segment.parse(name[:24]).number >= oldest_kept, f"{name} should have been pruned"
    assert any(k.endswith(ids[-1]["start_wal"]) for k in wal_after)

    # the newest snapshot survives any rule
    assert agent("prune", "--keep-last", "0", "--keep-within", "1s").returncode == 0
    assert [s["id"] for s in agent("list", "--json").json()] == [ids[-1]["id"]]
    # and the remaining snapshot still restores
    assert agent("verify", "latest").returncode == 0
