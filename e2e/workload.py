"""A write load that keeps score: what was acknowledged, what failed, and when.

One thread inserts rows with strictly increasing ids through a read-write DSN, one transaction per
row, reconnecting after every failure with short timeouts. Every attempt is recorded with its
monotonic start and end times, so that a scenario can assert "no acknowledged commit lost" (every
acknowledged id is present after a failover) and measure how long writes were unavailable. The
benchmark (`bench/failover_bench.py`) runs the very same loop against pgherd and Patroni.

An id counts as acknowledged only when COMMIT returned without error *and* without PostgreSQL's
warning that the wait for synchronous replication was cancelled: such a commit is durable on the
primary alone, which quorum mode does not promise to keep.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import psycopg
from psycopg import sql

DEFAULT_TABLE = "e2e_writes"

# Short timeouts so that a dead or fenced primary costs one connect attempt, not a TCP timeout. Keepalives
# and tcp_user_timeout catch a peer that vanished without a reset (a real network, not 127.0.0.1).
CONNECT_OPTIONS: dict[str, str | int] = {
    "connect_timeout": 2,
    "keepalives": 1,
    "keepalives_idle": 2,
    "keepalives_interval": 1,
    "keepalives_count": 2,
    "tcp_user_timeout": 4000,
}

_SYNC_REP_CANCELLED = "canceling wait for synchronous replication"


def connect(
    dsn: str, *, autocommit: bool = True, **options: str | int
) -> psycopg.Connection[tuple[object, ...]]:
    """A connection with the short timeouts above (the DSN's own settings win)."""
    params: dict[str, str | int] = {**CONNECT_OPTIONS, **options}
    explicit = psycopg.conninfo.conninfo_to_dict(dsn)
    for key in explicit:
        params.pop(key, None)
    return psycopg.connect(dsn, autocommit=autocommit, **params)  # type: ignore[arg-type]


def ensure_table(dsn: str, table: str = DEFAULT_TABLE, *, timeout: float = 30.0) -> None:
    """Create the write table (id, time of the write) if missing, retrying while the cluster settles."""
    statement = sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} (id bigint PRIMARY KEY, written_at timestamptz NOT NULL DEFAULT clock_timestamp())"
    ).format(sql.Identifier(table))
    deadline = time.monotonic() + timeout
    while True:
        try:
            with connect(dsn) as conn:
                conn.execute(statement)
            return
        except psycopg.Error as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not create table {table} through {redact(dsn)}: {exc}") from exc
            time.sleep(0.5)


def present_ids(dsn: str, table: str = DEFAULT_TABLE) -> set[int]:
    with connect(dsn) as conn:
        rows = conn.execute(sql.SQL("SELECT id FROM {}").format(sql.Identifier(table))).fetchall()
    return {int(row[0]) for row in rows}  # type: ignore[call-overload]


def redact(dsn: str) -> str:
    """The DSN without its password, for messages and logs."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparsable DSN>"
    if "password" in params:
        params["password"] = "***"
    return psycopg.conninfo.make_conninfo(**params)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Attempt:
    """One write: its id, when it started and ended (time.monotonic()), and the error if it failed."""

    id: int
    started: float
    ended: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Window:
    """A run of consecutive failed attempts: writes were unavailable from `start` to `end`."""

    start: float
    end: float
    failures: int
    first_error: str
    errors: tuple[str, ...] = ()  # the distinct errors of the window, in order (a few)

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class WriteReport:
    """Every attempt of a write load, in order, and the questions scenarios ask of it."""

    table: str
    attempts: list[Attempt] = field(default_factory=list)
    wall_offset: float = 0.0  # time.time() - time.monotonic() when the load started

    @property
    def acked(self) -> list[Attempt]:
        return [a for a in self.attempts if a.ok]

    @property
    def failed(self) -> list[Attempt]:
        return [a for a in self.attempts if not a.ok]

    def acked_ids(self) -> list[int]:
        return [a.id for a in self.attempts if a.ok]

    def lost(self, present: Iterable[int]) -> list[int]:
        """Acknowledged ids that are not in `present` (the ids read back from the cluster)."""
        have = set(present)
        return [i for i in self.acked_ids() if i not in have]

    def first_ack_after(self, moment: float, *, begun: bool = False) -> Attempt | None:
        """The first acknowledged write that ended after `moment` (time.monotonic()); with `begun`, that
        also began after it: a commit in flight at a kill may still deliver its acknowledgement from the
        socket buffer, and must not count as a write on the new primary."""
        return next((a for a in self.attempts if a.ok and (a.started if begun else a.ended) >= moment), None)

    def last_ack_before(self, moment: float) -> Attempt | None:
        return next((a for a in reversed(self.attempts) if a.ok and a.ended <= moment), None)

    def failure_windows(self) -> list[Window]:
        """Runs of failed attempts, each from the end of the last success before it to the end of the
        first success after it (or of the last failure, when the load stopped while failing)."""
        windows: list[Window] = []
        run: list[Attempt] = []
        last_ok_end: float | None = None
        for attempt in self.attempts:
            if not attempt.ok:
                run.append(attempt)
                continue
            if run:
                start = last_ok_end if last_ok_end is not None else run[0].started
                windows.append(Window(start, attempt.ended, len(run), run[0].error or "", _distinct(run)))
                run = []
            last_ok_end = attempt.ended
        if run:
            start = last_ok_end if last_ok_end is not None else run[0].started
            windows.append(Window(start, run[-1].ended, len(run), run[0].error or "", _distinct(run)))
        return windows

    def describe_windows(self) -> str:
        """Each failure window at the wall clock's time of day (UTC, as the members' and the operator's
        logs print it) with its distinct errors: what a failure message needs to be read beside them."""

        def clock(moment: float) -> str:
            return datetime.fromtimestamp(moment + self.wall_offset, UTC).strftime("%H:%M:%S.%f")[:-3]

        return "\n".join(
            f"  {clock(w.start)} to {clock(w.end)} UTC ({w.seconds:.2f} s, {w.failures} failed): "
            + " | ".join(w.errors)
            for w in self.failure_windows()
        )

    def max_gap(self, since: float | None = None, until: float | None = None) -> float:
        """The longest time between two consecutive acknowledgements within [since, until]: the write
        unavailability a client saw, whether its attempts failed or hung."""
        ends = [a.ended for a in self.acked]
        if since is not None:
            before = [e for e in ends if e <= since]
            ends = ([before[-1]] if before else []) + [e for e in ends if e > since]
        if until is not None:
            after = [e for e in ends if e >= until]
            ends = [e for e in ends if e < until] + ([after[0]] if after else [])
        return max((b - a for a, b in itertools.pairwise(ends)), default=0.0)

    def summary(self) -> str:
        windows = self.failure_windows()
        worst = max((w.seconds for w in windows), default=0.0)
        return (
            f"{len(self.acked)} acknowledged, {len(self.failed)} failed writes in {len(windows)} window(s)"
            f" (longest {worst:.2f} s); max gap between acknowledgements {self.max_gap():.2f} s"
        )


def _distinct(attempts: list[Attempt], most: int = 4) -> tuple[str, ...]:
    seen: list[str] = []
    for attempt in attempts:
        text = (attempt.error or "").strip().split("\n", 1)[0][:200]
        if text not in seen:
            seen.append(text)
            if len(seen) == most:
                break
    return tuple(seen)


class WriteLoad:
    """Insert rows with increasing ids through `dsn` in a background thread until stopped.

    `dsn` may be a callable, read at every reconnect, for drivers whose read-write address moves.
    `pause` is the sleep between two writes (0: as fast as one connection goes).
    """

    def __init__(
        self,
        dsn: str | Callable[[], str],
        *,
        table: str = DEFAULT_TABLE,
        first_id: int | None = None,
        pause: float = 0.005,
        retry_pause: float = 0.05,
    ) -> None:
        self._dsn = dsn if callable(dsn) else (lambda: dsn)
        self.table = table
        self._first_id = first_id
        self._pause = pause
        self._retry_pause = retry_pause
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.report = WriteReport(table=table)

    # -- control ----------------------------------------------------------------------------------------

    def start(self) -> WriteLoad:
        dsn = self._dsn()
        ensure_table(dsn, self.table)
        next_id = self._first_id
        if next_id is None:
            with connect(dsn) as conn:
                row = conn.execute(
                    sql.SQL("SELECT coalesce(max(id), 0) + 1 FROM {}").format(sql.Identifier(self.table))
                ).fetchone()
            next_id = int(row[0]) if row else 1  # type: ignore[call-overload]
        self.report.wall_offset = time.time() - time.monotonic()
        self._thread = threading.Thread(
            target=self._run, args=(next_id,), name=f"write-load-{self.table}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> WriteReport:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                raise RuntimeError(f"write load on {self.table} did not stop within 30 s (a commit hangs)")
        return self.report

    def __enter__(self) -> WriteLoad:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- observation while running ----------------------------------------------------------------------

    def acked_count(self) -> int:
        with self._lock:
            return sum(1 for a in self.report.attempts if a.ok)

    def wait_for_acks(self, count: int, timeout: float = 30.0) -> None:
        """Block until `count` more writes were acknowledged: the load is flowing."""
        target = self.acked_count() + count
        deadline = time.monotonic() + timeout
        while self.acked_count() < target:
            if time.monotonic() > deadline:
                with self._lock:
                    last = self.report.failed[-1].error if self.report.failed else "none"
                raise AssertionError(
                    f"writes on {self.table} did not flow: {self.acked_count()} of {target} acknowledged"
                    f" within {timeout:.0f} s; last error: {last}"
                )
            time.sleep(0.05)

    def snapshot(self) -> WriteReport:
        with self._lock:
            return WriteReport(self.table, list(self.report.attempts), self.report.wall_offset)

    # -- the loop -----------------------------------------------------------------------------------------

    def _record(self, attempt: Attempt) -> None:
        with self._lock:
            self.report.attempts.append(attempt)

    def _run(self, next_id: int) -> None:
        insert = sql.SQL("INSERT INTO {} (id) VALUES (%s)").format(sql.Identifier(self.table))
        conn: psycopg.Connection[tuple[object, ...]] | None = None
        notices: list[str] = []
        while not self._stop.is_set():
            started = time.monotonic()
            write_id = next_id
            next_id += 1
            try:
                if conn is None or conn.closed:
                    conn = connect(self._dsn(), autocommit=False)
                    conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
                notices.clear()
                conn.execute(insert, (write_id,))
                conn.commit()
                cancelled = [n for n in notices if _SYNC_REP_CANCELLED in n]
                error = f"commit not confirmed by the quorum: {cancelled[0]}" if cancelled else None
                self._record(Attempt(write_id, started, time.monotonic(), error))
            except psycopg.Error as exc:
                self._record(
                    Attempt(write_id, started, time.monotonic(), f"{type(exc).__name__}: {exc}".strip())
                )
                if conn is not None:
                    conn.close()
                conn = None
                self._stop.wait(self._retry_pause)
                continue
            if self._pause:
                self._stop.wait(self._pause)
        if conn is not None:
            conn.close()
