"""PostgreSQL's TLS end to end: what clients see on each platform.

- A plain TCP connection is refused, for the application's account and for replication, with
  PostgreSQL's own "no pg_hba.conf entry ... no encryption".
- Every walsender (the replicas' streams) and every application session on the primary is TLS
  (pg_stat_ssl, read as the superuser, whom the platform lets in on the Unix socket alone).
- pgherd.io/rotate-certificates under a write load: a new connection sees a new certificate (another
  serial, still verified against the cluster's CA for the name the client asked), no write fails,
  nothing acknowledged is lost, and the replicas stream over TLS again.

The application's DSNs verify the server (verify-full): the sandbox's from `pgherd sandbox status`, and
on Kubernetes the app Secret's ca.crt with the -rw Service's DNS name (hostaddr: its ClusterIP).
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from e2e import manifests
from e2e.checks import (
    StatusRecorder,
    assert_no_acknowledged_write_lost,
    served_certificate,
    served_serial,
    tcp_sessions,
)
from e2e.driver import Driver, NewCluster, healthy, is_healthy
from e2e.workload import WriteLoad

pytestmark = pytest.mark.e2e

NAME = "e2e-tls"
INSTANCES = 3
ROTATE = "pgherd.io/rotate-certificates"
# On Kubernetes a renewed Secret reaches the pods' files within the kubelet's sync period (about a
# minute, more under load), then the agent's next check (10 s); the sandbox writes the files itself.
ROTATION_TIMEOUT = 240.0
# Short enough for a renewal (at two thirds) to happen during the module; the shortest the API takes.
LIFETIME = "5m"
NO_ENCRYPTION = "no encryption"


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, pg_version: int) -> Driver:
    return new_cluster(
        manifests.cluster(
            NAME, postgres_version=pg_version, instances=INSTANCES, tls={"certificateLifetime": LIFETIME}
        )
    )


def plain(dsn: str, **changes: str | None) -> str:
    """`dsn` without TLS (and with `changes`: None drops a key)."""
    params: dict[str, Any] = {**conninfo_to_dict(dsn), "sslmode": "disable"}
    for key, value in changes.items():
        if value is None:
            params.pop(key, None)
        else:
            params[key] = value
    params.pop("target_session_attrs", None)
    return make_conninfo("", **params)


def refusal(dsn: str) -> str:
    try:
        with psycopg.connect(dsn, connect_timeout=5):
            pass
    except psycopg.OperationalError as exc:
        return str(exc)
    raise AssertionError(f"a plain TCP connection was let in: {plain(dsn, password=None)}")


def test_plain_tcp_is_refused_for_the_application_and_replication(cluster: Driver) -> None:
    status = cluster.wait_for(healthy(INSTANCES), 120, "a healthy cluster")
    primary = str(status["primary"])
    for dsn in (cluster.rw_dsn(), cluster.member_dsn(primary)):
        with psycopg.connect(dsn, connect_timeout=5) as conn:  # verify-full: the server is who it says
            assert conn.execute("SELECT 1").fetchone() == (1,)
        message = refusal(plain(dsn))
        assert "no pg_hba.conf entry" in message and NO_ENCRYPTION in message, message
    message = refusal(
        plain(
            cluster.member_dsn(primary),
            user="streaming_replica",
            password=None,
            dbname="replication",
            replication="true",
        )
    )
    assert "no pg_hba.conf entry for replication connection" in message and NO_ENCRYPTION in message, message


def test_every_walsender_and_application_session_is_tls(cluster: Driver) -> None:
    cluster.wait_for(healthy(INSTANCES), 120, "a healthy cluster")
    held = [psycopg.connect(cluster.rw_dsn(), connect_timeout=5, autocommit=True) for _ in range(2)]
    try:
        found = tcp_sessions(cluster)
    finally:
        for conn in held:
            conn.close()
    walsenders = [s for s in found if s["kind"] == "walsender"]
    clients = [s for s in found if s["kind"] == "client backend" and s["usr"] == "app"]
    assert len(walsenders) == INSTANCES - 1, found
    assert all(s["usr"] == "streaming_replica" and s["ssl"] for s in walsenders), walsenders
    assert len(clients) >= 2 and all(s["ssl"] for s in clients), clients
    assert all(s["ssl"] for s in found), [s for s in found if not s["ssl"]]


class NewConnections:
    """A new verified connection through the -rw DSN every 0.1 s, in a thread: each TLS handshake
    across the rotation (the write load keeps one connection)."""

    def __init__(self, cluster: Driver) -> None:
        self.cluster = cluster
        self.made = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="new-connections", daemon=True)

    def __enter__(self) -> NewConnections:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        dsn = self.cluster.rw_dsn()
        while not self._stop.wait(0.1):
            try:
                with psycopg.connect(dsn, connect_timeout=5) as conn:
                    conn.execute("SELECT 1")
                self.made += 1
            except psycopg.Error as exc:
                self.failures.append(f"{datetime.now(UTC):%H:%M:%S.%f}: {exc}")


def test_rotated_certificates_are_served_under_load_without_a_failed_write(cluster: Driver) -> None:
    status = cluster.wait_for(healthy(INSTANCES), 120, "a healthy cluster")
    primary = str(status["primary"])
    member = cluster.member_dsn(primary)
    before = served_serial(member)
    load = WriteLoad(cluster.rw_dsn).start()
    try:
        with NewConnections(cluster) as connections:
            load.wait_for_acks(100)
            cluster.annotate(ROTATE, datetime.now(UTC).strftime("%Y%m%dT%H%M%S"))
            deadline = time.monotonic() + ROTATION_TIMEOUT
            while (after := served_serial(member)) == before:
                assert time.monotonic() < deadline, (
                    f"still the certificate {before:x} after {ROTATION_TIMEOUT:.0f} s"
                )
                time.sleep(1.0)
            load.wait_for_acks(100)
    finally:
        report = load.stop()
    print(f"\nserial {before:x} -> {after:x}; {report.summary()}; {connections.made} new connections")
    assert not report.failed, (
        f"writes failed during the rotation: {report.failure_windows()}; {report.summary()}"
    )
    assert connections.made > 0 and not connections.failures, connections.failures[:5]
    assert_no_acknowledged_write_lost(cluster, report)
    # The replicas still stream over TLS, from the renewed certificates; new clients verify them.
    cluster.wait_for(healthy(INSTANCES), 120, "a healthy cluster after the rotation")
    with psycopg.connect(cluster.rw_dsn(), connect_timeout=5) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    walsenders = [s for s in tcp_sessions(cluster) if s["kind"] == "walsender"]
    assert len(walsenders) == INSTANCES - 1 and all(s["ssl"] for s in walsenders), walsenders


def test_short_lived_certificates_are_renewed_before_they_expire_and_the_agents_stay_reachable(
    cluster: Driver,
) -> None:
    """With certificateLifetime 5m, the certificate served now is replaced before it expires, by itself,
    while writes go on; every status sample meanwhile shows every member ready (the operator reaches
    every agent over TLS: an agent serving an expired certificate would be unreachable to it)."""
    status = cluster.wait_for(healthy(INSTANCES), 120, "a healthy cluster")
    member = cluster.member_dsn(str(status["primary"]))
    first = served_certificate(member)  # verified: valid now
    expires = first.not_valid_after_utc
    load = WriteLoad(cluster.rw_dsn).start()
    try:
        with StatusRecorder(cluster, interval=1.0) as recorder:
            while (served := served_certificate(member)).serial_number == first.serial_number:
                assert datetime.now(UTC) < expires, (
                    f"the certificate {first.serial_number:x} expired unrenewed"
                )
                time.sleep(2.0)
            load.wait_for_acks(50)
    finally:
        report = load.stop()
    print(f"\nrenewed {expires - datetime.now(UTC)} before expiry; {report.summary()}")
    assert served.not_valid_after_utc > expires
    assert not report.failed, f"writes failed during the renewal: {report.failure_windows()}"
    assert_no_acknowledged_write_lost(cluster, report)
    unhealthy = [s.status for s in recorder.samples if not is_healthy(s.status, INSTANCES)]
    assert recorder.samples and not unhealthy, f"members lost during the renewal: {unhealthy[:2]}"
