"""Data checks the scenarios share: what is on which member, read through the driver's DSNs."""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg
from cryptography import x509
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from e2e.driver import ClusterStatus, Driver, DriverError
from e2e.workload import DEFAULT_TABLE, WriteReport, connect, present_ids


def query(dsn: str, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with connect(dsn) as conn:
        return conn.execute(statement, params).fetchall()


def execute(dsn: str, statement: str, params: tuple[Any, ...] = ()) -> None:
    with connect(dsn) as conn:
        conn.execute(statement, params)


def scalar(dsn: str, statement: str, params: tuple[Any, ...] = ()) -> Any:
    rows = query(dsn, statement, params)
    return rows[0][0] if rows else None


def insert_ids(dsn: str, ids: Iterable[int], table: str = DEFAULT_TABLE) -> list[int]:
    """Insert these ids in one transaction through `dsn` (the read-write DSN); they are acknowledged once
    this returns."""
    wanted = list(ids)
    with connect(dsn, autocommit=False) as conn:
        with conn.cursor() as cur:
            cur.executemany(
                sql.SQL("INSERT INTO {} (id) VALUES (%s)").format(sql.Identifier(table)),
                [(i,) for i in wanted],
            )
        conn.commit()
    return wanted


def missing_on(dsn: str, ids: Iterable[int], table: str = DEFAULT_TABLE) -> list[int]:
    have = present_ids(dsn, table)
    return [i for i in ids if i not in have]


def wait_ids_on_member(
    driver: Driver, name: str, ids: Iterable[int], *, table: str = DEFAULT_TABLE, timeout: float = 30.0
) -> None:
    """Wait until member `name` holds every id (read on the member itself, replica or primary)."""
    wanted = list(ids)
    deadline = time.monotonic() + timeout
    last: str = ""
    while True:
        try:
            missing = missing_on(driver.member_dsn(name), wanted, table)
            if not missing:
                return
            last = f"{len(missing)} of {len(wanted)} ids missing, first {missing[:5]}"
        except (psycopg.Error, DriverError) as exc:
            last = f"cannot read it: {exc}"
        if time.monotonic() > deadline:
            raise AssertionError(
                f"member {name} does not hold the expected rows of {table} after {timeout:.0f} s: {last}\n{driver.describe()}"
            )
        time.sleep(0.5)


def assert_no_acknowledged_write_lost(driver: Driver, report: WriteReport) -> set[int]:
    """Every id the write load saw acknowledged is on the current primary; returns the ids present."""
    present = present_ids(driver.rw_dsn(), report.table)
    lost = report.lost(present)
    assert not lost, (
        f"{len(lost)} acknowledged write(s) lost on {report.table}: ids {lost[:20]}"
        f"{' ...' if len(lost) > 20 else ''}; {report.summary()}\n{driver.describe()}"
    )
    return present


def in_recovery(driver: Driver, name: str) -> bool:
    return bool(scalar(driver.member_dsn(name), "SELECT pg_is_in_recovery()"))


def primaries(driver: Driver, names: list[str]) -> list[str]:
    """The members that would take a write now: reachable, not in recovery, not read-only (a fenced
    primary is read-only; one that is stopped or unreachable takes nothing)."""
    writable = []
    for name in names:
        try:
            row = scalar(
                driver.member_dsn(name),
                "SELECT NOT pg_is_in_recovery() AND current_setting('default_transaction_read_only') = 'off'",
            )
        except (psycopg.Error, DriverError):
            continue
        if row:
            writable.append(name)
    return writable


def setting(driver: Driver, name: str, parameter: str) -> str:
    return str(scalar(driver.member_dsn(name), "SELECT current_setting(%s)", (parameter,)))


def postmaster_started(driver: Driver, name: str) -> float:
    """When the member's PostgreSQL started (epoch seconds): tells whether and in which order members restarted."""
    return float(scalar(driver.member_dsn(name), "SELECT extract(epoch FROM pg_postmaster_start_time())"))


_SSL_REQUEST = struct.pack("!ii", 8, 80877103)


def tcp_sessions(driver: Driver) -> list[dict[str, Any]]:
    """The primary's walsenders and client sessions over TCP, with pg_stat_ssl's verdict and, for a
    client certificate, its issuer (`issuer`, OpenSSL's one-line form)."""
    statement = (
        "SELECT coalesce(json_agg(x), '[]')::text FROM ("
        " SELECT a.backend_type AS kind, a.usename AS usr, s.ssl, s.version, s.issuer_dn AS issuer"
        " FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)"
        " WHERE a.client_addr IS NOT NULL) x"
    )
    return list(json.loads(driver.superuser_value(statement) or "[]"))


def served_certificate(dsn: str) -> x509.Certificate:
    """The certificate the server behind a one-host `dsn` presents to a new connection, verified as the
    DSN's client verifies it (its sslrootcert; the name in `host`): PostgreSQL's SSLRequest, then a TLS
    handshake on the same socket."""
    params = conninfo_to_dict(dsn)
    name = str(params["host"]).split(",")[0]
    address = str(params.get("hostaddr") or name).split(",")[0]
    port = int(str(params.get("port") or 5432).split(",")[0])
    context = ssl.create_default_context(cafile=str(params["sslrootcert"]))
    with socket.create_connection((address, port), timeout=5) as raw:
        raw.sendall(_SSL_REQUEST)
        assert raw.recv(1) == b"S", "the server does not speak TLS"
        with context.wrap_socket(raw, server_hostname=name) as conn:
            der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def served_serial(dsn: str) -> int:
    """The serial of `served_certificate(dsn)`."""
    return served_certificate(dsn).serial_number


@dataclass
class Sample:
    at: float  # time.monotonic()
    status: ClusterStatus


@dataclass
class StatusRecorder:
    """Samples the status in a thread while a scenario runs: which phases and primaries were seen, when."""

    driver: Driver
    interval: float = 0.3
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> StatusRecorder:
        self._thread = threading.Thread(target=self._run, name="status-recorder", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.is_set():
            # The platform may be restarting: a failed read is skipped, the next sample will tell.
            with contextlib.suppress(DriverError):
                self.samples.append(Sample(time.monotonic(), self.driver.status()))
            self._stop.wait(self.interval)

    def phases(self) -> list[str]:
        seen: list[str] = []
        for s in self.samples:
            phase = s.status.get("phase")
            if phase and (not seen or seen[-1] != phase):
                seen.append(phase)
        return seen

    def primary_changes(self) -> list[tuple[float, str | None, str | None]]:
        """(time of the first sample showing it, old primary, new primary) for each change of primary."""
        changes: list[tuple[float, str | None, str | None]] = []
        previous: str | None = None
        for i, s in enumerate(self.samples):
            primary = s.status.get("primary")
            if i and primary != previous:
                changes.append((s.at, previous, primary))
            previous = primary
        return changes


# Secret keys that hold nothing secret (a user name, certificates).
PUBLIC_KEYS = ("username", "tls.crt", "ca.crt")


def secret_values(secrets: Iterable[Mapping[str, Any]]) -> set[bytes]:
    """What a report or a log must never hold: every value of `secrets` but the public ones, as stored
    (base64) and decoded, and each long line of a decoded one (a PEM key's body)."""
    values: set[bytes] = set()
    for secret in secrets:
        for key, encoded in (secret.get("data") or {}).items():
            if key in PUBLIC_KEYS:
                continue
            plain = base64.b64decode(encoded)
            values |= {plain, encoded.encode()}
            values |= {
                line.encode()
                for line in plain.decode().splitlines()
                if len(line) > 16 and "-----" not in line
            }
    return values
