"""Run `pgherd instance run` (the real CLI) as a subprocess on 127.0.0.1, with certificates and secrets
from `pgherd instance certs`, and talk to it through AgentClient."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from pgherd.local.ports import free_port
from pgherd_backup.agent.client import AgentClient
from pgherd_backup.agent.wire import Status
from pgherd_backup.postgres import postmaster

PGHERD = str(Path(sys.executable).parent / "pgherd")
CLUSTER = "agents"
MEMBERS = [f"{CLUSTER}-{i}" for i in range(8)]


@dataclass(frozen=True)
class Certs:
    """What `pgherd instance certs` made: one CA, a certificate per member, the token and passwords."""

    folder: Path

    @property
    def ca(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def token(self) -> str:
        return (self.folder / "token").read_text().strip()

    @property
    def superuser_password(self) -> str:
        return (self.folder / "superuser-password").read_text().strip()

    @property
    def secrets(self) -> list[str]:
        return [
            self.token,
            self.superuser_password,
            (self.folder / "replication-password").read_text().strip(),
        ]

    def cert(self, member: str) -> tuple[Path, Path]:
        return self.folder / f"{member}.crt", self.folder / f"{member}.key"


def make_certs(folder: Path) -> Certs:
    args = [PGHERD, "instance", "certs", "--cluster", CLUSTER, "--out", str(folder)]
    for member in MEMBERS:
        args += ["--member", member]
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=60)
    return Certs(folder)


@dataclass
class Agent:
    """One member: its agent process, its ports, its volume."""

    name: str
    volume: Path
    certs: Certs
    port: int = field(default_factory=free_port)
    pg_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)  # GET /metrics (plain HTTP)
    flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # added to the environment (S3 credentials)
    process: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)

    @property
    def pgdata(self) -> Path:
        return self.volume / "data"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.pg_port}"

    @property
    def client(self) -> AgentClient:
        if "--no-tls" in self.flags:
            return AgentClient(f"http://127.0.0.1:{self.port}", token=self.certs.token)
        return AgentClient(f"https://127.0.0.1:{self.port}", ca_file=self.certs.ca, token=self.certs.token)

    def command(self) -> list[str]:
        cert, key = self.certs.cert(self.name)
        return [
            PGHERD,
            "instance",
            "run",
            "--cluster",
            CLUSTER,
            "--member",
            self.name,
            "--pgdata",
            str(self.pgdata),
            "--listen",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--pg-port",
            str(self.pg_port),
            "--metrics-port",
            str(self.metrics_port),
            "--pg-listen",
            "127.0.0.1",
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--tls-ca",
            str(self.certs.ca),
            "--token-file",
            str(self.certs.folder / "token"),
            "--superuser-password-file",
            str(self.certs.folder / "superuser-password"),
            "--stop-timeout",
            "5",
            "--terminate-wait",  # tests that want a terminating primary to wait say how long
            "0",
            "--parameter",
            "shared_buffers=16MB",
            "--parameter",
            "max_connections=30",
            "--parameter",
            "wal_retrieve_retry_interval=500ms",
            *self.flags,
        ]

    def start(self, *flags: str, wait: bool = True) -> Agent:
        """Start the agent process (again) with its flags and `flags`; wait for /startupz."""
        assert self.process is None or self.process.poll() is not None, f"{self.name} runs already"
        self.volume.mkdir(mode=0o755, exist_ok=True)
        log = self.volume / f"agent-{len(self.logs)}.log"
        self.logs.append(log)
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [*self.command(), *flags],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **self.env},
            )
        if wait:
            self.wait_until(lambda: self.client.probe("startupz") == 200, "its first start", timeout=90)
        return self

    def signal(self, signum: int) -> None:
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signum)

    def wait_exit(self, timeout: float = 60) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL (and PostgreSQL with it) when it does not exit in time."""
        if self.process is None or self.process.poll() is not None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        with contextlib.suppress(Exception):
            postmaster.kill(self.pgdata)

    @property
    def log(self) -> str:
        return "".join(path.read_text(errors="replace") for path in self.logs if path.exists())

    def status(self) -> Status:
        return self.client.status()

    def dsn(self, dbname: str = "postgres") -> str:
        return (
            f"host=127.0.0.1 port={self.pg_port} user=postgres dbname={dbname} "
            f"password={self.certs.superuser_password} connect_timeout=5"
        )

    def sql(self, query: str, params: tuple[Any, ...] | None = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            cursor = conn.execute(query, params)
            return list(cursor.fetchall()) if cursor.description else []

    def value(self, query: str) -> Any:
        return self.sql(query)[0][0]

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                if predicate():
                    return
            except Exception as exc:
                last = exc
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(
                    f"{self.name}: the agent exited ({self.process.returncode}):\n{self.log[-3000:]}"
                )
            time.sleep(0.1)
        raise AssertionError(
            f"{self.name}: timed out waiting for {what} ({last}); agent log:\n{self.log[-3000:]}"
        )

    def wait_streaming(self, timeout: float = 60) -> Status:
        self.wait_until(lambda: self.status().streaming, "streaming", timeout)
        return self.status()


def http_raw(
    port: int, method: str, path: str, headers: dict[str, str] | None = None, ca: Path | None = None
) -> tuple[int, Any]:
    """One request over TLS (trusting `ca`), without AgentClient: for refusals and probes."""
    import http.client
    import ssl

    context = ssl.create_default_context(cafile=str(ca)) if ca else ssl.create_default_context()
    connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
    try:
        connection.request(method, path, body=b"{}" if method == "POST" else None, headers=headers or {})
        response = connection.getresponse()
        text = response.read().decode()
        return response.status, json.loads(text) if text else None
    finally:
        connection.close()


class SlowProxy:
    """A TCP proxy on 127.0.0.1 that holds each new connection `delay` seconds before forwarding it: an
    upstream that makes a re-clone slow, deterministically. With `request_delay`, each request sent on a
    connection is held too (what the client sends after a lull of LULL: a client keeping its
    connections, as the agent's WAL service does, is slowed all the same). Once closed, it refuses new
    connections and drops those it still holds."""

    LULL = 0.02

    def __init__(self, target_port: int, delay: float) -> None:
        self.target_port = target_port
        self.delay = delay
        self.request_delay = 0.0
        # The first line of what clients sent after a lull of LULL (or first on a connection): their
        # requests, as "HEAD /bucket/key HTTP/1.1" for plain HTTP.
        self.requests: list[str] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        time.sleep(self.delay)
        if self._closed:  # closed meanwhile: the upstream went away for those still held too
            client.close()
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            client.close()
            return
        threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()

    def _requests(self, source: socket.socket, sink: socket.socket) -> None:
        last = 0.0
        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                if time.monotonic() - last > self.LULL:
                    self.requests.append(chunk.split(b"\r\n", 1)[0].decode(errors="replace"))
                    time.sleep(self.request_delay)
                sink.sendall(chunk)
                last = time.monotonic()
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
        self.listener.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def writer(agent: Agent, table: str) -> Iterator[list[int]]:
    """A thread committing one row at a time (synchronous_commit on) until the server goes away; yields
    the ids whose COMMIT was acknowledged."""
    agent.sql(f"CREATE TABLE IF NOT EXISTS {table} (id int PRIMARY KEY)")
    acknowledged: list[int] = []
    stop = threading.Event()

    def run() -> None:
        try:
            with psycopg.connect(agent.dsn(), autocommit=True) as conn:
                conn.execute("SET synchronous_commit = on")
                next_id = 1
                while not stop.is_set():
                    conn.execute(f"INSERT INTO {table} (id) VALUES (%s)", (next_id,))
                    acknowledged.append(next_id)
                    next_id += 1
                    time.sleep(0.002)
        except psycopg.Error:
            return  # the server went away: every id before this one was acknowledged

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield acknowledged
    finally:
        stop.set()
        thread.join(30)
