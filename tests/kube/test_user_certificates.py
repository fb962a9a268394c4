"""The user's own certificates (spec.tls.serverCertSecret, spec.tls.clientCASecret) in cert-manager's
Secret shape, made by a CA the test creates (e2e/testca.py: RSA, as cert-manager's default, with an
intermediate).

First the checks themselves (pure: a certificate that passes, and one Secret for each way to fail),
then the operator in-process against the real API server (no kubelet: what is checked is what the
operator writes into the agents' Secret, the app Secret, the status and the Events): the members get
the user's server certificate and CA and a replication certificate signed by the user's client CA,
while the agents keep the cluster CA's; a renewed Secret (what cert-manager does) reaches them; and a
Secret that is missing, lacks a key, holds a key of another certificate, misses a name or has expired
turns CertificatesValid False with an Event, installs nothing and never stops the cluster's loop.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cryptography import x509
from e2e.testca import Issued, TestCA, cluster_names

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.kube import usercerts
from pgherd.kube.builders import secrets
from pgherd.kube.builders.common import ClusterRef
from pgherd.kube.loop import OperatorConfig
from pgherd.kube.objects import AgentUpdate, OwnedObjects, UserCertificates

from .realkube import ChartIdentity, Kube, running_as
from .test_operator import cluster_manifest, events
from .waiting import eventually

JSON = dict[str, Any]
NS = "shop"
SERVER_SECRET = "hippo-server-tls"
CLIENT_CA_SECRET = "hippo-client-ca"


def now() -> datetime:
    """Read at each check: the module is imported at collection, minutes before its tests run in a full
    session, and the test CA's certificates are valid from 5 minutes before they are made."""
    return datetime.now(UTC)


def values(secret: JSON) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


def load(pem: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem.encode())


def signed_by(cert_pem: str, ca_pem: str) -> bool:
    try:
        load(cert_pem).verify_directly_issued_by(load(ca_pem))
    except (ValueError, TypeError, Exception):
        return False
    return True


@pytest.fixture(scope="module")
def ca() -> TestCA:
    return TestCA("shop root", intermediate=True)


def server_secret(ca: TestCA, namespace: str = NS, **options: Any) -> JSON:
    return ca.server(cluster_names("hippo", namespace), **options).secret(SERVER_SECRET, namespace)


def check_server(secret: JSON | None, instances: int = 3) -> usercerts.ServerCertificate | usercerts.Problem:
    return usercerts.check_server(
        SERVER_SECRET, secret, cluster="hippo", namespace=NS, instances=instances, now=now()
    )


# -- the checks ------------------------------------------------------------------------------------------


def test_a_certificate_as_cert_manager_writes_it_passes(ca: TestCA) -> None:
    secret = server_secret(ca)
    secret["data"]["keystore.p12"] = base64.b64encode(b"\x00\xff binary").decode()  # cert-manager's keystores
    found = check_server(secret)
    assert isinstance(found, usercerts.ServerCertificate), found
    data = values({"data": {k: v for k, v in secret["data"].items() if k != "keystore.p12"}})
    assert (found.cert, found.key, found.ca) == (data["tls.crt"], data["tls.key"], data["ca.crt"])
    assert found.not_after == load(data["tls.crt"]).not_valid_after_utc


def test_the_required_names_are_what_clients_reach_the_members_by() -> None:
    required = usercerts.required_names("hippo", NS, instances=2)
    for service in ("hippo-rw", "hippo-ro", "hippo-r"):
        assert {
            service,
            f"{service}.{NS}",
            f"{service}.{NS}.svc",
            f"{service}.{NS}.svc.cluster.local",
        } <= set(required)
    assert {f"hippo-{i}.hippo-headless.{NS}.svc" for i in range(2)} <= set(required)
    assert "hippo-2.hippo-headless.shop.svc" not in required
    # Every one of them is a name the operator's own certificate holds (or its wildcards cover).
    own = secrets.agent_server_names("hippo", NS)
    assert all(usercerts.covers(own, name) for name in required)
    # A wildcard covers one label, never more, never the bare domain.
    assert usercerts.covers(["*.hippo-headless.shop.svc"], "hippo-0.hippo-headless.shop.svc")
    assert not usercerts.covers(["*.hippo-headless.shop.svc"], "a.hippo-0.hippo-headless.shop.svc")
    assert not usercerts.covers(["*.hippo-headless.shop.svc"], "hippo-headless.shop.svc")
    assert usercerts.covers(["HIPPO-RW.shop.svc"], "hippo-rw.shop.svc")


def refused(reason: str, *words: str) -> Callable[[usercerts.ServerCertificate | usercerts.Problem], None]:
    def check(found: usercerts.ServerCertificate | usercerts.Problem) -> None:
        assert isinstance(found, usercerts.Problem), found
        assert found.reason == reason, found
        for word in words:
            assert word in found.message, found.message

    return check


def test_each_way_a_server_secret_fails_is_named(ca: TestCA) -> None:
    refused("SecretMissing", f"Secret {SERVER_SECRET}", "spec.tls.serverCertSecret", NS)(check_server(None))
    no_key = ca.server(cluster_names("hippo", NS)).secret(SERVER_SECRET, drop=("tls.key",))
    refused("KeysMissing", "lacks tls.key")(check_server(no_key))
    no_ca = ca.server(cluster_names("hippo", NS)).secret(SERVER_SECRET, drop=("ca.crt",))
    refused("KeysMissing", "lacks ca.crt")(check_server(no_ca))
    mixed = server_secret(ca)
    mixed["data"]["tls.key"] = server_secret(ca)["data"]["tls.key"]  # another certificate's key
    refused("KeyMismatch", "tls.key is not the key of tls.crt")(check_server(mixed))
    expired = server_secret(ca, not_before=now() - timedelta(days=40))
    refused("Expired", "expired at")(check_server(expired))
    lacking = ca.server(["hippo-rw", f"hippo-rw.{NS}.svc"]).secret(SERVER_SECRET)
    refused("NamesMissing", f"hippo-rw.{NS}", "hippo-ro")(check_server(lacking))
    # Members 0-2 named one by one: a fourth member is not covered.
    members = [n for n in cluster_names("hippo", NS) if "*" not in n]
    members += [
        f"hippo-{i}.hippo-headless{suffix}" for i in range(3) for suffix in (f".{NS}.svc", f".{NS}", "")
    ]
    explicit = ca.server(members).secret(SERVER_SECRET)
    assert isinstance(check_server(explicit, instances=3), usercerts.ServerCertificate)
    refused("NamesMissing", f"hippo-3.hippo-headless.{NS}.svc")(check_server(explicit, instances=4))
    other = TestCA("another root")
    foreign = server_secret(ca)
    foreign["data"]["ca.crt"] = base64.b64encode(other.root_pem.encode()).decode()
    refused("NotSignedByCA", "ca.crt")(check_server(foreign))
    garbled = server_secret(ca)
    garbled["data"]["tls.crt"] = base64.b64encode(b"not a certificate").decode()
    refused("Unreadable", "tls.crt")(check_server(garbled))


def client_ca_secret(issued: Issued, **options: Any) -> JSON:
    return issued.secret(CLIENT_CA_SECRET, NS, **options)


def check_client(secret: JSON | None) -> usercerts.ClientCA | usercerts.Problem:
    return usercerts.check_client_ca(CLIENT_CA_SECRET, secret, namespace=NS, now=now())


def test_a_client_ca_signs_the_replication_certificate(ca: TestCA) -> None:
    issued = ca.issue_ca("shop replication CA")
    found = check_client(client_ca_secret(issued))
    assert isinstance(found, usercerts.ClientCA), found
    # PostgreSQL's ssl_ca_file: the CA, the intermediate and the root above it (a chain to a root).
    held = [c.subject for c in x509.load_pem_x509_certificates(found.roots.encode())]
    assert held == [issued.cert.subject, *(c.subject for c in issued.chain), ca.root.subject]
    assert len(held) == 3
    issuer = secrets.generate_operator_data("hippo")
    data = secrets.generate_agent_data("hippo", NS, issuer, client_ca=found)
    assert signed_by(data["replication.crt"], found.cert)
    assert load(data["replication.crt"]).subject.rfc4514_string().startswith("CN=streaming_replica")
    assert signed_by(data["tls.crt"], issuer["ca.crt"])  # the agents' certificate stays the cluster CA's


def test_each_way_a_client_ca_secret_fails_is_named(ca: TestCA) -> None:
    issued = ca.issue_ca("shop replication CA")
    no_key = check_client(client_ca_secret(issued, drop=("tls.key",)))
    assert isinstance(no_key, usercerts.Problem) and no_key.reason == "KeysMissing", no_key
    assert "lacks tls.key" in no_key.message and "isCA: true" in no_key.message
    not_a_ca = check_client(ca.server(["hippo-rw"]).secret(CLIENT_CA_SECRET))
    assert isinstance(not_a_ca, usercerts.Problem) and not_a_ca.reason == "NotACA", not_a_ca
    gone = check_client(None)
    assert isinstance(gone, usercerts.Problem) and "spec.tls.clientCASecret" in gone.message


# -- the operator against the real API server -----------------------------------------------------------

FAST = OperatorConfig(steady_interval=0.2, busy_interval=0.1, certificate_secrets_interval=0.3)


def condition(kube: Kube, ns: str) -> JSON | None:
    cluster = kube.read("postgresclusters", ns, "hippo") or {}
    return next(
        (
            c
            for c in (cluster.get("status") or {}).get("conditions") or []
            if c["type"] == "CertificatesValid"
        ),
        None,
    )


def condition_is(kube: Kube, ns: str, status: str, reason: str | None = None) -> JSON | None:
    found = condition(kube, ns)
    if found and found["status"] == status and (reason is None or found["reason"] == reason):
        return found
    return None


def agent_data(kube: Kube, ns: str) -> dict[str, str]:
    secret = kube.read("secrets", ns, "hippo-agent")
    return values(secret) if secret else {}


def put_secret(kube: Kube, ns: str, secret: JSON) -> None:
    """As cert-manager writes its Secret: created, or its data replaced."""
    body = {**secret, "metadata": {**secret["metadata"], "namespace": ns}}
    if kube.read("secrets", ns, body["metadata"]["name"]) is None:
        kube.create(body)
    else:
        kube.merge("secrets", ns, body["metadata"]["name"], {"data": body["data"]})


def test_members_get_the_users_certificates_and_their_renewals(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, ca: TestCA
) -> None:
    ns = namespace
    server = ca.server(cluster_names("hippo", ns))
    client = ca.issue_ca("replication CA")
    put_secret(kube, ns, server.secret(SERVER_SECRET))
    put_secret(kube, ns, client.secret(CLIENT_CA_SECRET))
    kube.create(
        cluster_manifest(
            ns, instances=2, tls={"serverCertSecret": SERVER_SECRET, "clientCASecret": CLIENT_CA_SECRET}
        )
    )
    user = server.secret_data()
    with running_as(chart_operator, config=FAST):
        agent = eventually(
            lambda: (d := agent_data(kube, ns)) and d.get("postgres.crt") == user["tls.crt"] and d,
            what="the user's server certificate in the agents' Secret",
        )
        valid = eventually(lambda: condition_is(kube, ns, "True"), what="CertificatesValid True")
        app = eventually(
            lambda: (
                (s := kube.read("secrets", ns, "hippo-app")) and values(s)["ca.crt"] == user["ca.crt"] and s
            ),
            what="the app Secret's ca.crt: the user's CA",
        )
        cluster = kube.read("postgresclusters", ns, "hippo")
        assert cluster is not None
        # cert-manager renews the server certificate: a new key and certificate in the same Secret.
        renewed = ca.server(cluster_names("hippo", ns))
        put_secret(kube, ns, renewed.secret(SERVER_SECRET))
        after = eventually(
            lambda: (
                (d := agent_data(kube, ns)) and d["postgres.crt"] == renewed.secret_data()["tls.crt"] and d
            ),
            what="the renewed certificate in the agents' Secret",
        )
        note = eventually(
            lambda: [
                e
                for e in events(kube, ns, lambda e: e.get("reason") == "CertificatesUpdated")
                if f"{renewed.serial:x}" in e["note"]
            ],
            what="the Event of the renewed certificate",
        )[0]["note"]
    assert "without a restart" in note and f"Secret {SERVER_SECRET}" in note
    assert agent["postgres.key"] == user["tls.key"] and agent["postgres-ca.crt"] == user["ca.crt"]
    # PostgreSQL accepts client certificates of the user's client CA (with its root), and the
    # replication account's is signed by it.
    assert agent["client-ca.crt"].startswith(
        client.secret_data()["tls.crt"].split("-----END CERTIFICATE-----")[0]
    )
    assert signed_by(agent["replication.crt"], client.secret_data()["tls.crt"])
    # The agents' own certificate (the operator's HTTPS to them) stays the cluster CA's.
    operator_ca = values(kube.read("secrets", ns, "hippo-operator") or {})["ca.crt"]
    assert agent["ca.crt"] == operator_ca and signed_by(agent["tls.crt"], operator_ca)
    assert values(app)["uri"].endswith(f"@hippo-rw.{ns}.svc:5432/app?sslmode=verify-full")
    assert valid["reason"] == "Valid"
    records = {r["name"]: r for r in cluster["status"]["certificates"]}
    assert records["postgres"] == {
        "name": "postgres",
        "secret": SERVER_SECRET,
        "notAfter": secrets.format_time(server.cert.not_valid_after_utc),
    }
    assert records["clientCA"]["secret"] == CLIENT_CA_SECRET
    assert records["server"]["secret"] == "hippo-agent"
    # A renewal of the user's certificate issues nothing of the operator's again.
    assert (after["tls.crt"], after["replication.crt"]) == (agent["tls.crt"], agent["replication.crt"])
    assert after["postgres.key"] == renewed.secret_data()["tls.key"]


def test_a_bad_secret_is_reported_and_never_installed(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, ca: TestCA
) -> None:
    """Missing Secrets, then a certificate without the names, with another key, expired: each turns
    CertificatesValid False with its reason and an Event, and the members keep what they have (the
    operator's certificate first, the user's once one passed); the cluster's status keeps being written."""
    ns = namespace
    client = ca.issue_ca("replication CA")
    kube.create(
        cluster_manifest(
            ns, instances=1, tls={"serverCertSecret": SERVER_SECRET, "clientCASecret": CLIENT_CA_SECRET}
        )
    )
    put_secret(kube, ns, client.secret(CLIENT_CA_SECRET, drop=("tls.key",), opaque=True))

    def warned(reason: str) -> JSON:
        return eventually(
            lambda: events(kube, ns, lambda e: e.get("reason") == reason and e.get("type") == "Warning"),
            what=f"a Warning Event {reason}",
        )[0]

    with running_as(chart_operator, config=FAST):
        missing = eventually(lambda: condition_is(kube, ns, "False", "SecretMissing"), what="SecretMissing")
        assert (
            f"Secret {SERVER_SECRET}" in missing["message"]
            and "spec.tls.serverCertSecret" in missing["message"]
        )
        assert f"Secret {CLIENT_CA_SECRET} (spec.tls.clientCASecret) lacks tls.key" in missing["message"]
        assert f"Secret {SERVER_SECRET}" in warned("SecretMissing")["note"]
        assert CLIENT_CA_SECRET in warned("KeysMissing")["note"]
        own = agent_data(kube, ns)
        assert own["postgres.crt"] == own["tls.crt"] and own["client-ca.crt"] == own["ca.crt"]
        operator_ca = own["ca.crt"]
        app_ca = values(kube.read("secrets", ns, "hippo-app") or {})["ca.crt"]
        assert app_ca == operator_ca

        put_secret(kube, ns, ca.server(["hippo-rw"]).secret(SERVER_SECRET))
        lacking = eventually(lambda: condition_is(kube, ns, "False", "NamesMissing"), what="NamesMissing")
        assert f"hippo-ro.{ns}" in lacking["message"]
        warned("NamesMissing")
        assert agent_data(kube, ns)["postgres.crt"] == own["tls.crt"]

        good = ca.server(cluster_names("hippo", ns))
        put_secret(kube, ns, good.secret(SERVER_SECRET))
        eventually(
            lambda: agent_data(kube, ns)["postgres.crt"] == good.secret_data()["tls.crt"],
            what="the good certificate installed",
        )
        # Installed, then replaced by a certificate with another's key: refused, the good one stays.
        mixed = ca.server(cluster_names("hippo", ns)).secret(SERVER_SECRET)
        mixed["data"]["tls.key"] = good.secret(SERVER_SECRET)["data"]["tls.key"]
        put_secret(kube, ns, mixed)
        eventually(lambda: condition_is(kube, ns, "False", "KeyMismatch"), what="KeyMismatch")
        put_secret(
            kube,
            ns,
            ca.server(cluster_names("hippo", ns), not_before=now() - timedelta(days=40)).secret(
                SERVER_SECRET
            ),
        )
        eventually(lambda: condition_is(kube, ns, "False", "Expired"), what="Expired")
        assert agent_data(kube, ns)["postgres.crt"] == good.secret_data()["tls.crt"]
        assert values(kube.read("secrets", ns, "hippo-app") or {})["ca.crt"] == good.secret_data()["ca.crt"]

        # Both fixed: True, and the replication certificate now signed by the user's client CA.
        put_secret(kube, ns, good.secret(SERVER_SECRET))
        put_secret(kube, ns, client.secret(CLIENT_CA_SECRET))
        eventually(lambda: condition_is(kube, ns, "True"), what="CertificatesValid True")
        fixed = agent_data(kube, ns)
        cluster = kube.read("postgresclusters", ns, "hippo") or {}
    assert signed_by(fixed["replication.crt"], client.secret_data()["tls.crt"])
    assert (cluster.get("status") or {}).get("phase") not in (None, "Failed"), cluster.get("status")
    for name in (SERVER_SECRET, CLIENT_CA_SECRET):
        assert kube.read("secrets", ns, name) is not None  # nothing of the user's deleted


# -- what the agents' Secret must hold (the operator's plan, without the API server) ----------------------


def plan_for(
    spec: JSON,
    current: dict[str, str],
    user: UserCertificates,
    issuer: dict[str, str],
    at: datetime | None = None,
) -> AgentUpdate | None:
    owned = OwnedObjects(api=None, config=OperatorConfig())  # type: ignore[arg-type]  # _plan makes no request
    owned._issuer = issuer
    ref = ClusterRef("hippo", NS, "uid", PostgresClusterSpec.model_validate(spec), "image", "rev")
    return owned._plan(ref, {"metadata": {}, "data": encoded(current)}, None, at or now(), user)


def encoded(data: dict[str, str]) -> dict[str, str]:
    return {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}


def test_what_is_installed_stays_while_the_users_secrets_fail(ca: TestCA) -> None:
    issuer = secrets.generate_operator_data("hippo")
    named = {"tls": {"serverCertSecret": SERVER_SECRET, "clientCASecret": CLIENT_CA_SECRET}}
    good = check_server(server_secret(ca))
    client = check_client(client_ca_secret(ca.issue_ca("replication CA")))
    assert isinstance(good, usercerts.ServerCertificate) and isinstance(client, usercerts.ClientCA)
    first = plan_for(named, {}, UserCertificates(good, client), issuer)
    assert first is not None and first.renewal is not None and first.renewal.reason == "KeysMissing"
    installed = first.data
    assert installed["postgres.crt"] == good.cert and installed["client-ca.crt"] == client.roots
    assert first.updated is not None and f"Secret {SERVER_SECRET} (serial {good.serial:x}" in first.updated
    assert plan_for(named, installed, UserCertificates(good, client), issuer) is None  # nothing to do

    # Both Secrets fail now, and the operator's certificates are due (two thirds of 90 days passed):
    # the agents' certificate is issued again; PostgreSQL's files and the replication certificate stay.
    gone = usercerts.Problem(SERVER_SECRET, "SecretMissing", "gone")
    broken = usercerts.Problem(CLIENT_CA_SECRET, "KeysMissing", "no key")
    later = plan_for(named, installed, UserCertificates(gone, broken), issuer, now() + timedelta(days=61))
    assert later is not None and later.renewal is not None and later.renewal.reason == "Due"
    assert later.data["tls.crt"] != installed["tls.crt"]
    for key in ("postgres.crt", "postgres.key", "postgres-ca.crt", "client-ca.crt", "replication.crt"):
        assert later.data[key] == installed[key], key
    assert later.updated is None

    # spec.tls names none any more: PostgreSQL serves the cluster CA's certificate again.
    back = plan_for({}, installed, UserCertificates(), issuer)
    assert back is not None and back.data["postgres.crt"] == back.data["tls.crt"]
    assert back.data["client-ca.crt"] == back.data["postgres-ca.crt"] == issuer["ca.crt"]
    assert (
        back.renewal is not None and back.renewal.reason == "ClientCAChanged"
    )  # signed by the cluster CA now
    assert signed_by(back.data["replication.crt"], issuer["ca.crt"])
    assert back.updated is not None and "cluster CA's certificate again" in back.updated
