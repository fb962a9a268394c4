"""When a replica's upstream last said anything, as its agent vouches for it (`Instance.upstream_heard`).

The operator dates a lost primary from the replicas' figure (/status upstream_silent_seconds): it must
never be earlier than the truth, else a failover could start before the primary was silent for
detectionSeconds. While the WAL receiver has a row, PostgreSQL measures the silence itself
(last_msg_receipt_time). Once the row has gone (the connection closed: the primary died), nothing says
when; the agent therefore watches the receiver on its own, every SAMPLE seconds whoever asks and at once
when the receiver's process ends (`ProcessExit`), and dates the loss at the first sample that saw the
row gone: never before the truth, at most a sample after it (a few ms when the process's end woke it).
Ageing the last /status instead dated it up to an operator's poll (2 s) too early.

One thread, one kept connection over the Unix socket as pgherd_monitor (as the superuser while that
role cannot log in, like the probes' view.py); it samples only a running replica that is not fenced.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from pgherd_backup.agent.instance import Instance, describe_upstream
from pgherd_backup.agent.monitorlogin import MonitorLogin
from pgherd_backup.agent.supervisor import PostmasterState

log = logging.getLogger("pgherd.agent")

SAMPLE = 0.1  # seconds between samples: how late a lost upstream may be dated
OPEN_RETRY = 1.0  # after a refused connection: each refusal is a line in PostgreSQL's log
APPLICATION = "pgherd-agent-upstream-watch"  # its backend in pg_stat_activity

# One row whatever the receiver's state; the silence is null without a receiver (or before its first
# message), and only pg_read_all_stats (pg_monitor) may read it; the receiver's pid too.
_QUERY = """
SELECT pg_is_in_recovery(),
       (SELECT extract(epoch FROM clock_timestamp() - last_msg_receipt_time)::float8
          FROM pg_stat_wal_receiver),
       (SELECT pid FROM pg_stat_wal_receiver)
"""


class ProcessExit:
    """The end of one process (Linux's pidfd): a WAL receiver ends when its connection does, and the
    watch then samples at once rather than up to a sample later (a failover's detection counts from
    the later of two replicas' dates: 0.07 s on average at 0.1 s samples). Where pidfds are missing
    (an old kernel, a seccomp profile), nothing is watched and the samples' pace alone stands."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except (OSError, AttributeError):
            self._fd = None  # gone already, or no pidfds: the next sample says which

    def wait(self, timeout: float) -> bool:
        """Whether the process ended within `timeout` seconds (False when it cannot be watched)."""
        if self._fd is not None:
            poller = select.poll()  # not select(): no limit on the descriptor's number
            try:
                poller.register(self._fd, select.POLLIN)
                return bool(poller.poll(timeout * 1000))
            except (OSError, ValueError):
                self.close()  # the samples' pace then
        time.sleep(timeout)
        return False

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


@dataclass(frozen=True)
class Heard:
    """When `upstream` (as describe_upstream shows it, the configured one) last said anything."""

    upstream: str
    at: float  # time.monotonic(); never earlier than its real last word
    receiving: bool  # the last sample saw its receiver's row: gone since is not dated yet


def next_heard(prev: Heard | None, upstream: str | None, silence: float | None, at: float) -> Heard | None:
    """What a sample at `at` (taken once the query returned) says: its receiver's own silence while it
    has a row; else the first sample without one dates the loss (the row went between the two samples,
    so never before the truth); later ones leave that date to age. Another upstream: nothing heard."""
    if upstream is None:
        return None
    if silence is not None:
        return Heard(upstream, at - max(0.0, silence), receiving=True)
    if prev is None or prev.upstream != upstream:
        return None
    if prev.receiving:
        return Heard(upstream, max(prev.at, at), receiving=False)
    return prev


def silence_now(heard: Heard | None, upstream: str | None, now: float) -> float | None:
    """Seconds since `upstream` last said anything, for /status when its own reading has no receiver
    row: 0 while the watch has not seen the row go yet (at the latest now, the safe side)."""
    if heard is None or heard.upstream != upstream:
        return None
    if heard.receiving:
        return 0.0
    return round(max(0.0, now - heard.at), 3)


class UpstreamWatch:
    """The sampling thread: start() once, stop() at the agent's exit."""

    def __init__(self, inst: Instance, every: float = SAMPLE) -> None:
        self.inst = inst
        self.every = every
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self._conn_of: datetime | None = None  # the postmaster (its `since`) the connection is to
        self._primary: datetime | None = None  # a primary (not in recovery) since this postmaster start
        self._open_after = 0.0
        self._login = MonitorLogin(
            inst, "the WAL receiver's watch", statement_timeout=1, application=APPLICATION
        )
        self._failing = False  # an unexpected error was logged: not again until a sample succeeds
        self._receiver: ProcessExit | None = None  # the WAL receiver seen by the last sample

    def start(self) -> UpstreamWatch:
        self._thread = threading.Thread(target=self._run, name="upstream-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 3.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._pause():
                try:
                    self.step()
                except Exception:  # a bug: logged once, the watch goes on (/status answers 0 meanwhile)
                    self._close()
                    if not self._failing:
                        log.exception("the watch on the WAL receiver failed")
                    self._failing = True
        finally:
            self._close()
            self._watch_receiver(None)

    def _pause(self) -> bool:
        """Until the next sample: `every` seconds, or less when the receiver seen last ends. Whether to
        stop."""
        receiver = self._receiver
        if receiver is None:
            return self._stop.wait(self.every)
        if receiver.wait(self.every):
            self._watch_receiver(None)  # ended: a pidfd stays readable, the next sample finds another
        return self._stop.is_set()

    def _watch_receiver(self, pid: int | None) -> None:
        if self._receiver is not None and self._receiver.pid == pid:
            return
        if self._receiver is not None:
            self._receiver.close()
        self._receiver = ProcessExit(pid) if pid is not None else None

    def step(self) -> None:
        """One sample when there is a replica to watch; else the connection closed (a cheap check)."""
        inst = self.inst
        since = inst.postmaster.since
        # Not before it accepts connections: each refusal while it starts would be a line in its log.
        running = inst.postmaster.state is PostmasterState.RUNNING
        if inst.shutting_down or inst.state.fenced or not running or since == self._primary:
            self._close()  # fenced, stopped, or a primary until PostgreSQL starts again (demote, rejoin)
            return
        conn = self._connection(since)
        if conn is None:
            return
        try:
            row = conn.execute(_QUERY).fetchone()
        except psycopg.Error:
            self._close()  # PostgreSQL restarted or stopping: a new connection at the next sample
            return
        at = time.monotonic()
        assert row is not None
        in_recovery, silence, receiver_pid = row
        self._failing = False
        self._watch_receiver(receiver_pid if in_recovery else None)
        if not in_recovery:
            inst.upstream_heard = None
            self._primary = since
            self._close()
            return
        upstream = describe_upstream(inst.settings_snapshot()["upstream"])
        inst.upstream_heard = next_heard(inst.upstream_heard, upstream, silence, at)

    def _connection(self, since: datetime) -> psycopg.Connection[Any] | None:
        now = time.monotonic()
        if self._conn is not None and (self._conn_of != since or self._login.retry_due()):
            self._close()
        if self._conn is None and now >= self._open_after:
            try:
                self._conn = self._open()
                self._conn_of = since
            except psycopg.Error:
                self._open_after = now + OPEN_RETRY  # not accepting connections yet
        return self._conn

    def _open(self) -> psycopg.Connection[Any]:
        try:
            return self._login.as_monitor()
        except psycopg.OperationalError as exc:
            # A replica before its primary's agent created the role: its rights are the superuser's too.
            return self._login.as_superuser(exc)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
