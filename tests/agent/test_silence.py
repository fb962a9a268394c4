"""A replica reports how long its primary has been silent (walReceiver.silentSeconds) and how long a
live primary may be (heartbeatSeconds: wal_receiver_timeout / 2, when the receiver asks it for a
word): a partition is silence on a stream that still says streaming, and the engine counts it as a
lost primary before the receiver gives up (pgherd.engine.failover). The silent primary here is real:
its WAL sender and postmaster stopped by SIGSTOP, connections open, nothing reset."""

from __future__ import annotations

import os
import signal
import time

from agent_helpers import MEMBERS

TIMEOUT = 4.0  # wal_receiver_timeout: the receiver asks after 2 s of quiet, gives up after 4 s
MARGIN = 1.0  # pgherd.engine.failover.SILENCE_MARGIN


def test_a_quiet_primary_is_never_silent_beyond_its_heartbeat_and_a_stopped_one_is(agents):
    primary = agents.primary(MEMBERS[0])
    replica = agents(
        MEMBERS[1],
        "--seed",
        "basebackup",
        "--upstream",
        primary.address,
        "--parameter",
        f"wal_receiver_timeout={TIMEOUT:g}s",
        "--parameter",
        "wal_receiver_status_interval=1s",
    )
    replica.wait_streaming()

    # Idle, nothing written: the replica's questions keep the silence under its heartbeat.
    quiet: list[float] = []
    deadline = time.monotonic() + 2.5 * TIMEOUT
    while time.monotonic() < deadline:
        receiver = replica.status().wal_receiver
        assert receiver is not None and receiver.status == "streaming"
        assert receiver.heartbeat_seconds == TIMEOUT / 2
        assert receiver.silent_seconds is not None
        quiet.append(receiver.silent_seconds)
        time.sleep(0.1)
    assert max(quiet) < TIMEOUT / 2 + MARGIN, quiet
    assert max(quiet) > TIMEOUT / 4  # it did go quiet: the heartbeat is what kept it short

    (sender,) = primary.sql("SELECT pid FROM pg_stat_replication")
    # The postmaster too: the receiver's reconnection hangs as it would across a partition.
    postmaster = int((primary.pgdata / "postmaster.pid").read_text().split()[0])
    stopped = [sender[0], postmaster]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        seen: list[tuple[str | None, float | None]] = []
        while time.monotonic() < deadline + 3 * TIMEOUT:
            receiver = replica.status().wal_receiver
            seen.append((receiver.status, receiver.silent_seconds) if receiver else (None, None))
            if (
                receiver
                and receiver.status == "streaming"
                and (receiver.silent_seconds or 0) > TIMEOUT / 2 + MARGIN
            ):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"no silence beyond the heartbeat while streaming: {seen}")
        assert replica.status().upstream_silent_seconds is not None
        # The receiver gives up at wal_receiver_timeout; the agent still knows when the primary last spoke.
        replica.wait_until(
            lambda: not replica.status().streaming, "the receiver giving up", timeout=3 * TIMEOUT
        )
        after = replica.status().upstream_silent_seconds
        assert after is not None and after >= TIMEOUT, after
        time.sleep(1)
        later = replica.status().upstream_silent_seconds
        assert later is not None and later > after
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    replica.wait_until(
        lambda: (
            (r := replica.status().wal_receiver) is not None
            and r.status == "streaming"
            and (r.silent_seconds or 0) < TIMEOUT / 2
        ),
        "streaming again, its primary speaking",
    )
