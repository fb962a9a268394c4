"""A prober that asks every member, every 100 ms, whether it is in recovery and whether it accepts a
write, through a connection of its own to each member (one thread per member: a member that hangs holds
up only its own record). The record answers the partition scenarios' questions: did two members ever
accept writes at the same moment, when did the old primary stop accepting them, when did the new one
start.

A write is accepted when its COMMIT returned without error and without PostgreSQL's warning that the
wait for synchronous replication was cancelled (statement_timeout cancels that wait after a second: the
row is then on that member alone, which no client was told is durable)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import psycopg

from e2e.workload import connect

PROBE_TABLE = "e2e_probe"
INTERVAL = 0.1
STATEMENT_TIMEOUT_MS = 1000
_SYNC_REP_CANCELLED = "canceling wait for synchronous replication"


@dataclass(frozen=True)
class Probe:
    member: str
    started: float  # time.monotonic()
    ended: float
    in_recovery: bool | None  # None: no answer
    accepted: bool  # a write committed and acknowledged


@dataclass
class Prober:
    """`members`: name -> a function giving its DSN now (a pod made again has a new address)."""

    members: dict[str, Callable[[], str]]
    probes: list[Probe] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    # Ids no earlier prober of the table used: from the microseconds of now (a prober writes ~30 a second).
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(time.time_ns() // 1000))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> Prober:
        for member in self.members:
            thread = threading.Thread(target=self._run, args=(member,), name=f"probe-{member}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def _run(self, member: str) -> None:
        conn: psycopg.Connection[tuple[object, ...]] | None = None
        warnings: list[str] = []
        while not self._stop.is_set():
            started = time.monotonic()
            in_recovery: bool | None = None
            accepted = False
            try:
                if conn is None or conn.closed:
                    conn = connect(
                        self.members[member](), options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS}"
                    )
                    conn.add_notice_handler(lambda d: warnings.append(str(d.message_primary)))
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
                in_recovery = bool(row[0]) if row else None
                if in_recovery is False:
                    warnings.clear()
                    conn.execute(
                        f"INSERT INTO {PROBE_TABLE} (id, member) VALUES (%s, %s)", (self._next_id(), member)
                    )
                    accepted = not any(_SYNC_REP_CANCELLED in w for w in warnings)
            except (psycopg.Error, OSError):
                if conn is not None:
                    conn.close()
                conn = None
            self.probes.append(Probe(member, started, time.monotonic(), in_recovery, accepted))
            self._stop.wait(max(0.0, INTERVAL - (time.monotonic() - started)))
        if conn is not None:
            conn.close()

    # -- verdicts ---------------------------------------------------------------------------------------

    def writers(self) -> list[tuple[float, float, str]]:
        """(start, end, member) of every accepted write."""
        return sorted((p.started, p.ended, p.member) for p in self.probes if p.accepted)

    def two_writers(self, slack: float = 0.0) -> list[tuple[str, str, float]]:
        """Moments two members accepted writes at once: (member, other, when); `slack` widens each write
        to a window (an async-mode bound)."""
        found = []
        writes = self.writers()
        for i, (_start, end, member) in enumerate(writes):
            for other_start, _other_end, other in writes[i + 1 :]:
                if other_start > end + slack:
                    break
                if other != member:
                    found.append((member, other, other_start))
        return found

    def last_write(self, member: str) -> float | None:
        times = [p.ended for p in self.probes if p.member == member and p.accepted]
        return max(times) if times else None

    def first_write(self, member: str, after: float) -> float | None:
        times = [p.ended for p in self.probes if p.member == member and p.accepted and p.started >= after]
        return min(times) if times else None


def ensure_probe_table(dsn: str) -> None:
    with connect(dsn) as conn:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {PROBE_TABLE} (id bigint PRIMARY KEY, member text NOT NULL)"
        )
