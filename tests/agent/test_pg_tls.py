"""PostgreSQL's TLS on real members (`--pg-tls`): plain TCP refused with PostgreSQL's own words,
replication and pg_rewind by client certificate alone, the superuser on the Unix socket only, clients
that verify the server, a member moved to TLS from a cluster made without it, certificates renewed
under a running PostgreSQL without a restart, and the user's own certificates (`--pg-tls-*`) served by
PostgreSQL while the agent keeps the cluster CA's."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from agent_helpers import MEMBERS, PGHERD, Agent, Certs
from e2e.testca import TestCA, key_pem

from conftest import Agents
from pgherd_backup.agent.options import AgentOptions
from pgherd_backup.agent.tls import make_client_cert, write_private
from pgherd_backup.postgres.config import read_pgherd_conf

REPLICATION = "streaming_replica"


@pytest.fixture(scope="module")
def tls_certs(certs: Certs) -> Certs:
    """The session's CA and member certificates, plus the replication account's client certificate."""
    subprocess.run(
        [
            PGHERD,
            "instance",
            "certs",
            "--cluster",
            "agents",
            "--out",
            str(certs.folder),
            "--client",
            REPLICATION,
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return certs


def tls_flags(certs: Certs, *, tls: bool = True) -> list[str]:
    flags = [
        "--replication-user",
        REPLICATION,
        "--replication-password-file",
        str(certs.folder / "replication-password"),
        "--app-user",
        "app",
        "--app-password-file",
        str(certs.folder / "replication-password"),
    ]
    if tls:
        flags += [
            "--pg-tls",
            "--replication-cert",
            str(certs.folder / f"{REPLICATION}.client.crt"),
            "--replication-key",
            str(certs.folder / f"{REPLICATION}.client.key"),
        ]
    return flags


def socket_dsn(agent: Agent) -> str:
    """The superuser on the member's Unix socket: how pgherd's own tools reach it."""
    options = AgentOptions("agents", agent.name, agent.pgdata, Path("token"), no_tls=True)
    return f"host={options.socket_dir} port={agent.pg_port} user=postgres dbname=postgres"


def local(agent: Agent, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(socket_dsn(agent), autocommit=True) as conn:
        cursor = conn.execute(query)
        return list(cursor.fetchall()) if cursor.description else []


def app_password(certs: Certs) -> str:
    return (certs.folder / "replication-password").read_text().strip()


def wait(predicate: Any, what: str, timeout: float = 60, *logs: Agent) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (psycopg.Error, OSError):
            pass
        time.sleep(0.2)
    tails = "\n".join(f"--- {agent.name}:\n{agent.log[-3000:]}" for agent in logs)
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


@pytest.fixture
def pair(agents: Agents, tls_certs: Certs) -> Iterator[tuple[Agent, Agent]]:
    primary = agents(MEMBERS[0], "--seed", "initdb", *tls_flags(tls_certs))
    replica = agents(MEMBERS[1], "--seed", "basebackup", "--upstream", primary.address, *tls_flags(tls_certs))
    wait(lambda: replica.status().streaming, "the replica to stream", 60, primary, replica)
    yield primary, replica


def test_every_connection_is_tls_and_plain_tcp_is_refused(
    pair: tuple[Agent, Agent], tls_certs: Certs
) -> None:
    primary, replica = pair
    # The walsender serving the replica: TLS, authenticated by the replication certificate.
    rows = local(
        primary,
        "SELECT s.ssl, a.usename FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)"
        " WHERE a.backend_type = 'walsender'",
    )
    assert rows == [(True, REPLICATION)]
    password = app_password(tls_certs)
    for dsn in (
        f"host=127.0.0.1 port={primary.pg_port} user=app dbname=app password={password} sslmode=disable",
        f"host=127.0.0.1 port={primary.pg_port} user={REPLICATION} dbname=replication replication=true"
        f" password={password} sslmode=disable",
    ):
        with pytest.raises(psycopg.OperationalError, match="no encryption"):
            psycopg.connect(dsn, connect_timeout=5)
    # The replication account has no password over TLS either: its certificate or nothing.
    with pytest.raises(psycopg.OperationalError, match="certificate"):
        psycopg.connect(
            f"host=127.0.0.1 port={primary.pg_port} user={REPLICATION} dbname=postgres password={password}"
            f" sslmode=verify-ca sslrootcert={tls_certs.ca}",
            connect_timeout=5,
        )
    # The superuser is not reachable over the network, even with its password over TLS.
    with pytest.raises(psycopg.OperationalError, match="rejects connection"):
        psycopg.connect(
            f"host=127.0.0.1 port={primary.pg_port} user=postgres dbname=postgres"
            f" password={tls_certs.superuser_password} sslmode=verify-ca sslrootcert={tls_certs.ca}",
            connect_timeout=5,
        )
    # An application verifies the server (its name: 127.0.0.1 is in the member's certificate).
    with psycopg.connect(
        f"host=127.0.0.1 port={primary.pg_port} user=app dbname=app password={password}"
        f" sslmode=verify-full sslrootcert={tls_certs.ca}",
        connect_timeout=5,
    ) as conn:
        assert conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone() == (True,)
        version = conn.execute("SELECT version FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()
        assert version == ("TLSv1.3",)
    assert "no password" not in read_pgherd_conf(replica.pgdata).get("primary_conninfo", "")
    assert "sslcert=" in read_pgherd_conf(replica.pgdata)["primary_conninfo"]


def test_rewind_by_the_replication_certificate(pair: tuple[Agent, Agent]) -> None:
    primary, replica = pair
    local(primary, "CREATE TABLE t AS SELECT 1 AS x")
    wait(lambda: local(replica, "SELECT count(*) FROM t") == [(1,)], "replay")
    replica.client.fence()
    local(primary, "INSERT INTO t SELECT generate_series(2, 1000)")
    primary.client.fence()
    assert replica.client.promote().timeline == 2
    local(replica, "INSERT INTO t VALUES (-1)")
    rejoined = primary.client.rejoin(replica.address, reason="the old primary follows the new one")
    assert rejoined.method == "rewind" and rejoined.kept_aside is None, (rejoined, primary.log[-4000:])
    status = primary.wait_streaming()
    assert (status.role, status.timeline) == ("replica", 2)
    wait(lambda: local(primary, "SELECT count(*) FROM t WHERE x = -1") == [(1,)], "the new history")


def test_a_member_of_a_cluster_made_without_tls_moves_to_it(agents: Agents, tls_certs: Certs) -> None:
    """A rollout brings TLS to a cluster made before it: a replica restarted with TLS follows the
    primary that has none yet by password; once the primary restarts with TLS, the replica moves its
    replication to TLS by itself (no restart)."""
    primary = agents(MEMBERS[2], "--seed", "initdb", *tls_flags(tls_certs, tls=False))
    replica = agents(
        MEMBERS[3], "--seed", "basebackup", "--upstream", primary.address, *tls_flags(tls_certs, tls=False)
    )
    wait(lambda: replica.status().streaming, "the replica to stream")
    replica.stop()
    replica.flags = [f for f in replica.flags if f not in ("--seed", "basebackup")]
    replica.flags += tls_flags(tls_certs)[8:]  # its restart with TLS
    replica.start()
    wait(lambda: replica.status().streaming, "the TLS replica to stream from the old primary")
    assert "sslcert=" not in read_pgherd_conf(replica.pgdata)["primary_conninfo"]
    primary.stop()
    primary.flags += tls_flags(tls_certs)[8:]
    primary.start()
    wait(
        lambda: (
            local(
                primary,
                "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE a.backend_type = 'walsender'",
            )
            == [(True,)]
        ),
        "the replica to stream by TLS",
        timeout=90,
    )
    assert "sslcert=" in read_pgherd_conf(replica.pgdata)["primary_conninfo"]


def test_renewed_certificates_are_reloaded_without_a_restart(
    pair: tuple[Agent, Agent], tls_certs: Certs
) -> None:
    primary, replica = pair
    started = local(primary, "SELECT pg_postmaster_start_time()")
    before = served_serial(primary)
    # A renewal: the member's certificate files replaced in place, as a renewed Secret is in a pod.
    subprocess.run(
        [
            PGHERD,
            "instance",
            "certs",
            "--cluster",
            "agents",
            "--out",
            str(tls_certs.folder),
            "--member",
            primary.name,
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    wait(lambda: served_serial(primary) != before, "the new certificate served", 60, primary)
    assert local(primary, "SELECT pg_postmaster_start_time()") == started  # reloaded, not restarted
    with psycopg.connect(
        f"host=127.0.0.1 port={primary.pg_port} user=app dbname=app password={app_password(tls_certs)}"
        f" sslmode=verify-full sslrootcert={tls_certs.ca}",
        connect_timeout=5,
    ) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert replica.status().streaming


def served_serial(agent: Agent) -> str:
    """The serial number of the certificate the member's PostgreSQL presents (openssl s_client)."""
    result = subprocess.run(
        ["openssl", "s_client", "-starttls", "postgres", "-connect", f"127.0.0.1:{agent.pg_port}"],
        input="",
        capture_output=True,
        text=True,
        timeout=20,
    )
    certificate = result.stdout[result.stdout.index("-----BEGIN CERTIFICATE-----") :]
    details = subprocess.run(
        ["openssl", "x509", "-noout", "-serial"],
        input=certificate,
        capture_output=True,
        text=True,
        timeout=20,
    )
    return details.stdout.strip().removeprefix("serial=")


def test_the_users_certificates_serve_postgresql_and_sign_replication(
    agents: Agents, tls_certs: Certs, tmp_path: Path
) -> None:
    """PostgreSQL serves a server certificate of another CA (RSA, with an intermediate) and accepts
    client certificates of a third one, which signed the replication certificate: replicas stream and
    verify their upstream against the user's CA; the cluster CA's replication certificate is refused;
    the agents' HTTPS still answers with the cluster CA's certificate."""
    server_ca, client_ca = TestCA("user servers", intermediate=True), TestCA("user clients")
    served = server_ca.server(["localhost"])
    files = {
        "server.crt": served.secret_data()["tls.crt"],
        "server.key": served.secret_data()["tls.key"],
        "server-ca.crt": server_ca.root_pem,
        "client-ca.crt": client_ca.root_pem,
    }
    cert, key = make_client_cert(
        client_ca.root_pem.encode(), key_pem(client_ca.root_key).encode(), REPLICATION
    )
    files["replication.crt"], files["replication.key"] = cert.decode(), key.decode()
    for name, text in files.items():
        write_private(tmp_path / name, text.encode())
    flags = [
        *tls_flags(tls_certs)[:8],
        "--pg-tls",
        "--replication-cert",
        str(tmp_path / "replication.crt"),
        "--replication-key",
        str(tmp_path / "replication.key"),
        "--pg-tls-cert",
        str(tmp_path / "server.crt"),
        "--pg-tls-key",
        str(tmp_path / "server.key"),
        "--pg-tls-ca",
        str(tmp_path / "server-ca.crt"),
        "--pg-client-ca",
        str(tmp_path / "client-ca.crt"),
    ]
    primary = agents(MEMBERS[4], "--seed", "initdb", *flags)
    replica = agents(MEMBERS[5], "--seed", "basebackup", "--upstream", primary.address, *flags)
    wait(lambda: replica.status().streaming, "the replica to stream", 60, primary, replica)
    rows = local(
        primary,
        "SELECT s.ssl, a.usename FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)"
        " WHERE a.backend_type = 'walsender'",
    )
    assert rows == [(True, REPLICATION)]
    assert int(served_serial(primary), 16) == served.serial
    with psycopg.connect(
        f"host=localhost port={primary.pg_port} user=app dbname=app password={app_password(tls_certs)}"
        f" sslmode=verify-full sslrootcert={tmp_path / 'server-ca.crt'}",
        connect_timeout=5,
    ) as conn:
        assert conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone() == (True,)
    # The cluster CA's replication certificate is no longer one PostgreSQL accepts.
    with pytest.raises(psycopg.OperationalError, match="unknown ca"):
        psycopg.connect(
            f"host=localhost port={primary.pg_port} user={REPLICATION} dbname=postgres"
            f" sslmode=verify-full sslrootcert={tmp_path / 'server-ca.crt'}"
            f" sslcert={tls_certs.folder / f'{REPLICATION}.client.crt'}"
            f" sslkey={tls_certs.folder / f'{REPLICATION}.client.key'}",
            connect_timeout=5,
        )
    assert primary.client.status().role == "primary"  # verified against the cluster CA (certs.ca)
