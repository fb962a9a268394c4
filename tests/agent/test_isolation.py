"""A primary that hears neither the operator nor enough replicas fences itself (agent/isolation.py), on
the operator's order only. Real PostgreSQL, a real replica whose replies stop when its processes are
stopped (SIGSTOP: its connection open, nothing reset, as across a partition); the test stays silent as
the operator would be cut off (only the unauthenticated probes and SQL are used meanwhile)."""

from __future__ import annotations

import os
import signal
import time

import psycopg
from agent_helpers import MEMBERS

from pgherd_backup.agent.isolation import IsolationOrder

ORDER = IsolationOrder(seconds=3, peers=1)


def _writes(agent) -> bool:
    try:
        agent.sql("INSERT INTO t VALUES (1)")
        return True
    except psycopg.Error:
        return False


def test_a_primary_cut_off_from_the_operator_and_its_replica_fences_itself(agents):
    primary = agents.primary(MEMBERS[0])
    replica = agents(
        MEMBERS[1], "--seed", "basebackup", "--upstream", primary.address,
        "--parameter", "wal_receiver_status_interval=1s",
    )  # fmt: skip
    replica.wait_streaming()
    primary.sql("CREATE TABLE t (x int)")

    # Never ordered: the operator's silence alone changes nothing.
    time.sleep(ORDER.seconds + 1.5)
    assert _writes(primary) and not primary.status().fenced

    primary.client.status(isolation=ORDER)
    # The operator silent, but the replica replying every second: a majority is there, it goes on.
    time.sleep(ORDER.seconds + 2)
    assert _writes(primary)
    assert primary.client.probe("readyz") == 200

    # The replica's replies stop too.
    postmaster = int((replica.pgdata / "postmaster.pid").read_text().split()[0])
    receivers = [int(r[0]) for r in replica.sql("SELECT pid FROM pg_stat_wal_receiver")]
    stopped = [postmaster, *receivers]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        cut = time.monotonic()
        while _writes(primary):
            assert time.monotonic() - cut < ORDER.seconds + 10, "still taking writes"
            time.sleep(0.2)
        took = time.monotonic() - cut
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    # The last reply came up to a second before the cut: stopped within the order's seconds and a tick or
    # two (the check runs every second, then a checkpoint and a fast shutdown).
    assert took <= ORDER.seconds + 4, took
    assert primary.client.probe("readyz") == 503
    # Writes end when the fence begins; the postmaster exits after its CHECKPOINT, its shutdown and the
    # archiving of its last segment (a status read at once found it still running, in a CI run).
    primary.wait_until(lambda: primary.status().postmaster == "stopped", "the self-fence's stop", timeout=15)
    status = primary.status()  # the operator is back
    assert status.fenced and status.postmaster == "stopped"
    assert status.last_error is not None and "fencing itself" in status.last_error
    # What the engine does then (failover.unfence_again): Unfence, as the primary it was.
    primary.client.unfence(primary=True, reason="the operator is back, nothing was promoted")
    assert _writes(primary)


def test_a_primary_in_quorum_mode_is_left_running(agents):
    """It acknowledges nothing without a standby: stopping it would only end its reads."""
    primary = agents.primary(MEMBERS[0])
    primary.client.set_sync('ANY 1 ("nobody")')
    primary.client.status(isolation=IsolationOrder(seconds=1, peers=1))
    time.sleep(3.5)
    status = primary.status()
    assert not status.fenced and status.role == "primary"
