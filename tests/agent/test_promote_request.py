"""A promotion requested while PostgreSQL's startup process is starting a WAL receiver to a lost primary.
The startup process takes the request, stops the receiver that has not started yet (nothing wakes it
for that) and sleeps out the rest of `wal_retrieve_retry_interval` before it acts on the request: 0.49 s
of one failover traced on localkube (docs/e2e.md, 2026-12-07). The agent asks again until recovery has
ended, which wakes it.

Real PostgreSQL: the receiver is kept "starting" by an RLIMIT_NPROC on the replica's postmaster, which
then cannot fork it; the request comes on a connection opened before."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psycopg
from agent_helpers import MEMBERS

from pgherd_backup.agent.actions import end_recovery
from pgherd_backup.postgres.postmaster import postmaster_pid

RETRY = 5.0  # the replica's wal_retrieve_retry_interval here: the sleep a request must not wait out


def _limit_forks(pid: int, limit: str) -> None:
    """Set the process' soft RLIMIT_NPROC ("1", or "restore" to its hard limit) as its own user: this
    machine's root lacks CAP_SYS_RESOURCE, which changing another user's process needs."""
    owner = os.stat(f"/proc/{pid}")
    code = (
        "import resource, sys; pid = int(sys.argv[1]); hard = resource.prlimit(pid, resource.RLIMIT_NPROC)[1]; "
        "resource.prlimit(pid, resource.RLIMIT_NPROC, (hard if sys.argv[2] == 'restore' else int(sys.argv[2]), hard))"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(pid), limit],
        user=owner.st_uid,
        group=owner.st_gid,
        extra_groups=[],
        check=True,
        timeout=30,
    )


def _startup_waits_on(conn: psycopg.Connection, event: str) -> bool:
    row = conn.execute("SELECT wait_event FROM pg_stat_activity WHERE backend_type = 'startup'").fetchone()
    return row is not None and row[0] == event


def test_a_promotion_requested_while_a_wal_receiver_starts_is_not_slept_on(agents):
    primary = agents.primary(MEMBERS[0])
    replica = agents(
        MEMBERS[1],
        "--seed",
        "basebackup",
        "--upstream",
        primary.address,
        "--parameter",
        f"wal_retrieve_retry_interval={int(RETRY * 1000)}ms",
    )
    replica.wait_streaming()
    pid = postmaster_pid(replica.pgdata)
    assert pid is not None
    with psycopg.connect(replica.dsn(), autocommit=True) as conn:
        primary.client.fence(reason="the primary is lost")
        # Its receiver gone and one more refused, the startup process sleeps between attempts.
        replica.wait_until(
            lambda: _startup_waits_on(conn, "RecoveryRetrieveRetryInterval"), "the retry sleep"
        )
        try:
            _limit_forks(pid, "1")
            # The next attempt asks the postmaster for a receiver, which it cannot fork.
            replica.wait_until(lambda: _startup_waits_on(conn, "RecoveryWalStream"), "a receiver starting")
            assert conn.execute("SELECT count(*) FROM pg_stat_wal_receiver").fetchone() == (0,)
            began = time.monotonic()
            assert end_recovery(conn, 30)
            took = time.monotonic() - began
        finally:
            _limit_forks(pid, "restore")
    assert took < RETRY / 2, (
        f"the promotion took {took:.2f}s: the startup process slept out its retry interval"
    )
    replica.wait_until(lambda: replica.status().role == "primary", "the agent sees a primary")
