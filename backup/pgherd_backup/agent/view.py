"""The agent's own view of its PostgreSQL: what the kubelet's probes answer from.

One sample at a time, taken at most once a second whoever asks and however many ask at once (callers
share the query in flight), on one kept connection over the Unix socket as pgherd_monitor (pg_monitor's
rights, no password). /status does not use it: the operator's failure detection reads PostgreSQL live.
`Shared` is that discipline alone: the metrics (metrics.py) take their readings through it too.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import psycopg

from pgherd_backup.agent import status
from pgherd_backup.agent.instance import Instance
from pgherd_backup.agent.monitorlogin import MonitorLogin
from pgherd_backup.agent.seeding import MONITOR_ROLE, ensure_monitor_role, ensure_rewind_grants
from pgherd_backup.agent.supervisor import PostmasterState

log = logging.getLogger("pgherd.agent")

FRESH = 1.0  # a sample younger than this is answered as it is


@dataclass(frozen=True)
class Sample:
    """The member as seen at `taken_at` (time.monotonic())."""

    taken_at: float
    postmaster: PostmasterState
    live: status.Live | None  # None: PostgreSQL does not run, or did not answer (`error` says why)
    error: str | None
    ready: bool
    ready_detail: str
    serving: bool  # what /readyz answers (status.serving)
    serving_detail: str
    healthy: bool
    health_detail: str
    key: tuple[object, ...]  # what the member's state was keyed on (see Shared.key)

    @property
    def age(self) -> float:
        return time.monotonic() - self.taken_at


class Timed(Protocol):
    @property
    def taken_at(self) -> float: ...  # time.monotonic()

    @property
    def key(self) -> tuple[object, ...]: ...  # what the member's state was keyed on (Shared.key)


T = TypeVar("T", bound=Timed)


class Shared(Generic[T]):
    """The latest sample of the member, taken on demand by one thread at a time (`_take`) and shared:
    a caller gets the latest while it is fresh, else joins the refresh in flight (never a second one)."""

    thread_name = "agent-view"
    what = "view of PostgreSQL"  # for the log

    def __init__(self, inst: Instance, fresh: float = FRESH) -> None:
        self.inst = inst
        self.fresh = fresh
        self._lock = threading.Lock()
        self._latest: T | None = None
        self._pending: Future[T] | None = None

    @property
    def latest(self) -> T | None:
        return self._latest

    def key(self) -> tuple[object, ...]:
        """Read without a lock: a sample taken under another key (PostgreSQL started or stopped since, a
        fence) is stale whatever its age."""
        state = self.inst.state
        return (self.inst.postmaster.since, state.fenced, state.demoted)

    def current(self) -> T | None:
        """The latest sample when it is fresh and still describes the member."""
        sample = self._latest
        if sample is None or time.monotonic() - sample.taken_at >= self.fresh or sample.key != self.key():
            return None
        return sample

    def get(self) -> T:
        """A fresh sample, for a thread: the latest, or the one being taken (joined, never doubled)."""
        return self.current() or self.refresh().result()

    async def aget(self, wait: float) -> T | None:
        """A fresh sample, for the event loop: waits up to `wait` for the refresh in flight, then gives
        the latest, however old (None before the first)."""
        sample = self.current()
        if sample is not None:
            return sample
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.refresh())), wait)
        except Exception:  # not in time (PostgreSQL slow to answer), or failed (logged)
            return self._latest

    def refresh(self) -> Future[T]:
        """The refresh in flight, or a new one in a thread of its own."""
        with self._lock:
            if self._pending is None:
                self._pending = Future()
                threading.Thread(
                    target=self._refresh, args=(self._pending,), name=self.thread_name, daemon=True
                ).start()
            return self._pending

    def _refresh(self, pending: Future[T]) -> None:
        try:
            sample = self._take(self.key())
        except Exception as exc:  # a bug: logged; the callers judge the latest sample by its age
            log.exception("the agent's %s failed", self.what)
            with self._lock:
                self._pending = None
            pending.set_exception(exc)
            return
        with self._lock:
            self._latest = sample
            self._pending = None
        pending.set_result(sample)

    def _take(self, key: tuple[object, ...]) -> T:
        raise NotImplementedError


class View(Shared[Sample]):
    """The probes' Sample: PostgreSQL read as pgherd_monitor (as the superuser while it cannot log in)."""

    def __init__(self, inst: Instance, fresh: float = FRESH) -> None:
        super().__init__(inst, fresh)
        self._conn: psycopg.Connection[Any] | None = None  # used by the refreshing thread only
        self._login = MonitorLogin(inst, "the probes", statement_timeout=1.5)

    def _take(self, key: tuple[object, ...]) -> Sample:
        if not self.inst.postmaster.alive:
            self._close()
            return self._sample(None, None, key)
        try:
            live = status.read_live(self._connection())
        except psycopg.Error:
            self._close()  # a restarted PostgreSQL broke the kept connection: one more try on a new one
            try:
                live = status.read_live(self._connection())
            except psycopg.Error as exc:
                self._close()
                return self._sample(None, self.inst.credentials.redact(_first_line(exc)), key)
        return self._sample(live, None, key)

    def _sample(self, live: status.Live | None, error: str | None, key: tuple[object, ...]) -> Sample:
        inst = self.inst
        ready, ready_detail = status.readiness(inst, live)
        serving, serving_detail = status.serving(inst, live, (ready, ready_detail))
        healthy, health_detail = inst.healthy()
        return Sample(
            taken_at=time.monotonic(),
            postmaster=inst.postmaster.state,
            live=live,
            error=error,
            ready=ready,
            ready_detail=ready_detail,
            serving=serving,
            serving_detail=serving_detail,
            healthy=healthy,
            health_detail=health_detail,
            key=key,
        )

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is not None and self._login.retry_due():
            self._close()  # time to try pgherd_monitor again
        if self._conn is None or self._conn.closed:
            self._conn = self._open()
        return self._conn

    def _open(self) -> psycopg.Connection[Any]:
        login = self._login
        try:
            return login.as_monitor()
        except psycopg.OperationalError as exc:
            refused = _first_line(exc, last=True)
        conn = login.connect(None)  # PostgreSQL does not answer: raised
        try:
            ensure_monitor_role(conn)
            if self.inst.options.replication_role != self.inst.options.superuser:
                ensure_rewind_grants(conn, self.inst.options.replication_role)
        except psycopg.Error as exc:
            log.warning("could not create the role %s: %s", MONITOR_ROLE, _first_line(exc))
        try:
            monitor = login.as_monitor()  # created just now, or refused for a moment (a start)
        except psycopg.OperationalError as exc:
            refused = _first_line(exc, last=True)
        else:
            conn.close()
            return monitor
        login.fell_back(refused)
        return conn

    def _close(self) -> None:
        """Close the kept connection (PostgreSQL stopped); the next refresh opens another."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def _first_line(exc: Exception, *, last: bool = False) -> str:
    """A psycopg error in one line (a refused connection says why on its last line)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return lines[-1] if last else lines[0]
