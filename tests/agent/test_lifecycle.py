"""The agent's own life: crashes restart read-only, its restarts never start read-write, SIGTERM loses
no acknowledged commit and lets the operator switch a primary over first."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable

import psycopg
import pytest
from agent_helpers import MEMBERS, Agent, SlowProxy, writer

from pgherd_backup.agent.client import AgentActionError, AgentError
from pgherd_backup.agent.instance import ROUTE_SETTLE
from pgherd_backup.agent.options import socket_dir
from pgherd_backup.postgres import postmaster
from pgherd_backup.postgres.process import pg_popen


def test_a_crashed_primary_comes_back_read_only_at_once_and_the_crash_is_counted(agents):
    primary = agents.primary(MEMBERS[0])
    assert primary.status().role == "primary"
    primary.sql("CREATE TABLE kept (x int)")
    primary.sql("INSERT INTO kept VALUES (42)")
    postmaster.kill(primary.pgdata)  # kill -9 the postmaster and its children
    primary.wait_until(lambda: primary.status().crashes == 1, "the crash report", timeout=10)
    primary.wait_until(lambda: primary.status().postmaster == "running", "the restart", timeout=30)
    status = primary.status()
    assert status.role == "replica" and status.upstream is None and status.wal_receiver is None
    assert status.last_crash_at is not None and "unexpectedly" in (status.last_error or "")
    assert primary.value("SELECT pg_is_in_recovery()")
    assert primary.value("SELECT x FROM kept") == 42
    assert primary.client.probe("healthz") == 200
    assert primary.client.probe("readyz") == 503  # a replica with no upstream streams nothing
    # the operator's order, and only it, makes it the primary again (a new timeline)
    promoted = primary.client.promote()
    assert promoted.changed and promoted.timeline == 2
    assert not primary.value("SELECT pg_is_in_recovery()")


def test_it_never_starts_read_write_on_its_own_across_its_own_restarts(agents):
    primary = agents(MEMBERS[0], "--seed", "initdb")
    primary.sql("CREATE TABLE t (x int)")
    primary.stop()  # SIGTERM: clean shutdown, not fenced
    assert primary.wait_exit() == 0
    # the same command again (--seed initdb included): the data directory exists, it starts read-only
    primary.start()
    status = primary.status()
    assert (status.role, status.fenced, status.data_present) == ("replica", False, True)
    assert primary.value("SELECT pg_is_in_recovery()")
    # the agent killed outright (its PostgreSQL left running): the next agent stops the stray
    # postmaster and starts it read-only all the same
    primary.client.promote()
    assert primary.status().role == "primary"
    primary.signal(signal.SIGKILL)
    primary.wait_exit()
    assert postmaster.is_running(primary.pgdata)
    primary.start()
    assert primary.status().role == "replica"
    assert primary.value("SELECT pg_is_in_recovery()")
    assert "did not start" in primary.log


def test_a_member_made_again_starts_over_the_lock_files_its_killed_postgresql_left(agents):
    """A member's container killed (kill -9) leaves PostgreSQL's lock files on its volume: postmaster.pid
    and its socket's (.s.PGSQL.<port>.lock, in the agent's run directory). In the container made again the
    old postmaster's pid was a live process of the postgres account, and PostgreSQL, which only asks
    whether that pid exists, refused to start at every restart of the pod: 'lock file
    ".../run/.s.PGSQL.5432.lock" already exists' (localkube CI, 2026-12-06)."""
    primary = agents(MEMBERS[0], "--seed", "initdb")
    primary.signal(signal.SIGKILL)
    primary.wait_exit()
    postmaster.kill(primary.pgdata)  # the container's end: both die at once, their lock files stay
    sockets = socket_dir(primary.pgdata.parent / "agent", primary.pgdata)
    locks = [primary.pgdata / "postmaster.pid", *sockets.glob(".s.PGSQL.*.lock")]
    assert len(locks) == 2 and all(lock.exists() for lock in locks), locks
    # The old pid is now another process of the postgres account's, as in a new PID namespace.
    other = pg_popen(["sleep", "120"])
    try:
        for lock in locks:
            lines = lock.read_text().split("\n")
            lock.write_text("\n".join([str(other.pid), *lines[1:]]))
        primary.start()
        primary.wait_until(lambda: primary.status().postmaster == "running", "PostgreSQL running", timeout=30)
        assert primary.value("SELECT pg_is_in_recovery()")  # read-only, as after any crash
        assert other.poll() is None  # the process holding the old pid was left alone
    finally:
        other.kill()
        other.wait()


def test_sigterm_under_a_write_load_loses_no_acknowledged_commit(agents):
    primary = agents.primary(MEMBERS[0])
    with writer(primary, "acks") as acknowledged:
        primary.wait_until(lambda: len(acknowledged) > 200, "some acknowledged commits", timeout=60)
        primary.signal(signal.SIGTERM)
        assert primary.wait_exit(timeout=60) == 0
    assert len(acknowledged) > 200
    primary.start()  # same data directory: read-only, with everything that was acknowledged
    assert primary.status().role == "replica"
    stored = {row[0] for row in primary.sql("SELECT id FROM acks")}
    assert set(acknowledged) <= stored
    assert "fast shutdown" not in primary.log  # a clean fast shutdown, no escalation


def test_sigterm_on_a_primary_reports_terminating_and_waits_for_the_operator(agents):
    primary = agents.primary(MEMBERS[0], "--terminate-wait", "60")
    primary.signal(signal.SIGTERM)
    primary.wait_until(lambda: primary.status().terminating, "terminating", timeout=10)
    status = primary.status()
    assert (status.role, status.postmaster) == ("primary", "running")  # still serving until fenced
    fenced = primary.client.fence(reason="switchover before the pod goes")
    assert fenced.shutdown_clean and fenced.final_lsn is not None
    # It stays while the operator promotes another member: clients of the -rw Service still routed
    # here are refused at once (a vanished pod's address would keep them waiting for a timeout).
    time.sleep(1.5)
    status = primary.status()
    assert status.terminating and status.fenced and status.postmaster != "running"
    _refuses_clients_at_once(primary)
    # Nothing starts PostgreSQL there again: the abandoned switchover's Unfence is refused.
    with pytest.raises(AgentActionError, match="shutting down"):
        primary.client.unfence(primary=True, reason="switchover abandoned")
    _goes_once_handed_over(primary)


def test_a_primary_fenced_before_its_sigterm_still_stays_until_the_hand_over(agents):
    """The operator starts the switchover on the pod's deletion (its watch event), which may reach it
    before the kubelet's SIGTERM reaches the agent: fenced first, the primary must still stay until the
    operator's Rejoin. Seen on localkube (2026-12-07): its agent went at once, and writes through the -rw
    Service waited 4.7 s for the vanished address until kube-proxy routed them to the new primary."""
    primary = agents.primary(MEMBERS[0], "--terminate-wait", "60")
    assert primary.client.fence(reason="switchover: the pod is being deleted").shutdown_clean
    primary.signal(signal.SIGTERM)
    time.sleep(1.5)
    assert primary.process is not None and primary.process.poll() is None, "it went before the hand-over"
    _refuses_clients_at_once(primary)
    _goes_once_handed_over(primary)


def _refuses_clients_at_once(primary: Agent) -> None:
    """Clients of the -rw Service still routed here are refused at once (a vanished pod's address would
    keep them waiting for a timeout)."""
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError, match="refused"):
        psycopg.connect(primary.dsn())
    assert time.monotonic() - started < 1


def _goes_once_handed_over(primary: Agent) -> None:
    """The operator's Rejoin, once the new primary is recorded, says the hand-over is done: it goes,
    after ROUTE_SETTLE for kube-proxy to apply the -rw Service's new endpoint."""
    handed_over = time.monotonic()
    with pytest.raises(AgentActionError, match="shutting down"):
        primary.client.rejoin("127.0.0.1:1", reason="new primary elsewhere")
    assert primary.wait_exit(timeout=30) == 0
    assert ROUTE_SETTLE <= time.monotonic() - handed_over < ROUTE_SETTLE + 5


def test_a_fenced_replica_goes_at_once_on_sigterm(agents):
    """Only a fenced primary may still be where the -rw Service routes: a fenced replica does not stay."""
    primary = agents.primary(MEMBERS[0])
    replica = agents(
        MEMBERS[1], "--seed", "basebackup", "--upstream", primary.address, "--terminate-wait", "60"
    )
    replica.wait_streaming()
    replica.client.fence(reason="a test")
    started = time.monotonic()
    replica.signal(signal.SIGTERM)
    assert replica.wait_exit(timeout=30) == 0
    assert time.monotonic() - started < ROUTE_SETTLE


def test_a_terminating_primary_waits_only_as_long_as_it_was_told(agents):
    primary = agents.primary(MEMBERS[0], "--terminate-wait", "2")
    started = time.monotonic()
    primary.signal(signal.SIGTERM)
    assert primary.wait_exit(timeout=30) == 0
    assert 2 <= time.monotonic() - started < 20
    assert "waiting up to 2s" in primary.log
    primary.start()
    status = primary.status()
    assert (status.role, status.fenced) == ("replica", False)  # not fenced: read-only, ready to be promoted


def test_a_replica_shuts_down_at_once_on_sigterm(agents):
    primary = agents.primary(MEMBERS[0])
    replica = agents(
        MEMBERS[1], "--seed", "basebackup", "--upstream", primary.address, "--terminate-wait", "60"
    )
    replica.wait_streaming()
    started = time.monotonic()
    replica.signal(signal.SIGTERM)
    assert replica.wait_exit(timeout=30) == 0
    assert time.monotonic() - started < 10
    assert "waiting up to" not in replica.log


def test_sigterm_during_a_clone_leaves_no_program_and_no_half_copy_behind(agents):
    primary = agents.primary(MEMBERS[0])
    proxy = SlowProxy(primary.pg_port, delay=3.0)
    empty = agents(MEMBERS[1])
    outcome: list[object] = []
    seeding = threading.Thread(
        target=lambda: outcome.append(
            _attempt(lambda: empty.client.seed("basebackup", upstream=f"127.0.0.1:{proxy.port}"))
        )
    )
    seeding.start()
    try:
        empty.wait_until(lambda: empty.status().action == "seed", "the seed in progress", timeout=10)
        time.sleep(0.5)
        empty.signal(signal.SIGTERM)
        assert empty.wait_exit(timeout=40) == 0
        seeding.join(30)
    finally:
        proxy.close()
    assert outcome and isinstance(outcome[0], AgentError)  # the caller learns it did not happen
    assert not empty.pgdata.exists() or not any(empty.pgdata.iterdir())  # nothing half copied
    assert "of the action in progress (seed)" in empty.log
    programs = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"port={proxy.port}" not in programs  # its pg_basebackup did not outlive it
    empty.start()  # the next agent finds an empty directory and waits for an order, as before
    assert empty.status().data_present is False


def _attempt(call: Callable[[], object]) -> object:
    try:
        return call()
    except AgentError as exc:
        return exc


def test_postgresql_starts_with_syncfs_unless_a_parameter_says_otherwise(agents):
    default = agents.primary(MEMBERS[0])
    assert default.value("SHOW recovery_init_sync_method") == "syncfs"
    told = agents.primary(MEMBERS[1], "--parameter", "recovery_init_sync_method=fsync")
    assert told.value("SHOW recovery_init_sync_method") == "fsync"


def test_a_failed_start_says_why_in_status_until_a_start_succeeds(agents):
    primary = agents.primary(MEMBERS[0])
    assert primary.status().start_error is None
    primary.stop()
    primary.start("--parameter", "shared_buffers=lots")  # startupz answers once the first start failed
    status = primary.status()
    assert status.postmaster in ("stopped", "crashed") and not status.fenced and status.data_present
    assert status.start_error is not None and status.start_error.startswith("FATAL:")
    assert "contains errors" in status.start_error and 'shared_buffers": "lots"' in status.start_error
    assert primary.client.probe("healthz") == 500  # it should run and does not: the kubelet restarts it
    primary.stop()
    primary.start()
    status = primary.status()
    assert status.start_error is None and status.postmaster == "running"


def test_a_second_agent_on_the_same_volume_waits_until_the_first_has_exited(agents):
    # A member's pod made again while the old one's processes are still being stopped (force-deleted,
    # or its node cut off) may start on the same node and volume. PostgreSQL's postmaster.pid does not
    # see a postmaster in another pod's namespaces: the agents must keep out of each other's way.
    first = agents.primary(MEMBERS[0])
    first.sql("CREATE TABLE kept (x int)")
    first.sql("INSERT INTO kept VALUES (1)")
    running = postmaster.postmaster_pid(first.pgdata)
    second = Agent(MEMBERS[0], first.volume, first.certs)
    agents.made.append(second)
    second.start(wait=False)
    second.wait_until(lambda: "another agent holds" in second.log, "its wait for the volume", timeout=30)
    time.sleep(2)  # what an agent that did not wait would have done by now: stop the postmaster it found
    assert second.process is not None and second.process.poll() is None
    assert postmaster.postmaster_pid(first.pgdata) == running
    assert first.status().role == "primary" and first.value("SELECT count(*) FROM kept") == 1
    with pytest.raises(AgentError):
        second.client.probe("startupz")  # it serves nothing until it holds the volume
    first.stop()
    assert first.wait_exit() == 0
    second.wait_until(lambda: second.client.probe("startupz") == 200, "its first start", timeout=90)
    second.wait_until(lambda: second.status().postmaster == "running", "PostgreSQL", timeout=30)
    assert second.value("SELECT x FROM kept") == 1
