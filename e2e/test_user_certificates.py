"""The user's own certificates on a real Kubernetes (spec.tls.serverCertSecret, spec.tls.clientCASecret),
in the Secrets cert-manager would write, from a CA the test makes (e2e/testca.py: an RSA root and an
intermediate that signs the leaves).

One cluster of two members, created with both Secrets in place, its tests in order:
- a client verifies the server with the app Secret's ca.crt (the user's root) and `sslmode=verify-full`
  through the -rw Service's name, and sees the user's certificate; CertificatesValid is True and
  status.certificates shows the user's certificate;
- the replica streams over TLS with a client certificate the user's client CA issued;
- the server Secret replaced by a new certificate, as cert-manager renews it: a new connection sees the
  new serial, PostgreSQL was reloaded and not restarted, the replica still streams.

Kubernetes only: the sandbox has no Secrets (it serves its own CA's certificates, docs/sandbox.md).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import psycopg
import pytest

from e2e import manifests
from e2e.checks import served_certificate, served_serial, tcp_sessions
from e2e.driver import Driver, DriverError, NewCluster, condition, healthy
from e2e.drivers.kube import KubeDriver
from e2e.testca import Issued, TestCA, cluster_names

DRIVER = os.environ.get("PGHERD_E2E_DRIVER", "local")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        DRIVER not in ("localkube", "kind"),
        reason="Kubernetes only: the user's certificates come from Secrets, which the sandbox has none of"
        " (it serves its own CA's certificates); run with PGHERD_E2E_DRIVER=localkube",
    ),
]

NAME = "e2e-own-certs"
INSTANCES = 2
SERVER_SECRET = f"{NAME}-server-tls"
CLIENT_CA_SECRET = f"{NAME}-client-ca"
# A replaced Secret reaches the pods' files within the kubelet's sync period (about a minute, more under
# load), after the operator's next read of the user's Secrets (10 s) and before the agent's next check (10 s).
RENEWAL_TIMEOUT = 240.0


class UserCertificates:
    """The test's CA, and the certificates it issued for the cluster."""

    def __init__(self) -> None:
        self.ca = TestCA("e2e user root", intermediate=True)
        self.client_ca = self.ca.issue_ca("e2e replication CA")
        self.server: Issued | None = None

    def issue_server(self, namespace: str) -> Issued:
        """A server certificate for the names docs/security.md lists, as a cert-manager Certificate asks."""
        self.server = self.ca.server(cluster_names(NAME, namespace))
        return self.server


def put_secret(driver: KubeDriver, secret: dict[str, Any], *, replace: bool = False) -> None:
    """The Secret created (or replaced whole, as cert-manager writes a renewal), on stdin: never in a
    file, and never in an annotation (`kubectl apply` would keep the key in last-applied-configuration)."""
    verb = "replace" if replace else "create"
    doc = {**secret, "metadata": {**secret["metadata"], "namespace": driver.namespace}}
    driver.kube.run("-n", driver.namespace, verb, "-f", "-", input=json.dumps(doc))


@pytest.fixture(scope="module")
def user() -> UserCertificates:
    return UserCertificates()


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, pg_version: int, user: UserCertificates) -> KubeDriver:
    def prepare(driver: Driver) -> None:
        assert isinstance(driver, KubeDriver)
        put_secret(driver, user.issue_server(driver.namespace).secret(SERVER_SECRET))
        put_secret(driver, user.client_ca.secret(CLIENT_CA_SECRET))

    manifest = manifests.cluster(
        NAME,
        postgres_version=pg_version,
        instances=INSTANCES,
        mode="async",  # quorum needs 3 members or 1
        tls={"serverCertSecret": SERVER_SECRET, "clientCASecret": CLIENT_CA_SECRET},
    )
    driver = new_cluster(manifest, prepare=prepare)
    assert isinstance(driver, KubeDriver)
    return driver


def test_clients_verify_the_users_certificate_through_the_rw_service(
    cluster: KubeDriver, user: UserCertificates
) -> None:
    cluster.wait_for(healthy(INSTANCES), 120, "a healthy cluster")
    assert user.server is not None
    assert cluster.credentials()["ca.crt"] == user.ca.root_pem  # the app Secret's CA: the user's root
    dsn = cluster.rw_dsn()  # verify-full, the app Secret's ca.crt, the -rw Service's DNS name
    with psycopg.connect(dsn, connect_timeout=5) as conn:
        assert conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone() == (True,)
    served = served_certificate(dsn)
    assert served.serial_number == user.server.serial
    assert served.issuer == user.ca.signer.cert.subject  # the user's intermediate, not the cluster CA
    valid = condition(cluster.status(), "CertificatesValid")
    assert valid is not None and valid["status"] == "True", valid
    status = cluster.get("postgresclusters.pgherd.io", NAME).get("status") or {}
    records = {r["name"]: r for r in status.get("certificates") or []}
    assert records["postgres"]["secret"] == SERVER_SECRET, records
    assert records["clientCA"]["secret"] == CLIENT_CA_SECRET, records


def test_replication_streams_with_a_certificate_of_the_users_client_ca(
    cluster: KubeDriver, user: UserCertificates
) -> None:
    cluster.wait_for(healthy(INSTANCES), 120, "a healthy cluster")
    walsenders = [s for s in tcp_sessions(cluster) if s["kind"] == "walsender"]
    assert len(walsenders) == INSTANCES - 1, walsenders
    assert all(s["usr"] == "streaming_replica" and s["ssl"] for s in walsenders), walsenders
    # pg_stat_ssl's issuer_dn: the client certificate's issuer, in OpenSSL's "/O=.../CN=..." form.
    assert all("CN=e2e replication CA" in str(s["issuer"]) for s in walsenders), walsenders


def test_a_renewed_server_secret_is_served_without_a_restart(
    cluster: KubeDriver, user: UserCertificates
) -> None:
    status = cluster.wait_for(healthy(INSTANCES), 120, "a healthy cluster")
    primary = str(status["primary"])
    started = cluster.superuser_value("SELECT pg_postmaster_start_time()")
    before = user.server
    assert before is not None
    renewed = user.issue_server(cluster.namespace)
    put_secret(cluster, renewed.secret(SERVER_SECRET), replace=True)
    deadline = time.monotonic() + RENEWAL_TIMEOUT
    while (serial := served_serial(cluster.rw_dsn())) != renewed.serial:
        assert serial == before.serial, f"served {serial:x}: neither the old nor the renewed certificate"
        assert time.monotonic() < deadline, f"still the certificate {serial:x} after {RENEWAL_TIMEOUT:.0f} s"
        time.sleep(2.0)
    assert served_serial(cluster.member_dsn(primary)) == renewed.serial
    assert cluster.superuser_value("SELECT pg_postmaster_start_time()") == started  # reloaded, not restarted
    cluster.wait_for(healthy(INSTANCES), 120, "a healthy cluster after the renewal")
    walsenders = [s for s in tcp_sessions(cluster) if s["kind"] == "walsender"]
    assert len(walsenders) == INSTANCES - 1 and all(s["ssl"] for s in walsenders), walsenders
    try:
        events = cluster.get("events.events.k8s.io").get("items") or []
    except DriverError:
        events = []
    notes = [str(e.get("note")) for e in events if e.get("reason") == "CertificatesUpdated"]
    assert any(f"{renewed.serial:x}" in note for note in notes), notes
