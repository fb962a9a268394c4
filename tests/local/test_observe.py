"""Parsing what PostgreSQL reports, and observing an unreachable member quickly."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

from pgherd.agentview import parse_sync_standby_names
from pgherd.engine.quorum import SyncConfig
from pgherd.local.observe import observe
from pgherd_backup.postgres import config, postmaster, seed


def test_parse_the_forms_pgherd_writes() -> None:
    assert parse_sync_standby_names("") == SyncConfig()
    assert parse_sync_standby_names('ANY 1 ("a-1", "a-2")') == SyncConfig(1, frozenset({"a-1", "a-2"}))
    assert parse_sync_standby_names("any 2 (x, y, z)") == SyncConfig(2, frozenset({"x", "y", "z"}))
    # The rendering of the engine reads back as the same configuration.
    config = SyncConfig(2, frozenset({"h-1", "h-2", "h-3"}))
    assert parse_sync_standby_names(config.render()) == config


def test_a_hand_written_list_is_reported_not_guessed_away() -> None:
    assert parse_sync_standby_names("a, b") == SyncConfig(1, frozenset({"a", "b"}))


def test_an_unreachable_member_is_reported_fast() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    result = observe(f"host=127.0.0.1 port={port} user=postgres dbname=postgres")
    assert not result.reachable and result.error
    assert time.monotonic() - started < 2


def _wait_replayed(standby: Any, lsn: str) -> None:
    standby.wait_until(
        lambda: bool(standby.value(f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn")),
        f"replay of {lsn}",
    )


def test_a_diverged_replica_reports_the_timeline_it_is_on(
    pg_pair: tuple[Any, Any], pg_factory: Callable[..., Any]
) -> None:
    """Issue #10 item 11: a history file of a newer timeline in pg_wal is no evidence of being on it."""
    primary, replica = pg_pair
    fork = pg_factory("fork")
    seed.basebackup_seed(fork.pgdata, primary.dsn, bins=fork.bins, settings=fork.settings(False))
    # The replica moves ahead on timeline 1, past what the fork holds...
    primary.sql("CREATE TABLE ahead AS SELECT generate_series(1, 1000) AS x")
    _wait_replayed(replica, str(primary.value("SELECT pg_current_wal_lsn()")))
    primary.stop()
    # ...and the fork is promoted on its own: timeline 2 forks from timeline 1 behind the replica.
    fork.start()
    fork.promote()
    fork.wait_promoted()
    assert fork.timeline() == 2

    # Pointed at the fork, the replica's walreceiver fetches 00000002.history, but the replica
    # cannot follow timeline 2: it stays on timeline 1.
    config.update_pgherd_conf(replica.pgdata, {"primary_conninfo": fork.dsn})
    postmaster.reload(replica.pgdata, bins=replica.bins)
    replica.wait_until(lambda: (replica.pgdata / "pg_wal" / "00000002.history").exists(), "the history file")
    replica.wait_until(lambda: "before current recovery point" in replica.log, "the refusal to switch")

    seen = observe(replica.dsn)
    assert seen.reachable and seen.in_recovery
    assert seen.timeline == 1


def test_a_replica_that_followed_a_promotion_reports_the_new_timeline_without_its_upstream(
    pg_pair: tuple[Any, Any], pg_factory: Callable[..., Any]
) -> None:
    """Its last restartpoint is still on timeline 1 and its receiver is gone with the new primary:
    the WAL it received on timeline 2 says where it is."""
    primary, promoted = pg_pair
    follower = pg_factory("follower")
    seed.basebackup_seed(follower.pgdata, primary.dsn, bins=follower.bins, settings=follower.settings(False))
    follower.start()
    primary.sql("CREATE TABLE before_promotion AS SELECT 1 AS x")
    lsn = str(primary.value("SELECT pg_current_wal_lsn()"))
    _wait_replayed(promoted, lsn)
    _wait_replayed(follower, lsn)
    primary.stop()
    promoted.promote()
    promoted.wait_promoted()

    config.update_pgherd_conf(follower.pgdata, {"primary_conninfo": promoted.dsn})
    postmaster.reload(follower.pgdata, bins=follower.bins)
    promoted.sql("CREATE TABLE after_promotion AS SELECT 2 AS x")
    _wait_replayed(follower, str(promoted.value("SELECT pg_current_wal_lsn()")))
    assert follower.value("SELECT timeline_id FROM pg_control_checkpoint()") == 1
    postmaster.stop(promoted.pgdata, bins=promoted.bins, mode="immediate")
    follower.wait_until(
        lambda: follower.value("SELECT count(*) FROM pg_stat_wal_receiver") == 0, "no receiver"
    )

    assert observe(follower.dsn).timeline == 2
