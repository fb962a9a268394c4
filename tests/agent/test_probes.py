"""The kubelet's probes cost PostgreSQL nothing: a flood of /readyz from any pod is answered from the
agent's cached view (no PostgreSQL session per probe), and the kubelet's own probes keep succeeding
while the primary takes writes."""

from __future__ import annotations

import functools
import http.client
import multiprocessing
import socket
import ssl
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
from agent_helpers import MEMBERS, Agent, writer

FLOOD = 500  # probes at least
FLOOD_CLIENTS = 200
FLOOD_SECONDS = 5.0
FLOOD_TIMEOUT = 10.0
# The chart's readiness probe: timeoutSeconds 2, every 2 s, unready after 2 failures (statefulset.py).
KUBELET_TIMEOUT = 2.0


@functools.cache
def _unverified() -> ssl.SSLContext:
    """The kubelet does not verify an HTTPS probe's certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def probe(port: int, path: str = "/readyz", timeout: float = KUBELET_TIMEOUT) -> int | None:
    """One probe on a new connection, as the kubelet makes it; None when no answer came in `timeout`."""
    started = time.monotonic()
    connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=_unverified())
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()
    return response.status if time.monotonic() - started <= timeout else None


def flood(port: int, clients: int, seconds: float, timeout: float) -> dict[str, int]:
    """Probes from `clients` concurrent clients for `seconds` (run in a process of its own, so that its
    threads do not slow the test's kubelet down); how they were answered ("none": not within `timeout`)."""
    end = time.monotonic() + seconds

    def client(_: int) -> list[int | None]:
        codes = []
        while time.monotonic() < end:
            codes.append(probe(port, timeout=timeout))
        return codes

    with ThreadPoolExecutor(clients) as pool:
        codes = [code for some in pool.map(client, range(clients)) for code in some]
    return {str(code or "none"): n for code, n in Counter(codes).items()}


def test_a_flood_of_readiness_probes_costs_postgresql_nothing(agents):
    primary = agents.primary(MEMBERS[0])
    assert probe(primary.port) == 200  # the agent's view of PostgreSQL is taken: its baseline
    with (
        psycopg.connect(primary.dsn(), autocommit=True) as watcher,
        writer(primary, "written_during_the_flood") as acknowledged,
    ):

        def backends() -> int:
            row = watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
            ).fetchone()
            return int(row[0]) if row else 0

        def sessions() -> int:
            row = watcher.execute(
                "SELECT sessions FROM pg_stat_database WHERE datname = 'postgres'"
            ).fetchone()
            return int(row[0]) if row else 0

        primary.wait_until(lambda: len(acknowledged) > 10, "the writes to begin")
        baseline, sessions_before = backends(), sessions()
        done = threading.Event()
        most = [baseline]
        kubelet: list[int | None] = []

        def sample() -> None:
            while not done.is_set():
                most.append(backends())
                time.sleep(0.05)

        def kubelet_probes() -> None:
            while not done.wait(1.0):
                kubelet.append(probe(primary.port))

        watchers = [threading.Thread(target=sample), threading.Thread(target=kubelet_probes)]
        for thread in watchers:
            thread.start()
        started = time.monotonic()
        try:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as other:
                answers = other.submit(
                    flood, primary.port, FLOOD_CLIENTS, FLOOD_SECONDS, FLOOD_TIMEOUT
                ).result()
        finally:
            done.set()
            for thread in watchers:
                thread.join()
        took = time.monotonic() - started
        written = len(acknowledged)
        time.sleep(1.1)  # each backend's counters reach pg_stat_database within a second
        started_sessions = sessions() - sessions_before
        report = (
            f"{sum(answers.values())} probes from {FLOOD_CLIENTS} clients in {took:.1f}s: {answers}; "
            f"kubelet: {kubelet}; "
            f"client backends {baseline} before, at most {max(most)} during; "
            f"{started_sessions} PostgreSQL sessions started"
        )
        # PostgreSQL did not see the flood: no session per probe, no more backends than before
        assert started_sessions <= 2, report
        assert max(most) <= baseline + 1, report
        # every probe was answered (503 is the answer of a concurrency limit), the kubelet's every time
        assert sum(answers.values()) >= FLOOD, report
        assert answers.get("none", 0) == 0 and set(answers) <= {"200", "503"}, report
        assert kubelet and all(code == 200 for code in kubelet), report
        # the writes went on all along: the writer stops at its first failure
        primary.wait_until(lambda: len(acknowledged) > written + 10, "more writes after the flood")
    status = primary.status()
    assert (status.role, status.ready) == ("primary", True), report


def _monitor_sessions(agent: Agent) -> int:
    return int(agent.value("SELECT count(*) FROM pg_stat_activity WHERE usename = 'pgherd_monitor'"))


def test_the_view_reads_as_pgherd_monitor_a_role_with_pg_monitor_rights_only(agents):
    primary = agents.primary(MEMBERS[0])
    attributes = primary.sql(
        "SELECT rolsuper, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls, rolcanlogin,"
        " pg_has_role(oid, 'pg_monitor', 'member'), rolpassword IS NULL"
        " FROM pg_authid WHERE rolname = 'pgherd_monitor'"
    )
    assert attributes == [(False, False, False, False, False, True, True, True)]
    assert probe(primary.port) == 200
    assert _monitor_sessions(primary) == 1  # kept from one probe to the next
    assert [probe(primary.port) for _ in range(5)] == [200] * 5
    assert _monitor_sessions(primary) == 1
    # no password: it logs in on the member's Unix socket alone, never over the network
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(
            f"host=127.0.0.1 port={primary.pg_port} user=pgherd_monitor dbname=postgres "
            "password=anything connect_timeout=5"
        ).close()


def test_a_cluster_made_before_the_role_gets_it_from_its_primary_and_replicas_by_replication(agents):
    primary = agents.primary(MEMBERS[0])
    primary.sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'pgherd_monitor'")
    primary.sql("DROP ROLE pgherd_monitor")  # as made before pgherd_monitor existed
    replica = agents(MEMBERS[1], "--seed", "basebackup", "--upstream", primary.address)
    replica.wait_streaming()
    # the replica cannot create it: its probes read as the superuser meanwhile, still no session each
    assert [probe(replica.port) for _ in range(3)] == [200] * 3
    assert "superuser for now" in replica.log
    # the primary's agent creates it at its first probe, and reads as it
    assert probe(primary.port) == 200
    assert "created the role pgherd_monitor" in primary.log
    assert _monitor_sessions(primary) == 1
    replica.wait_until(
        lambda: replica.value("SELECT count(*) FROM pg_roles WHERE rolname = 'pgherd_monitor'") == 1,
        "the role replicated",
    )


def test_a_slow_client_holds_no_thread_and_is_cut_off(agents):
    primary = agents.primary(MEMBERS[0])
    assert primary.process is not None
    threads = Path(f"/proc/{primary.process.pid}/status")

    def agent_threads() -> int:
        line = next(x for x in threads.read_text().splitlines() if x.startswith("Threads:"))
        return int(line.split()[1])

    before = agent_threads()
    silent = [socket.create_connection(("127.0.0.1", primary.port)) for _ in range(50)]  # no handshake
    trickling = []
    for _ in range(50):  # a handshake, then a request that never ends
        tls = _unverified().wrap_socket(socket.create_connection(("127.0.0.1", primary.port)))
        tls.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n")
        trickling.append(tls)
    try:
        assert probe(primary.port) == 200
        assert primary.client.status().role == "primary"
        assert agent_threads() <= before + 2  # the view's refresh, a /status
        for connection in [*silent, *trickling]:
            connection.settimeout(20)
        started = time.monotonic()
        # cut off: the silent ones after the handshake's deadline, the others after the request's
        assert all(connection.recv(1) == b"" for connection in silent)
        assert time.monotonic() - started < 10
        assert all(_cut(connection) for connection in trickling)
        assert time.monotonic() - started < 15
    finally:
        for connection in [*silent, *trickling]:
            connection.close()


def _cut(connection: socket.socket) -> bool:
    try:
        return connection.recv(1) == b""
    except (ssl.SSLError, ConnectionResetError):
        return True
