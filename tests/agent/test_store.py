"""The agent with an object store: WAL archived through the agent's WAL service (wal-push without it), a member seeded from a snapshot (as
a standby, or by a targeted recovery that promotes), restore_command asking the agent's WAL service."""

from __future__ import annotations

from pathlib import Path

from agent_helpers import CLUSTER, MEMBERS

from pgherd_backup.postgres.config import read_pgherd_conf


def test_archiving_and_seeding_from_a_snapshot(agents, s3_store, agent):
    s3 = s3_store.endpoint.env()  # credentials only: the store and cluster are the agent's flags
    store = ("--store", s3_store.url)
    primary = agents(MEMBERS[0], "--seed", "initdb", *store, env=s3)
    primary.sql("CREATE TABLE t AS SELECT generate_series(1, 1000) AS x")
    primary.value("SELECT pg_switch_wal()")
    primary.wait_until(
        lambda: primary.value("SELECT archived_count FROM pg_stat_archiver") > 0, "the archiving of a segment"
    )
    assert primary.status().archiving_healthy is True
    taken = agent("snapshot", "--cluster", CLUSTER, "--source", primary.dsn())
    assert taken.returncode == 0, taken.stderr
    primary.sql("INSERT INTO t SELECT generate_series(1001, 1500)")  # after the snapshot: streamed

    replica = agents(MEMBERS[1], "--seed", "snapshot", "--upstream", primary.address, *store, env=s3)
    status = replica.wait_streaming()
    assert status.role == "replica" and status.upstream == primary.address
    replica.wait_until(lambda: replica.value("SELECT count(*) FROM t") == 1500, "the rows written after")
    settings = read_pgherd_conf(replica.pgdata)
    socket = Path(settings["unix_socket_directories"]) / "wal.sock"
    assert socket.exists()  # the WAL service archive_command and restore_command ask first
    assert str(socket) in settings["restore_command"]
    assert str(socket) in settings["archive_command"] and "wal-push" in settings["archive_command"]

    # without an upstream: recover the archive to the target, then promote (bootstrap from a backup)
    restored = agents(MEMBERS[2], "--seed", "snapshot", "--recovery-target", "immediate", *store, env=s3)
    restored.wait_until(
        lambda: restored.status().role == "primary", "the promotion at the target", timeout=120
    )
    status = restored.status()
    assert status.timeline is not None and status.timeline >= 2
    assert restored.value("SELECT count(*) FROM t") == 1000  # the snapshot's content, not what came after
