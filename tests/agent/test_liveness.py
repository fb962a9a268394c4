"""The liveness probe answers for the agent, not for PostgreSQL: while the agent starts a crashed
PostgreSQL again, through a crash recovery however long, `/healthz` stays 200, so that the kubelet
never kills the pod that is doing the recovering (a long recovery would otherwise become a restart
loop: each kill starts the recovery over). And the restart begins at once, whatever the dead postmaster
left running."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import psycopg
from agent_helpers import MEMBERS

from pgherd_backup.postgres import postmaster


def test_liveness_holds_through_a_crash_and_a_long_crash_recovery(agents):
    primary = agents.primary(
        MEMBERS[0], "--parameter", "checkpoint_timeout=1h", "--parameter", "max_wal_size=16GB"
    )
    primary.sql("CHECKPOINT")
    # WAL that the crash recovery must replay: seconds of it, since no checkpoint comes in between.
    primary.sql("CREATE TABLE big (x int, pad text)")
    primary.sql("INSERT INTO big SELECT g, repeat('x', 200) FROM generate_series(1, 1500000) g")

    def long_query() -> None:
        # Counting in a tight loop: a backend notices its postmaster's death only when it next waits.
        with contextlib.suppress(psycopg.Error), psycopg.connect(primary.dsn(), autocommit=True) as conn:
            conn.execute("SELECT count(*) FROM generate_series(1, 1000000000)")

    threading.Thread(target=long_query, daemon=True).start()
    counting = (
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND pid <> pg_backend_pid() "
        "AND query LIKE '%generate_series(1, 1000000000)%'"
    )
    primary.wait_until(lambda: primary.value(counting) == 1, "the long query")
    client = primary.client
    # The postmaster alone, as the OOM killer does: the backend in its query outlives it for a while.
    pid = postmaster.postmaster_pid(primary.pgdata)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    answers: list[tuple[float, int, str]] = []
    while time.monotonic() - killed < 120:
        code = client.probe("healthz")
        state = primary.status().postmaster
        answers.append((time.monotonic() - killed, code, state))
        # Running again once the agent has seen the crash: a status read in the first milliseconds
        # after the kill may still report the old postmaster running.
        if state == "running" and any(a[2] != "running" for a in answers):
            break
        time.sleep(0.05)
    assert answers[-1][2] == "running", answers[-5:]
    before_running = [a for a in answers if a[2] != "running"]
    assert len(before_running) >= 5, f"the restart and recovery took no time to watch: {answers}"
    failed = [a for a in answers if a[1] != 200]
    assert not failed, f"liveness failed while the agent restarted PostgreSQL: {failed[:5]}"
    # One start, at once: the first attempt is the one that recovers (it killed the backend left over).
    first_start = next(i for i, a in enumerate(answers) if a[2] == "starting")
    assert answers[first_start][0] < 2.0, f"the restart began late: {answers[: first_start + 1]}"
    assert {a[2] for a in answers[first_start:]} <= {"starting", "running"}, answers
    assert "failed (attempt" not in primary.log
    assert "killed 1 process(es) a dead PostgreSQL left running" in primary.log
    assert primary.value("SELECT count(*) FROM big") == 1500000
