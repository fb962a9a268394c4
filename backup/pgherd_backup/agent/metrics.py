"""The member's Prometheus metrics: `GET /metrics` on a plain-HTTP port of its own (--metrics-port,
9187 by default; docs/monitoring.md lists every metric).

A scrape never queries PostgreSQL itself: it answers from the latest reading, taken at most once a second
whoever asks and however many ask at once (view.Shared: concurrent scrapes share the reading in flight),
and only when someone scrapes. A reading is a few queries on one connection the agent keeps over the Unix
socket as pgherd_monitor (pg_monitor's rights), never as the superuser: when pgherd_monitor cannot log
in, the reading says so (`pgherd_postgres_up 0`, `pgherd_agent_metrics_error{reason="connect"}`).
The users' own queries (custom_queries.py) run in the same reading.

The server is one event loop in a thread: reading a request has a deadline and the connections are
bounded, so a slow or hostile client holds no thread; the exposition (prometheus_client's encoder over a
Collector) is written in a small pool of threads, which wait for the reading when it is being taken.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from pgherd_backup.agent import custom_queries, status
from pgherd_backup.agent.instance import Instance
from pgherd_backup.agent.seeding import MONITOR_ROLE
from pgherd_backup.agent.server import connection_limit, listening_socket
from pgherd_backup.agent.view import Shared

log = logging.getLogger("pgherd.agent")

FRESH = 1.0  # a reading younger than this is served as it is
APPLICATION_NAME = "pgherd-metrics"  # its sessions in pg_stat_activity
STATEMENT_TIMEOUT = 1.5  # seconds, the built-in queries'
# The users' queries stop there (seconds into a reading): a reading stays within a scrape's timeout (10 s).
CUSTOM_BUDGET = 6.0
REQUEST_TIMEOUT = 5.0  # reading a request's head
WRITE_TIMEOUT = 10.0
MAX_HEAD = 8 << 10
RENDER_THREADS = 4
# Why a reading has no figures from PostgreSQL (pgherd_agent_metrics_error{reason}).
REASONS = ("not_running", "connect", "query")
# pg_stat_activity.state of client backends, always reported (0 when none); others appear when seen.
CONNECTION_STATES = ("active", "idle", "idle in transaction", "idle in transaction (aborted)")

# One round trip: everything but the checkpoints (their view depends on the major). Every function and
# view here is pg_monitor's to read (pg_ls_archive_statusdir, pg_database_size: pg_read_all_stats).
_FIGURES = """
WITH receiver AS (SELECT latest_end_lsn FROM pg_stat_wal_receiver),
     recovery AS (SELECT pg_is_in_recovery() AS standby,
                         pg_last_wal_replay_lsn() AS replayed,
                         greatest((SELECT latest_end_lsn FROM receiver), pg_last_wal_receive_lsn()) AS upstream)
SELECT
  (SELECT extract(epoch FROM last_archived_time)::float8 FROM pg_stat_archiver),
  (SELECT failed_count FROM pg_stat_archiver),
  (SELECT count(*) FROM pg_ls_archive_statusdir() WHERE name LIKE '%.ready'),
  current_setting('max_connections')::int,
  (SELECT max(age(datfrozenxid)) FROM pg_database),
  extract(epoch FROM pg_postmaster_start_time())::float8,
  (SELECT CASE WHEN standby THEN greatest(0, coalesce(pg_wal_lsn_diff(upstream, replayed), 0))::float8
               ELSE 0 END FROM recovery),
  (SELECT CASE WHEN NOT standby OR upstream IS NULL OR upstream <= replayed THEN 0
               ELSE greatest(0, coalesce(extract(epoch FROM now() - pg_last_xact_replay_timestamp()), 0))::float8
          END FROM recovery),
  CASE WHEN pg_is_in_recovery() THEN NULL ELSE
    (SELECT json_object_agg(coalesce(nullif(application_name, ''), client_addr::text, pid::text),
                            pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn))
       FROM pg_stat_replication WHERE replay_lsn IS NOT NULL) END,
  (SELECT json_object_agg(state, n) FROM
     (SELECT coalesce(state, 'unknown') AS state, count(*) AS n FROM pg_stat_activity
       WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() GROUP BY 1) AS s),
  (SELECT json_object_agg(datname, pg_database_size(oid)) FROM pg_database WHERE datallowconn)
"""
_CHECKPOINTS_16 = "SELECT checkpoints_timed, checkpoints_req FROM pg_stat_bgwriter"
_CHECKPOINTS_17 = "SELECT num_timed, num_requested FROM pg_stat_checkpointer"


@dataclass(frozen=True)
class Figures:
    """What the built-in queries read."""

    archived_at: float | None
    archive_failures: int
    archive_pending: int
    max_connections: int
    oldest_xid_age: int
    started_at: float
    lag_bytes: float
    lag_seconds: float
    standby_lag: Mapping[str, float]
    connections: Mapping[str, int]
    database_sizes: Mapping[str, int]
    checkpoints_timed: int
    checkpoints_requested: int


@dataclass(frozen=True)
class Volume:
    size: int
    used: int
    available: int  # to an unprivileged writer (PostgreSQL)


@dataclass(frozen=True)
class Reading:
    """The member as read at `taken_at` (time.monotonic())."""

    taken_at: float
    key: tuple[object, ...]
    duration: float  # seconds the reading took
    runs: int  # readings that queried PostgreSQL, since the agent started
    error: str | None  # one of REASONS, or None
    live: status.Live | None
    figures: Figures | None
    volume: Volume | None
    fenced: bool
    crashes: int
    pending_restart: bool
    custom: tuple[custom_queries.Result, ...] = ()
    custom_errors: Mapping[str, int] = field(default_factory=dict)
    custom_loaded: int = 0
    custom_refused: int = 0


class Readings(Shared[Reading]):
    """The latest Reading, taken by one thread at a time on a kept pgherd_monitor connection."""

    thread_name = "agent-metrics"
    what = "metrics reading"

    def __init__(self, inst: Instance, fresh: float = FRESH) -> None:
        super().__init__(inst, fresh)
        self._conn: psycopg.Connection[Any] | None = None  # the refreshing thread's only
        self._runs = 0
        self._custom = (
            custom_queries.CustomQueries(inst.options.custom_queries) if inst.options.custom_queries else None
        )
        self._custom_errors: Counter[str] = Counter()
        self._logged: str | None = None  # the last problem logged, logged again only when it changes

    def _take(self, key: tuple[object, ...]) -> Reading:
        started = time.monotonic()
        inst = self.inst
        state = inst.settings_snapshot()
        common: dict[str, Any] = {
            "key": key,
            "volume": _volume(inst),
            "fenced": bool(state["fenced"]),
            "crashes": int(state["crashes"]),
        }
        live = figures = None
        results: tuple[custom_queries.Result, ...] = ()
        error: str | None = None
        if not inst.postmaster.alive:
            self._close()
            error = "not_running"
        else:
            for attempt in (1, 2):  # a restarted PostgreSQL broke the kept connection: once more on a new one
                try:
                    conn = self._connection()
                except psycopg.Error as exc:
                    error = "connect"
                    self._note(f"cannot log in as {MONITOR_ROLE}: {_last_line(exc)}")
                    break
                try:
                    self._runs += 1
                    live = status.read_live(conn)
                    figures = _figures(conn)
                except psycopg.Error as exc:
                    if conn.broken or conn.closed:
                        self._close()
                        if attempt == 1 and live is None:
                            continue
                    error = "query"
                    self._note(f"a built-in query failed: {_last_line(exc)}")
                    break
                results = self._run_custom(conn, started + CUSTOM_BUDGET)
                error = None
                self._note(None)
                break
        return Reading(
            taken_at=time.monotonic(),
            duration=time.monotonic() - started,
            runs=self._runs,
            error=error,
            live=live,
            figures=figures,
            pending_restart=bool(live and live.pending_restart),
            custom=results,
            custom_errors=dict(self._custom_errors),
            custom_loaded=len(self._custom.queries) if self._custom else 0,
            custom_refused=self._custom.refused if self._custom else 0,
            **common,
        )

    def _run_custom(self, conn: psycopg.Connection[Any], until: float) -> tuple[custom_queries.Result, ...]:
        """The users' queries, in the file's order, as long as the reading's time budget lasts."""
        if self._custom is None:
            return ()
        results = []
        for query in self._custom.load():
            try:
                if time.monotonic() >= until:
                    raise custom_queries.QueryError(
                        f"not run: the queries before it took the reading's {CUSTOM_BUDGET:.0f} s"
                    )
                results.append(
                    custom_queries.run(conn, query, min(custom_queries.TIMEOUT, until - time.monotonic()))
                )
            except (psycopg.Error, custom_queries.QueryError) as exc:
                self._custom_errors[query.name] += 1
                if self._custom_errors[query.name] == 1 or self._custom_errors[query.name] % 100 == 0:
                    log.warning(
                        "custom query %s failed (%d times so far): %s",
                        query.name,
                        self._custom_errors[query.name],
                        _last_line(exc),
                    )
                if conn.broken:
                    self._close()
                    break
        return tuple(results)

    def _connection(self) -> psycopg.Connection[Any]:
        """The kept connection, as pgherd_monitor alone: no fallback to the superuser (docs/monitoring.md)."""
        if self._conn is not None and not self._conn.closed and not self._conn.broken:
            return self._conn
        self._close()
        conn = self.inst.open_local(timeout=1, statement_timeout=STATEMENT_TIMEOUT, user=MONITOR_ROLE)
        conn.execute("SELECT set_config('application_name', %s, false)", (APPLICATION_NAME,))
        self._conn = conn
        return conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _note(self, problem: str | None) -> None:
        """A problem is logged once, and its end once."""
        if problem == self._logged:
            return
        if problem is not None:
            log.warning("metrics: %s (pgherd_agent_metrics_error says so meanwhile)", problem)
        elif self._logged is not None:
            log.info("metrics: PostgreSQL answers %s again", MONITOR_ROLE)
        self._logged = problem


def _figures(conn: psycopg.Connection[Any]) -> Figures:
    row = conn.execute(_FIGURES).fetchone()
    assert row is not None
    checkpoints_query = _CHECKPOINTS_17 if conn.info.server_version >= 170000 else _CHECKPOINTS_16
    checkpoints = conn.execute(checkpoints_query).fetchone()
    assert checkpoints is not None
    (archived_at, failures, pending, max_connections, xid_age, started_at, lag_bytes, lag_seconds) = row[:8]
    standbys, connections, sizes = row[8:]
    return Figures(
        archived_at=archived_at,
        archive_failures=int(failures or 0),
        archive_pending=int(pending or 0),
        max_connections=int(max_connections),
        oldest_xid_age=int(xid_age or 0),
        started_at=float(started_at),
        lag_bytes=float(lag_bytes or 0),
        lag_seconds=float(lag_seconds or 0),
        standby_lag={str(k): float(v) for k, v in (standbys or {}).items() if v is not None},
        connections={str(k): int(v) for k, v in (connections or {}).items()},
        database_sizes={str(k): int(v) for k, v in (sizes or {}).items() if v is not None},
        checkpoints_timed=int(checkpoints[0] or 0),
        checkpoints_requested=int(checkpoints[1] or 0),
    )


def _volume(inst: Instance) -> Volume | None:
    """The data directory's file system, as the agent sees it (no query)."""
    where = inst.pgdata if inst.pgdata.exists() else inst.options.volume
    try:
        fs = os.statvfs(where)
    except OSError:
        return None
    return Volume(
        size=fs.f_blocks * fs.f_frsize,
        used=(fs.f_blocks - fs.f_bfree) * fs.f_frsize,
        available=fs.f_bavail * fs.f_frsize,
    )


def _last_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


class MemberCollector(Collector):
    """The metric families of the latest reading (taken now when it is older than a second)."""

    def __init__(self, readings: Readings) -> None:
        self.readings = readings
        options = readings.inst.options
        self.base = [options.cluster, options.member]

    def collect(self) -> Iterator[Metric]:
        return iter(families(self.readings.get(), self.base))


def families(reading: Reading, base: list[str]) -> list[Metric]:
    labels = ["cluster", "member"]
    out: list[Metric] = []

    def gauge(name: str, doc: str, value: float | None, **extra: str) -> None:
        family = GaugeMetricFamily(name, doc, labels=[*labels, *extra])
        if value is not None:
            family.add_metric([*base, *extra.values()], value)
        out.append(family)

    def counter(name: str, doc: str, value: float) -> None:
        family = CounterMetricFamily(name, doc, labels=labels)
        family.add_metric(base, value)
        out.append(family)

    def labelled(name: str, doc: str, label: str, values: Mapping[str, float]) -> None:
        family = GaugeMetricFamily(name, doc, labels=[*labels, label])
        for key, value in sorted(values.items()):
            family.add_metric([*base, key], value)
        out.append(family)

    live, figures = reading.live, reading.figures
    gauge(
        "pgherd_postgres_up",
        "1 when PostgreSQL answers pgherd_monitor's queries, else 0.",
        1.0 if live else 0.0,
    )
    errors = GaugeMetricFamily(
        "pgherd_agent_metrics_error",
        "1 for why the last reading has no figures from PostgreSQL: not_running (stopped, fenced, crashed),"
        " connect (pgherd_monitor cannot log in), query (a built-in query failed).",
        labels=[*labels, "reason"],
    )
    for reason in REASONS:
        errors.add_metric([*base, reason], 1.0 if reading.error == reason else 0.0)
    out.append(errors)
    gauge("pgherd_fenced", "1 while the operator keeps the member fenced.", float(reading.fenced))
    counter("pgherd_postgres_crashes_total", "PostgreSQL exits the agent did not ask for.", reading.crashes)
    if reading.volume is not None:
        volume = reading.volume
        gauge("pgherd_volume_size_bytes", "Size of the data directory's file system.", volume.size)
        gauge("pgherd_volume_used_bytes", "Bytes used on the data directory's file system.", volume.used)
        gauge(
            "pgherd_volume_available_bytes",
            "Bytes PostgreSQL can still write on the data directory's file system.",
            volume.available,
        )
    if live is not None:
        gauge(
            "pgherd_postgres_in_recovery",
            "1 on a replica (in recovery), 0 on a primary.",
            float(live.in_recovery),
        )
        gauge("pgherd_timeline", "The timeline the member is on.", live.timeline)
        gauge(
            "pgherd_wal_receiver_streaming",
            "1 when the member's WAL receiver streams from its upstream (a replica), else 0.",
            float(live.streaming),
        )
        gauge(
            "pgherd_pending_restart",
            "1 when a changed setting waits for a restart.",
            float(reading.pending_restart),
        )
    if figures is not None:
        gauge(
            "pgherd_replication_lag_bytes",
            "Replica: bytes of WAL it has not replayed yet of what the primary has, as far as it knows"
            " (received, or reported by the primary's WAL sender). 0 on a primary.",
            figures.lag_bytes,
        )
        gauge(
            "pgherd_replication_lag_seconds",
            "Replica: age of the last transaction replayed while behind the primary; 0 when caught up and"
            " on a primary.",
            figures.lag_seconds,
        )
        labelled(
            "pgherd_standby_lag_bytes",
            "Primary: bytes each standby has not replayed yet (pg_stat_replication).",
            "standby",
            figures.standby_lag,
        )
        gauge(
            "pgherd_wal_archive_last_success_timestamp_seconds",
            "When the last WAL segment was archived; 0 when none was (since the statistics were reset).",
            figures.archived_at or 0.0,
        )
        counter(
            "pgherd_wal_archive_failures_total",
            "Failed attempts to archive a WAL segment (pg_stat_archiver).",
            figures.archive_failures,
        )
        gauge(
            "pgherd_wal_archive_pending_segments",
            "WAL segments waiting for the archiver (.ready in pg_wal/archive_status).",
            figures.archive_pending,
        )
        connections = {state: 0 for state in CONNECTION_STATES} | dict(figures.connections)
        labelled(
            "pgherd_connections",
            "Client backends by state (pg_stat_activity), the agent's own reading not counted.",
            "state",
            connections,
        )
        gauge("pgherd_max_connections", "max_connections.", figures.max_connections)
        gauge(
            "pgherd_oldest_xid_age",
            "Transactions since the oldest unfrozen one of any database (max age(datfrozenxid)):"
            " PostgreSQL stops writes near 2^31.",
            figures.oldest_xid_age,
        )
        checkpoints = CounterMetricFamily(
            "pgherd_checkpoints_total",
            "Checkpoints (restartpoints on a replica, up to PostgreSQL 16) by kind: timed or requested.",
            labels=[*labels, "kind"],
        )
        checkpoints.add_metric([*base, "timed"], figures.checkpoints_timed)
        checkpoints.add_metric([*base, "requested"], figures.checkpoints_requested)
        out.append(checkpoints)
        labelled(
            "pgherd_database_size_bytes",
            "Size of each database that accepts connections.",
            "database",
            {name: float(size) for name, size in figures.database_sizes.items()},
        )
        gauge("pgherd_postgres_start_time_seconds", "When PostgreSQL last started.", figures.started_at)
    gauge(
        "pgherd_agent_scrape_duration_seconds",
        "How long the agent took for the reading this scrape answers from (its queries included).",
        reading.duration,
    )
    counter(
        "pgherd_agent_metrics_queries_total",
        "Readings that queried PostgreSQL: at most one a second, however many scrapes.",
        reading.runs,
    )
    out.extend(_custom_families(reading, labels, base))
    return out


def _custom_families(reading: Reading, labels: list[str], base: list[str]) -> Iterator[Metric]:
    failures = CounterMetricFamily(
        "pgherd_custom_query_errors_total",
        "Runs of a custom query that failed (the agent's log says why); its metrics are left out then.",
        labels=[*labels, "query"],
    )
    for name, count in sorted(reading.custom_errors.items()):
        failures.add_metric([*base, name], count)
    yield failures
    loaded = GaugeMetricFamily("pgherd_custom_queries_loaded", "Custom queries in force.", labels=labels)
    loaded.add_metric(base, reading.custom_loaded)
    yield loaded
    refused = GaugeMetricFamily(
        "pgherd_custom_queries_refused",
        "Entries of the custom queries file refused at its last reading (1: the file cannot be read or"
        " parsed); the agent's log says why.",
        labels=labels,
    )
    refused.add_metric(base, reading.custom_refused)
    yield refused
    for result in reading.custom:
        query = result.query
        for index, column in enumerate(query.values):
            kind = CounterMetricFamily if column.usage == "counter" else GaugeMetricFamily
            family = kind(
                query.metric_name(column),
                f"{query.help or query.name} ({column.column})",
                labels=[*labels, *query.labels],
            )
            for label_values, values in result.rows:
                value = values[index]
                if value is not None:  # NULL: no sample
                    family.add_metric([*base, *label_values], value)
            yield family


class MetricsServer:
    """GET /metrics over plain HTTP, in an event loop of its own thread; `stop()` closes it."""

    def __init__(self, readings: Readings, host: str, port: int) -> None:
        self.readings = readings
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(MemberCollector(readings))
        # The agent's own CPU and memory: pgherd_agent_process_cpu_seconds_total, ..._resident_memory_bytes
        ProcessCollector(namespace="pgherd_agent", registry=self.registry)
        self._sock = listening_socket(host, port)
        self._loop = asyncio.new_event_loop()
        self._pool = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="agent-metrics-render")
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._connections: Counter[str] = Counter()
        # As the agent's own server: beyond these, a new connection is closed before anything is read.
        self.max_connections = connection_limit()
        self.max_per_client = max(4, self.max_connections // 4)

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def start(self) -> MetricsServer:
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="agent-metrics", daemon=True)
        self._thread.start()
        started.wait(10)
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        if self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main(started))
        self._loop.close()

    async def _main(self, started: threading.Event) -> None:
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._serve, sock=self._sock, limit=MAX_HEAD)
        started.set()
        async with server:
            await self._stopping.wait()
            server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) else "?"
        if (
            sum(self._connections.values()) >= self.max_connections
            or self._connections[client] >= self.max_per_client
        ):
            writer.transport.abort()
            return
        self._connections[client] += 1
        try:
            method, code, content_type, body = await self._answer(reader)
            head = (
                f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode("ascii") + (b"" if method == "HEAD" else body))
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
            writer.close()  # once what is written has gone out
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.transport.abort()  # a client gone, too slow, or sending too much: nothing more
        finally:
            self._connections[client] -= 1
            if self._connections[client] <= 0:
                del self._connections[client]

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[str, int, str, bytes]:
        """(method, status, content type, body) of one request."""
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
        request, *lines = raw.decode("latin-1").split("\r\n")
        parts = request.split()
        if len(parts) != 3:
            return "GET", 400, "text/plain", b"malformed request\n"
        method, target = parts[0], parts[1].split("?", 1)[0]
        if target != "/metrics":
            return method, 404, "text/plain", b"not found: the metrics are at /metrics\n"
        if method not in ("GET", "HEAD"):
            return "GET", 405, "text/plain", b"GET /metrics\n"
        accept = ""
        for line in lines:
            name, sep, value = line.partition(":")
            if sep and name.strip().lower() == "accept":
                accept = value.strip()
        loop = asyncio.get_running_loop()
        try:
            content_type, body = await loop.run_in_executor(self._pool, self._render, accept)
        except Exception:  # a bug: logged (Shared logs a failed reading), answered, the server goes on
            log.exception("the agent's metrics could not be written")
            return method, 500, "text/plain", b"the agent's metrics failed: see its log\n"
        return method, 200, content_type, body

    def _render(self, accept: str) -> tuple[str, bytes]:
        encoder, content_type = choose_encoder(accept)
        return content_type, encoder(self.registry)
