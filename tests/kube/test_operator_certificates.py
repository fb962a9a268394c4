"""The certificates pgherd issues, renewed by the operator in-process against the real API server (no
kubelet: what is checked is what the operator writes): the agents' Secret carries the replication
client certificate and every name a client reaches the members by; a certificate two thirds through its
life (a real one, issued in the test with an hour's lifetime fifty minutes ago) is issued again with the
CA and the token's digest kept, an Event posted and status.certificates moved on; the annotation
pgherd.io/rotate-certificates renews at once; the Secrets of a cluster made before TLS are upgraded; and
a renewal the API server refuses shows as CertificatesValid False."""

from __future__ import annotations

import base64
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cryptography import x509

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine.revision import spec_revision
from pgherd.kube import metrics, names
from pgherd.kube.builders import secrets
from pgherd.kube.builders.common import ClusterRef
from pgherd.kube.loop import ClusterLoop
from pgherd_backup.agent.auth import token_digest
from pgherd_backup.agent.tls import certificate_facts, make_server_cert

from .realkube import AuditLog, ChartIdentity, Kube, running_as
from .test_operator import cluster_manifest, cluster_with_status, events, spec_observed
from .waiting import eventually

JSON = dict[str, Any]
IMAGE = "ghcr.io/pgherd/pgherd:latest"


def values(secret: JSON) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


def encoded(data: dict[str, str]) -> dict[str, str]:
    return {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}


def dns_names(pem: str) -> set[str]:
    cert = x509.load_pem_x509_certificate(pem.encode())
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return set(alt.get_values_for_type(x509.DNSName))


def not_after(pem: str) -> datetime:
    return x509.load_pem_x509_certificate(pem.encode()).not_valid_after_utc


def condition(cluster: JSON, kind: str) -> JSON | None:
    return next((c for c in (cluster.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


def certificates_valid(kube: Kube, ns: str, status: str, what: str) -> JSON:
    """The cluster hippo's CertificatesValid condition, once its status is `status`."""
    return eventually(
        lambda: (
            (c := kube.read("postgresclusters", ns, "hippo"))
            and (found := condition(c, "CertificatesValid"))
            and found["status"] == status
            and found
        ),
        what=what,
    )


def created(kube: Kube, ns: str, **spec: Any) -> tuple[JSON, ClusterRef]:
    """The cluster object, and its ClusterRef (to make Secrets the way the operator would)."""
    doc = kube.create(cluster_manifest(ns, instances=1, **spec))
    model = PostgresClusterSpec.model_validate(doc["spec"])
    ref = ClusterRef("hippo", ns, doc["metadata"]["uid"], model, IMAGE, spec_revision(model, IMAGE))
    return doc, ref


def seed_secrets(
    kube: Kube, ref: ClusterRef, agent: Callable[[dict[str, str]], dict[str, str]]
) -> dict[str, str]:
    """The operator's Secret (a new CA and token) and an agents' Secret of `agent(operator data)`, made
    before any operator runs: what the operator then finds."""
    issuer = secrets.generate_operator_data(ref.name)
    kube.create(secrets.operator_secret(ref, issuer))
    body = secrets.agent_secret(ref, dict.fromkeys(secrets.AGENT_KEYS, "placeholder"))
    body["data"] = encoded(agent(issuer))  # an old Secret's keys only
    kube.create(body)
    return issuer


def agent_secret_changed(kube: Kube, ns: str, before: str) -> JSON | None:
    secret = kube.read("secrets", ns, "hippo-agent")
    return secret if secret and values(secret)["tls.crt"] != before else None


def test_the_agents_secret_carries_the_replication_certificate_and_every_name(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    ns = namespace
    kube.create(cluster_manifest(ns, instances=1))
    with running_as(chart_operator):
        cluster = cluster_with_status(kube, ns, "certificates", "status.certificates")
        agent = values(eventually(lambda: kube.read("secrets", ns, "hippo-agent"), what="the agents' Secret"))
        app = values(eventually(lambda: kube.read("secrets", ns, "hippo-app"), what="the app Secret"))
        figures = metrics.CLUSTERS.figures(ns, "hippo").certificates
    assert set(agent) == {
        "tls.crt",
        "tls.key",
        "ca.crt",
        "token.sha256",
        "replication.crt",
        "replication.key",
        "postgres.crt",
        "postgres.key",
        "postgres-ca.crt",
        "client-ca.crt",
    }
    # PostgreSQL's files: the members' own certificate and the cluster CA (no spec.tls Secrets).
    assert agent["postgres.crt"] == agent["tls.crt"] and agent["client-ca.crt"] == agent["ca.crt"]
    client = x509.load_pem_x509_certificate(agent["replication.crt"].encode())
    assert client.subject.rfc4514_string().startswith("CN=streaming_replica")
    names_held = dns_names(agent["tls.crt"])
    for service in ("hippo-rw", "hippo-ro", "hippo-r"):
        assert {
            service,
            f"{service}.{ns}",
            f"{service}.{ns}.svc",
            f"{service}.{ns}.svc.cluster.local",
        } <= names_held
    assert {f"hippo-{i}" for i in range(15)} <= names_held
    assert f"*.hippo-headless.{ns}.svc" in names_held
    expires = not_after(agent["tls.crt"])
    assert timedelta(days=89) < expires - datetime.now(UTC) <= timedelta(days=90)
    records = {r["name"]: r for r in cluster["status"]["certificates"]}
    assert set(records) == {"server", "replication"}
    assert records["server"]["secret"] == "hippo-agent"
    assert records["server"]["notAfter"] == secrets.format_time(expires)
    assert records["server"]["renewAt"] == secrets.format_time(certificate_facts(agent["tls.crt"]).renew_at)
    valid = condition(cluster, "CertificatesValid")
    assert valid is not None and valid["status"] == "True" and valid["reason"] == "Valid", valid
    assert figures == {"server": expires, "replication": not_after(agent["replication.crt"])}
    # The application's Secret: the CA, and a URI that verifies the -rw Service's name.
    assert app["ca.crt"] == agent["ca.crt"]
    assert app["uri"].endswith(f"@hippo-rw.{ns}.svc:5432/app?sslmode=verify-full")


def test_a_certificate_two_thirds_through_its_life_is_issued_again(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, audit: AuditLog
) -> None:
    ns = namespace
    _, ref = created(kube, ns, tls={"certificateLifetime": "1h"})
    issued_at = datetime.now(UTC) - timedelta(minutes=50)  # renewAt (about 38 minutes in) has passed
    issuer = seed_secrets(
        kube,
        ref,
        lambda issuer: secrets.generate_agent_data(
            "hippo", ns, issuer, lifetime=timedelta(hours=1), now=issued_at
        ),
    )
    seeded = kube.read("secrets", ns, "hippo-agent")
    operator_before = kube.read("secrets", ns, "hippo-operator")
    assert seeded is not None and operator_before is not None
    old = values(seeded)
    mark = audit.fence()
    with running_as(chart_operator):
        renewed = eventually(lambda: agent_secret_changed(kube, ns, old["tls.crt"]), what="the renewal")
        event = eventually(
            lambda: events(kube, ns, lambda e: e.get("reason") == "CertificatesRenewed"), what="the Event"
        )[0]
        new = values(renewed)
        cluster = eventually(
            lambda: (
                (c := kube.read("postgresclusters", ns, "hippo"))
                and any(
                    r["notAfter"] == secrets.format_time(not_after(new["tls.crt"]))
                    for r in (c.get("status") or {}).get("certificates") or []
                )
                and c
            ),
            what="status.certificates to show the new expiry",
        )
    # New certificates, an hour long from now; the CA and the token's digest as they were.
    assert new["ca.crt"] == old["ca.crt"] == issuer["ca.crt"]
    assert new["token.sha256"] == old["token.sha256"]
    assert new["tls.key"] != old["tls.key"] and new["replication.crt"] != old["replication.crt"]
    assert timedelta(minutes=55) < not_after(new["tls.crt"]) - datetime.now(UTC) <= timedelta(hours=1)
    assert renewed["type"] == "kubernetes.io/tls"
    assert renewed["metadata"]["ownerReferences"] == seeded["metadata"]["ownerReferences"]
    operator_after = kube.read("secrets", ns, "hippo-operator")
    assert operator_after is not None
    assert operator_after["metadata"]["resourceVersion"] == operator_before["metadata"]["resourceVersion"]
    note = event["note"]
    assert "issued the server (until" in note and "Secret hippo-agent again" in note
    assert "two thirds of the server certificate's lifetime have passed" in note
    assert secrets.format_time(not_after(new["tls.crt"])) in note
    valid = condition(cluster, "CertificatesValid")
    assert valid is not None and valid["status"] == "True", valid
    # One renewal: read afresh, replaced once (a PUT with its resourceVersion), never patched.
    audit.fence()
    writes = [
        (e.verb, e.code)
        for e in audit.of(chart_operator.user, mark)
        if e.resource == "secrets" and e.name == "hippo-agent"
    ]
    assert writes.count(("update", 200)) == 1 and ("patch", 200) not in writes, writes


def test_the_rotate_annotation_renews_at_once(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    ns = namespace
    kube.create(cluster_manifest(ns, instances=1))
    with running_as(chart_operator):
        first = eventually(lambda: kube.read("secrets", ns, "hippo-agent"), what="the agents' Secret")
        before = values(first)
        eventually(
            lambda: ((kube.read("postgresclusters", ns, "hippo") or {}).get("status") or {}).get(
                "certificates"
            ),
            what="status.certificates",
        )
        kube.merge(
            "postgresclusters",
            ns,
            "hippo",
            {"metadata": {"annotations": {"pgherd.io/rotate-certificates": "1"}}},
        )
        renewed = eventually(lambda: agent_secret_changed(kube, ns, before["tls.crt"]), what="the rotation")
        assert renewed["metadata"]["annotations"][names.ANNOTATION_ROTATED_FOR] == "1"
        note = eventually(
            lambda: events(kube, ns, lambda e: e.get("reason") == "CertificatesRenewed"), what="the Event"
        )[0]["note"]
        assert "asked for by pgherd.io/rotate-certificates=1" in note
        # Issued for that value: not again while it stays.
        version = renewed["metadata"]["resourceVersion"]
        time.sleep(1.0)  # five ticks
        again = kube.read("secrets", ns, "hippo-agent")
        assert again is not None and again["metadata"]["resourceVersion"] == version
    after = values(renewed)
    assert after["ca.crt"] == before["ca.crt"] and after["token.sha256"] == before["token.sha256"]


def test_the_secrets_of_a_cluster_made_before_tls_are_upgraded(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    """The agents' Secret as pgherd made it before (no replication certificate, the headless names
    alone, 825 days) and an app Secret without ca.crt: both upgraded, passwords and digest kept."""
    ns = namespace
    _, ref = created(kube, ns)

    def old_agent(issuer: dict[str, str]) -> dict[str, str]:
        headless = f"hippo-headless.{ns}"
        cert, key = make_server_cert(
            issuer["ca.crt"].encode(),
            issuer["ca.key"].encode(),
            f"*.{headless}.svc",
            dns=[f"*.{headless}", "*.hippo-headless"],
        )
        return {
            "tls.crt": cert.decode(),
            "tls.key": key.decode(),
            "ca.crt": issuer["ca.crt"],
            "token.sha256": token_digest(issuer["token"]),
        }

    issuer = seed_secrets(kube, ref, old_agent)
    password = "an old password"
    old_app = secrets.app_data(ref, password, "unused")
    del old_app["ca.crt"]
    old_app["uri"] = old_app["uri"].removesuffix("?sslmode=verify-full")
    app_body = secrets.app_secret(ref, {**old_app, "ca.crt": "placeholder"})
    app_body["data"] = encoded(old_app)
    kube.create(app_body)
    seeded = kube.read("secrets", ns, "hippo-agent")
    assert seeded is not None
    old = values(seeded)
    assert "replication.crt" not in old
    with running_as(chart_operator):
        renewed = eventually(lambda: agent_secret_changed(kube, ns, old["tls.crt"]), what="the upgrade")
        app = eventually(
            lambda: (s := kube.read("secrets", ns, "hippo-app")) and "ca.crt" in (s.get("data") or {}) and s,
            what="the app Secret's CA",
        )
        note = eventually(
            lambda: events(kube, ns, lambda e: e.get("reason") == "CertificatesRenewed"), what="the Event"
        )[0]["note"]
    new = values(renewed)
    assert "the Secret lacks replication.crt, replication.key" in note
    assert {"replication.crt", "replication.key"} <= set(new)
    assert f"hippo-rw.{ns}.svc" in dns_names(new["tls.crt"])
    assert new["ca.crt"] == issuer["ca.crt"] and new["token.sha256"] == old["token.sha256"]
    assert not_after(new["tls.crt"]) - datetime.now(UTC) <= timedelta(days=90)
    upgraded = values(app)
    assert upgraded["password"] == password and upgraded["ca.crt"] == issuer["ca.crt"]
    assert (
        upgraded["uri"].endswith("?sslmode=verify-full")
        and f":{password.replace(' ', '%20')}@" in upgraded["uri"]
    )


def test_a_renewal_the_api_server_refuses_shows_in_the_condition(
    kube: Kube,
    namespace: str,
    chart_operator_factory: Callable[..., ChartIdentity],
) -> None:
    """Without the chart's `update` on Secrets the renewal is refused (403): CertificatesValid False,
    RenewalFailed, the API server's words; with the chart's rights it goes through and turns True."""

    def without_secret_updates(docs: list[JSON]) -> None:
        for role in (d for d in docs if d["kind"] in ("ClusterRole", "Role")):
            for rule in role["rules"]:
                if "secrets" in rule["resources"]:
                    rule["verbs"] = [v for v in rule["verbs"] if v != "update"]

    ns = namespace
    _, ref = created(kube, ns, tls={"certificateLifetime": "1h"})
    issued_at = datetime.now(UTC) - timedelta(minutes=50)
    seed_secrets(
        kube,
        ref,
        lambda issuer: secrets.generate_agent_data(
            "hippo", ns, issuer, lifetime=timedelta(hours=1), now=issued_at
        ),
    )
    refused_identity = chart_operator_factory(edit=without_secret_updates, refusals=True)
    with running_as(refused_identity):
        cluster = certificates_valid(kube, ns, "False", "CertificatesValid False")
    assert cluster["reason"] == "RenewalFailed"
    assert "cannot renew the certificates of Secret hippo-agent" in cluster["message"]
    assert "forbidden" in cluster["message"].lower()
    with running_as(chart_operator_factory()):
        certificates_valid(kube, ns, "True", "CertificatesValid True once the renewal passes")


def test_a_due_check_that_cannot_read_its_parked_secret_says_so(
    kube: Kube,
    namespace: str,
    chart_operator_factory: Callable[..., ChartIdentity],
) -> None:
    """A settled check keeps the agents' Secret's name only; when it is due again (here: the rotate
    annotation) and the Secret cannot be read (`get` on Secrets taken from the running operator),
    CertificatesValid turns False with the API server's words and nothing is renewed; with the chart's
    rights back, the rotation goes through."""
    ns = namespace
    identity = chart_operator_factory(refusals=True)
    roles = [
        (
            ("roles", doc["metadata"].get("namespace")) if doc["kind"] == "Role" else ("clusterroles", None),
            doc,
        )
        for doc in identity.docs
        if doc["kind"] in ("ClusterRole", "Role") and any("secrets" in r["resources"] for r in doc["rules"])
    ]
    assert roles, "the chart's rules name no Secrets"

    def secret_rules(without: str | None) -> None:
        for (resource, role_ns), doc in roles:
            rules = [
                {**r, "verbs": [v for v in r["verbs"] if v != without]} if "secrets" in r["resources"] else r
                for r in doc["rules"]
            ]
            kube.merge(resource, role_ns, doc["metadata"]["name"], {"rules": rules})

    kube.create(cluster_manifest(ns, instances=1))
    with running_as(identity):
        first = eventually(lambda: kube.read("secrets", ns, "hippo-agent"), what="the agents' Secret")
        eventually(
            lambda: ((kube.read("postgresclusters", ns, "hippo") or {}).get("status") or {}).get(
                "certificates"
            ),
            what="status.certificates (the check settled)",
        )
        secret_rules(without="get")
        kube.merge(
            "postgresclusters",
            ns,
            "hippo",
            {"metadata": {"annotations": {"pgherd.io/rotate-certificates": "1"}}},
        )
        refused = certificates_valid(kube, ns, "False", "CertificatesValid False")
        assert "cannot read Secret hippo-agent to check its certificates" in refused["message"], refused
        assert "forbidden" in refused["message"].lower(), refused
        unchanged = kube.read("secrets", ns, "hippo-agent")
        assert unchanged is not None and values(unchanged)["tls.crt"] == values(first)["tls.crt"]
    secret_rules(without=None)
    with running_as(identity):
        renewed = eventually(
            lambda: agent_secret_changed(kube, ns, values(first)["tls.crt"]), what="the rotation"
        )
        assert renewed["metadata"]["annotations"][names.ANNOTATION_ROTATED_FOR] == "1"


class CheckCounter:
    """How often the ticks ran and the certificate check decoded the agents' Secret (`secret_values`)
    or asked whether a renewal is due (`agent_certificate_due`): counting wrappers, the real functions
    still do the work."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[str] = Counter()
        self.loops: dict[str, ClusterLoop] = {}  # by cluster name, as the ticks saw them
        for name in ("secret_values", "agent_certificate_due"):
            monkeypatch.setattr(secrets, name, self._counted(name, getattr(secrets, name)))
        tick = ClusterLoop.tick

        async def counted_tick(loop: ClusterLoop) -> None:
            self.counts["tick"] += 1
            self.loops[loop.name] = loop
            await tick(loop)

        monkeypatch.setattr(ClusterLoop, "tick", counted_tick)

    def _counted(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return function(*args, **kwargs)

        return counted

    def settled(self, seconds: float = 1.2) -> Counter[str]:
        """What `seconds` of ticks (every 0.2 s) cost."""
        before = Counter(self.counts)
        time.sleep(seconds)
        return self.counts - before


def test_the_certificate_check_runs_only_when_its_inputs_change(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A settled loop neither decodes the agents' Secret nor asks whether a renewal is due (at 2,000
    clusters that was a few percent of the operator's CPU, every 2 s per cluster); the check runs again
    when time reaches a certificate's renewal point (renewed then, Due), when the spec changes what it
    reads (a shorter certificateLifetime: renewed, LifetimeChanged), and after the Secret it wrote."""
    ns = namespace
    lifetime = timedelta(hours=3)
    _, ref = created(kube, ns, tls={"certificateLifetime": "3h"})
    # Issued so that two thirds of its life have passed `renew_in` from now, time for the operator to
    # start and settle on a loaded machine (renew_at is a fixed offset from the `now` it is issued at:
    # measured on a probe).
    renew_in = timedelta(seconds=15)
    probe_issuer = secrets.generate_operator_data("probe")
    start = datetime.now(UTC)
    probe = secrets.generate_agent_data("hippo", ns, probe_issuer, lifetime=lifetime, now=start)
    offset = certificate_facts(probe["tls.crt"]).renew_at - start
    issued_at = datetime.now(UTC) + renew_in - offset
    seed_secrets(
        kube,
        ref,
        lambda issuer: secrets.generate_agent_data("hippo", ns, issuer, lifetime=lifetime, now=issued_at),
    )
    seeded = kube.read("secrets", ns, "hippo-agent")
    assert seeded is not None
    old = values(seeded)
    renew_at = certificate_facts(old["tls.crt"]).renew_at
    counter = CheckCounter(monkeypatch)
    with running_as(chart_operator):
        first = eventually(
            lambda: ((kube.read("postgresclusters", ns, "hippo") or {}).get("status") or {}).get(
                "certificates"
            ),
            what="status.certificates",
        )
        # The seeded certificates were checked and kept: not due yet.
        assert {r["name"]: r["renewAt"] for r in first}["server"] == secrets.format_time(renew_at), first
        time.sleep(0.4)
        cost = counter.settled()
        assert datetime.now(UTC) < renew_at, "the operator started too late to see a settled tick"
        assert cost["tick"] >= 3 and cost["secret_values"] == 0 and cost["agent_certificate_due"] == 0, cost
        # Nor does it keep the Secret's keys and certificates in memory meanwhile (11 KB a cluster): the
        # renewal below reads it again.
        kept = counter.loops["hippo"].owned._agent_secret or {}
        assert "data" not in kept and "stringData" not in kept, sorted(kept)

        # Time crosses the renewal point: the certificates are issued again, with no other input changed.
        renewed = eventually(
            lambda: agent_secret_changed(kube, ns, old["tls.crt"]), timeout=30, what="renewal"
        )
        assert datetime.now(UTC) >= renew_at
        note = eventually(
            lambda: events(kube, ns, lambda e: e.get("reason") == "CertificatesRenewed"), what="the Event"
        )[0]["note"]
        assert "two thirds of the server certificate's lifetime have passed" in note, note
        time.sleep(0.4)
        cost = counter.settled()
        assert cost["tick"] >= 3 and cost["secret_values"] == 0 and cost["agent_certificate_due"] == 0, cost

        # A spec change that the check does not read: the check stays settled.
        kube.merge("postgresclusters", ns, "hippo", {"spec": {"instances": 2}})
        spec_observed(kube, ns)
        cost = counter.settled()
        assert cost["secret_values"] == 0 and cost["agent_certificate_due"] == 0, cost

        # A certificateLifetime shorter than the certificates' (by more than the hour of slack): issued
        # again at once.
        again = values(renewed)
        kube.merge("postgresclusters", ns, "hippo", {"spec": {"tls": {"certificateLifetime": "1h"}}})
        shorter = eventually(lambda: agent_secret_changed(kube, ns, again["tls.crt"]), what="the renewal")
        notes = eventually(
            lambda: [
                e["note"]
                for e in events(kube, ns, lambda e: e.get("reason") == "CertificatesRenewed")
                if "longer than the certificateLifetime of" in e["note"]
            ],
            what="the LifetimeChanged Event",
        )
        assert notes
        facts = certificate_facts(values(shorter)["tls.crt"])
        assert facts.not_after - datetime.now(UTC) <= timedelta(hours=1)
        time.sleep(0.4)
        cost = counter.settled()
        assert cost["tick"] >= 3 and cost["secret_values"] == 0 and cost["agent_certificate_due"] == 0, cost
