"""Issue #10 items 6 and 7, on the members' agents: the WAL a member provably holds, as the sandbox
reports it to the engine.

6: a stopped member's final WAL end is the end of valid WAL in its pg_wal (an unclean stop) or of
   its shutdown checkpoint record (a clean one), never pg_control's checkpoint location.
7: a restarted replica that cannot stream reports the WAL it holds, not pg_last_wal_receive_lsn().
"""

from __future__ import annotations

from collections.abc import Callable

from local_helpers import LocalCluster

from pgherd.engine import actions as act
from pgherd.local.pods import kill_pod
from pgherd_backup.postgres.walend import WalEndReader, newest_live_segment

WRITE = "CREATE TABLE IF NOT EXISTS t (x int); INSERT INTO t SELECT generate_series(1, 20000)"


def test_a_killed_primary_reports_its_true_wal_end(local_cluster: Callable[..., LocalCluster]) -> None:
    cluster = local_cluster(1)
    primary = cluster.name(0)
    cluster.sql(primary, "CHECKPOINT")
    cluster.sql(primary, WRITE)
    last_commit = cluster.lsn(primary, "SELECT pg_current_wal_lsn()")
    checkpoint = cluster.lsn(primary, "SELECT checkpoint_lsn FROM pg_control_checkpoint()")
    assert last_commit is not None and checkpoint is not None and checkpoint < last_commit

    # Its PostgreSQL is killed, and its agent cannot start it again (a parameter it refuses): it stays
    # down, unclean, until the engine fences it.
    parameters = cluster.platform.pods.parameters_file(primary)
    parameters.write_text(parameters.read_text() + "shared_buffers = 'lots'\n")
    kill_pod(cluster.paths, primary, postgres_only=True)
    cluster.wait_until(lambda: cluster.status(primary).crashes == 1, "the crash to be seen")
    cluster.apply(act.Fence(primary, reason="test"))
    view = cluster.member(primary)

    # Not pg_control's checkpoint location: the WAL written after it is there too.
    assert view.received_lsn is not None and view.received_lsn >= last_commit
    # At most a WAL segment beyond the last commit: what the server's background work (autovacuum,
    # hint bits' full-page images) wrote before the kill is there too (1.1 MiB seen on a loaded machine).
    assert view.held_lsn is not None and last_commit <= view.held_lsn < last_commit + 16 * 1024 * 1024
    assert view.received_lsn == view.held_lsn
    assert view.fenced and view.stopped and view.shutdown_clean is False
    assert view.timeline == 1


def test_a_cleanly_fenced_primary_reports_what_its_standby_received(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = local_cluster(2)
    primary, replica = cluster.name(0), cluster.name(1)
    cluster.sql(primary, WRITE)

    cluster.apply(act.Fence(primary, reason="switchover"))  # the agent checkpoints, then shuts down cleanly
    assert not cluster.running(primary)
    # The standby received everything up to the end of the shutdown checkpoint record.
    cluster.wait_until(lambda: not cluster.status(replica).streaming, "the standby to notice the shutdown")
    received = cluster.lsn(replica, "SELECT pg_last_wal_receive_lsn()")

    view = cluster.member(primary)
    assert view.received_lsn == view.held_lsn == received
    assert view.stopped and view.shutdown_clean is True
    # The agent read only the shutdown checkpoint record (pg_control names it): the same end as a scan
    # of the whole segment finds.
    pgdata = cluster.paths.member_data(primary)
    reader = WalEndReader()
    assert reader.control(pgdata) is not None and reader.control(pgdata).state == "shut down"  # type: ignore[union-attr]
    newest = newest_live_segment(pgdata / "pg_wal")
    assert newest is not None and reader._scan(newest) == reader.end(pgdata)
    assert reader._after_clean_shutdown(pgdata, newest) == reader.end(pgdata)
    assert reader.end(pgdata) is not None and reader.end(pgdata).lsn == received  # type: ignore[union-attr]


def test_a_restarted_replica_reports_the_wal_it_holds(local_cluster: Callable[..., LocalCluster]) -> None:
    cluster = local_cluster(2)
    primary, replica = cluster.name(0), cluster.name(1)
    # A restartpoint on the replica, then a one-hour apply delay: what it receives from here on stays
    # unreplayed, also after a restart (its replay position then says nothing of what it holds).
    cluster.sql(primary, "CHECKPOINT")
    flushed = cluster.lsn(primary, "SELECT pg_current_wal_flush_lsn()")
    cluster.wait_until(
        lambda: (cluster.lsn(replica, "SELECT pg_last_wal_replay_lsn()") or 0) >= (flushed or 0),
        "the replica to replay the checkpoint",
    )
    cluster.sql(replica, "CHECKPOINT")
    cluster.sql(replica, "ALTER SYSTEM SET recovery_min_apply_delay = '1h'")
    cluster.sql(replica, "SELECT pg_reload_conf()")
    cluster.wait_until(
        lambda: cluster.value(replica, "SHOW recovery_min_apply_delay") == "1h", "the apply delay"
    )

    cluster.sql(primary, WRITE)
    flushed = cluster.lsn(primary, "SELECT pg_current_wal_flush_lsn()")
    cluster.wait_until(
        lambda: cluster.lsn(replica, "SELECT pg_last_wal_receive_lsn()") == flushed,
        "the replica to receive the writes",
    )
    held_before = cluster.lsn(replica, "SELECT pg_last_wal_receive_lsn()")
    replayed = cluster.lsn(replica, "SELECT pg_last_wal_replay_lsn()")
    assert held_before is not None and replayed is not None and replayed < held_before

    # Its primary's pod is lost (not restarted: no platform loop here); the replica restarts and has
    # nothing to stream from.
    kill_pod(cluster.paths, primary)
    cluster.apply(act.RestartMember(replica, "r2"))
    cluster.wait_idle(replica)
    assert cluster.running(replica) and cluster.status(replica).revision == "r2"
    received_now = cluster.lsn(replica, "SELECT pg_last_wal_receive_lsn()")
    assert received_now is None or received_now < held_before

    view = cluster.member(replica)
    assert view.reachable and not view.wal_receiver_streaming
    assert view.held_lsn is not None and view.held_lsn >= held_before
    assert view.most_wal is not None and view.most_wal >= held_before
    # The agent read its pg_wal from where it replayed to, not from the segment's start: the same end.
    pgdata = cluster.paths.member_data(replica)
    replayed_now = cluster.lsn(replica, "SELECT pg_last_wal_replay_lsn()")
    newest = newest_live_segment(pgdata / "pg_wal")
    assert newest is not None and replayed_now is not None
    reader = WalEndReader()
    assert reader._scan_from(newest, replayed_now) == reader._scan(newest) == reader.end(pgdata)
    assert reader.end(pgdata) is not None and reader.end(pgdata).lsn == view.held_lsn  # type: ignore[union-attr]
