"""Member seeding and rejoining: initdb, pg_basebackup from the primary, a snapshot; an old
primary rejoining after a failover by pg_rewind, or by a fresh clone when pg_rewind fails."""

from __future__ import annotations

import json
import shutil

import pytest

from pgherd_backup.errors import PostgresError
from pgherd_backup.member import SnapshotSource, prepare_member
from pgherd_backup.postgres.config import read_pgherd_conf
from pgherd_backup.postgres.control import read_controldata
from pgherd_backup.postgres.rewind import rejoin_as_standby
from pgherd_backup.store import S3Settings, Store, StoreLocation


def _caught_up(standby, primary):
    lsn = primary.value("SELECT pg_current_wal_lsn()")
    standby.wait_until(
        lambda: standby.value(f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'"), f"replay of {lsn}"
    )


def test_first_member_initdb_then_a_replica_cloned_from_it(pg_factory):
    primary = pg_factory("m0")
    assert (
        prepare_member(primary.pgdata, settings=primary.settings(False), new_cluster=True).action == "initdb"
    )
    primary.start()
    assert not primary.in_recovery()
    replica = pg_factory("m1")
    prepared = prepare_member(replica.pgdata, settings=replica.settings(False), primary_dsn=primary.dsn)
    assert prepared.action == "basebackup"
    assert read_pgherd_conf(replica.pgdata)["port"] == str(replica.port)
    replica.start()
    primary.sql("CREATE TABLE t AS SELECT 42 AS answer")
    _caught_up(replica, primary)
    assert replica.in_recovery() and replica.value("SELECT answer FROM t") == 42
    # restarted with a primary named, a standby stays a standby
    replica.stop()
    again = prepare_member(replica.pgdata, settings=replica.settings(False), primary_dsn=primary.dsn)
    assert again.action == "standby"
    # restarted without a primary, a member never promotes itself
    assert prepare_member(replica.pgdata, settings=replica.settings(False)).action == "existing"
    replica.start()
    assert replica.in_recovery()
    control = read_controldata(replica.pgdata)
    assert control.system_id == read_controldata(primary.pgdata).system_id


def test_replica_seeded_from_a_snapshot_then_streams(pg_factory, s3_store, agent):
    primary = pg_factory("m0", env=s3_store.env()).initdb(archive=True).start()
    primary.sql("CREATE TABLE t AS SELECT g FROM generate_series(1, 10000) g")
    assert agent("snapshot", "--source", primary.dsn).returncode == 0
    primary.sql("INSERT INTO t SELECT g FROM generate_series(10001, 20000) g")
    primary.switch_and_wait_archived()
    store = Store(StoreLocation.parse(s3_store.url, s3_store.cluster), S3Settings.from_env(s3_store.env()))
    replica = pg_factory("m1", env=s3_store.env())
    prepared = prepare_member(
        replica.pgdata,
        settings=replica.settings(True),
        primary_dsn=primary.dsn,
        snapshot=SnapshotSource(store),
    )
    assert prepared.action == "snapshot"
    assert (replica.pgdata / "standby.signal").exists()
    replica.start()
    primary.sql("INSERT INTO t VALUES (0)")
    _caught_up(replica, primary)
    assert replica.in_recovery() and replica.value("SELECT count(*) FROM t") == 20001
    replica.wait_until(
        lambda: replica.value("SELECT status FROM pg_stat_wal_receiver") == "streaming", "streaming"
    )


def _failover(pg_pair):
    """Promote the standby while the old primary takes one more (divergent) write, then stop it."""
    primary, standby = pg_pair
    primary.sql("CREATE TABLE t (x text)")
    primary.sql("INSERT INTO t VALUES ('common')")
    _caught_up(standby, primary)
    standby.promote()
    standby.wait_promoted()
    primary.sql("INSERT INTO t VALUES ('lost on the old primary')")
    primary.sql("CHECKPOINT")
    standby.sql("INSERT INTO t VALUES ('after failover')")
    primary.stop()
    return primary, standby


def test_old_primary_rejoins_with_pg_rewind(pg_pair):
    old, new = _failover(pg_pair)
    own_port = read_pgherd_conf(old.pgdata)["port"]
    result = rejoin_as_standby(old.pgdata, new.dsn)
    assert result.method == "rewind" and result.kept_aside is None
    assert read_pgherd_conf(old.pgdata)["port"] == own_port
    old.start()
    _caught_up(old, new)
    assert old.in_recovery()
    assert old.value("SELECT received_tli FROM pg_stat_wal_receiver") == 2
    assert sorted(r[0] for r in old.sql("SELECT x FROM t")) == ["after failover", "common"]


def test_old_primary_is_recloned_when_pg_rewind_fails(pg_pair):
    old, new = _failover(pg_pair)
    for segment in (old.pgdata / "pg_wal").glob("0000000*"):
        segment.unlink()  # pg_rewind cannot find the divergence point any more
    result = rejoin_as_standby(old.pgdata, new.dsn)
    assert result.method == "reclone"
    assert result.kept_aside is not None and (result.kept_aside / "PG_VERSION").exists()
    old.start()
    _caught_up(old, new)
    assert sorted(r[0] for r in old.sql("SELECT x FROM t")) == ["after failover", "common"]
    shutil.rmtree(result.kept_aside)


def test_a_primary_that_does_not_answer_is_never_a_reason_to_reclone(pg_pair):
    """pg_rewind failing because the new primary does not answer says nothing of this member's data: a
    re-clone would fail the same way, after moving that data aside (CI, 2026-12-06)."""
    old, new = _failover(pg_pair)
    new.stop()
    before = sorted(p.name for p in old.pgdata.parent.iterdir())
    with pytest.raises(PostgresError, match="no connection to the primary"):
        rejoin_as_standby(old.pgdata, new.dsn)
    assert sorted(p.name for p in old.pgdata.parent.iterdir()) == before
    assert (old.pgdata / "PG_VERSION").exists() and not (old.pgdata / "standby.signal").exists()
    new.start()
    assert rejoin_as_standby(old.pgdata, new.dsn).method == "rewind"


def test_a_primary_gone_during_the_rewind_is_no_reason_to_reclone_either(pg_pair, monkeypatch):
    """pg_rewind failed and its source went away meanwhile (stopped between the CHECKPOINT and the
    rewind's own connection): the re-clone would fail after moving the data aside."""
    from pgherd_backup.postgres import rewind as rewinding

    old, new = _failover(pg_pair)

    def rewind_while_the_primary_stops(*args, **kwargs):
        new.stop()
        raise PostgresError("pg_rewind failed (exit 1): could not connect to the source server")

    monkeypatch.setattr(rewinding, "rewind", rewind_while_the_primary_stops)
    before = sorted(p.name for p in old.pgdata.parent.iterdir())
    with pytest.raises(rewinding.SourceUnreachable):
        rejoin_as_standby(old.pgdata, new.dsn)
    assert sorted(p.name for p in old.pgdata.parent.iterdir()) == before
    assert (old.pgdata / "PG_VERSION").exists()


def test_instance_commands(pg_factory, agent):
    member = pg_factory("cli")
    seeded = agent(
        "instance", "seed", "--pgdata", str(member.pgdata), "--port", str(member.port), "--new-cluster"
    )
    assert seeded.returncode == 0, seeded.stderr
    assert seeded.json()["action"] == "initdb"
    assert agent("instance", "start", "--pgdata", str(member.pgdata)).returncode == 0
    assert member.value("SELECT 1") == 1
    control = agent("instance", "controldata", "--pgdata", str(member.pgdata))
    assert json.loads(control.stdout)["state"] == "in production"
    assert agent("instance", "stop", "--pgdata", str(member.pgdata)).returncode == 0
    empty = agent("instance", "seed", "--pgdata", str(member.pgdata) + "-none", "--port", "1")
    assert empty.returncode != 0 and "nothing to seed it from" in empty.stderr
