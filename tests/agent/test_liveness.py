"""The liveness probe answers for the agent, not for PostgreSQL: while the agent starts a crashed
PostgreSQL again, through a crash recovery however long, `/healthz` stays 200, so that the kubelet
never kills the pod that is doing the recovering (a long recovery would otherwise become a restart
loop: each kill starts the recovery over)."""

from __future__ import annotations

import time

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
    client = primary.client
    postmaster.kill(primary.pgdata)
    killed = time.monotonic()
    answers: list[tuple[float, int, str]] = []
    while time.monotonic() - killed < 120:
        code = client.probe("healthz")
        state = primary.status().postmaster
        answers.append((time.monotonic() - killed, code, state))
        if state == "running":
            break
        time.sleep(0.05)
    assert answers[-1][2] == "running", answers[-5:]
    before_running = [a for a in answers if a[2] != "running"]
    assert len(before_running) >= 5, f"the restart and recovery took no time to watch: {answers}"
    failed = [a for a in answers if a[1] != 200]
    assert not failed, f"liveness failed while the agent restarted PostgreSQL: {failed[:5]}"
    assert primary.value("SELECT count(*) FROM big") == 1500000
