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

from pgherd_backup.agent.upstream import APPLICATION

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
        # The receiver gives up at wal_receiver_timeout, its row gone: the agent dates the loss at its first
        # sample without the row (it cannot tell a timeout from a closed connection: the later date is the
        # safe one), and the silence goes on from there. The operator's vote kept the stream's earlier date.
        replica.wait_until(
            lambda: not replica.status().streaming, "the receiver giving up", timeout=3 * TIMEOUT
        )
        after = replica.status().upstream_silent_seconds
        assert after is not None and after < TIMEOUT, after
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


# The agent reads its clock for the figure somewhere between the test's request and its answer: the date
# it means lies in [asked - silence, answered - silence]. The check below (answered - silence >= kill)
# thus proves the agent's date is at most the round trip (tens of ms, bounded by ROUND_TRIP) before the
# kill; the aged sample of the last poll was 2 s before it.
ROUND_TRIP = 0.25
LATE = 0.5  # the agent samples its receiver every 0.1 s and at its end: dated at most a sample late


def test_a_dead_primary_is_dated_from_the_replicas_own_samples_not_from_the_operators_last_poll(agents):
    """The primary's postmaster is killed while nobody asks the replica's agent anything: the date of the
    loss it then reports (now - upstream_silent_seconds) is never before the kill (the primary's last
    word is at most the kill), and at most a sample after it. Ageing the sample of the last /status,
    taken seconds before, would date it that much too early: a failover before detectionSeconds."""
    primary = agents.primary(MEMBERS[0])
    replica = agents(MEMBERS[1], "--seed", "basebackup", "--upstream", primary.address)
    replica.wait_streaming()  # the last /status before the kill
    assert primary.process is not None
    primary.signal(signal.SIGSTOP)  # its agent would start PostgreSQL again at once (a crash)
    try:
        time.sleep(2.0)  # a steady operator's poll interval, without a poll
        postmaster = int((primary.pgdata / "postmaster.pid").read_text().split()[0])
        killed = time.monotonic()
        os.kill(postmaster, signal.SIGKILL)
        time.sleep(1.0)  # the receiver gone, well before the replica is asked again
        asked = time.monotonic()
        status = replica.status()
        answered = time.monotonic()
    finally:
        primary.signal(signal.SIGCONT)
    assert not status.streaming, status.wal_receiver
    silence = status.upstream_silent_seconds
    assert silence is not None
    assert answered - asked < ROUND_TRIP
    earliest, latest = asked - silence, answered - silence  # the agent's date, within the round trip
    assert latest >= killed, f"dated at least {killed - latest:.3f}s before the kill"
    assert latest <= killed + LATE, f"dated {latest - killed:.3f}s after the kill"
    print(f"dated {earliest - killed:+.3f}..{latest - killed:+.3f}s from the kill")


def test_the_watch_samples_a_replica_only_and_stops_at_its_promotion(agents):
    primary = agents.primary(MEMBERS[0])
    replica = agents(MEMBERS[1], "--seed", "basebackup", "--upstream", primary.address)
    replica.wait_streaming()
    watching = f"SELECT count(*) FROM pg_stat_activity WHERE application_name = '{APPLICATION}'"
    replica.wait_until(lambda: replica.value(watching) == 1, "the watch's connection")
    assert primary.value(watching) == 0  # a primary has no upstream to watch
    primary.client.fence(reason="a test")
    replica.client.promote()
    replica.wait_until(lambda: replica.value(watching) == 0, "the watch's connection closed", timeout=5)
    assert replica.status().upstream_silent_seconds is None


GRACE = 3.0


def test_a_replica_that_lost_its_primary_keeps_serving_reads_for_the_route_grace(agents):
    """/readyz (the kubelet's: the -ro Service's endpoints) keeps a replica whose primary just died for
    --route-grace, while its /status `ready` (the operator's) says at once that it does not stream; once
    the grace has passed, /readyz says not ready too."""
    primary = agents.primary(MEMBERS[0])
    replica = agents(
        MEMBERS[1], "--seed", "basebackup", "--upstream", primary.address, "--route-grace", f"{GRACE:g}"
    )
    replica.wait_streaming()
    assert replica.client.probe("readyz") == 200
    assert primary.process is not None
    primary.signal(signal.SIGSTOP)  # its agent would start PostgreSQL again at once (a crash)
    try:
        postmaster = int((primary.pgdata / "postmaster.pid").read_text().split()[0])
        killed = time.monotonic()
        os.kill(postmaster, signal.SIGKILL)
        replica.wait_until(lambda: not replica.status().streaming, "the receiver gone", timeout=10)
        served: list[int] = []
        while time.monotonic() < killed + GRACE - 0.7:  # the probe's view may be 0.5 s old
            served.append(replica.client.probe("readyz"))
            assert not replica.status().ready  # the operator's view: not streaming
            time.sleep(0.2)
        assert served and set(served) == {200}, served
        replica.wait_until(
            lambda: replica.client.probe("readyz") == 503, "not ready after the grace", timeout=5
        )
        assert time.monotonic() - killed >= GRACE
    finally:
        primary.signal(signal.SIGCONT)
