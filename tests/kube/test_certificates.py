"""The renewal rule of the certificates pgherd issues (`secrets.agent_certificate_due`), on real
certificates: due once two thirds of a lifetime have passed, at once when pgherd.io/rotate-certificates
takes a new value, when a key or a name is missing (a cluster made before TLS), when the lifetime asked
is shorter than the one issued, or another CA signed them; and the condition CertificatesValid."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta

import pytest

from pgherd.kube import names
from pgherd.kube.builders import secrets
from pgherd.kube.loop import certificates_valid
from pgherd.kube.objects import CertificateCheck, OwnedObjects
from pgherd_backup.agent.tls import certificate_facts, make_server_cert

CLUSTER, NAMESPACE = "demo", "shop"
NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def issuer() -> dict[str, str]:
    return secrets.generate_operator_data(CLUSTER)


def issued(
    issuer: dict[str, str], lifetime: timedelta = timedelta(days=90), at: datetime = NOW
) -> dict[str, str]:
    return secrets.generate_agent_data(CLUSTER, NAMESPACE, issuer, lifetime=lifetime, now=at)


def encoded(data: dict[str, str]) -> dict[str, str]:
    """A Secret's `data` for these values."""
    return {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}


def due(data: dict[str, str], now: datetime, **kwargs: object) -> secrets.Renewal | None:
    return secrets.agent_certificate_due(data, now, cluster=CLUSTER, namespace=NAMESPACE, **kwargs)  # type: ignore[arg-type]


def test_due_once_two_thirds_of_the_lifetime_have_passed(issuer: dict[str, str]) -> None:
    data = issued(issuer)
    renew_at = certificate_facts(data["tls.crt"]).renew_at
    # Valid from 5 minutes before NOW for 90 days: two thirds are 60 days and 3 minutes 20 s from then.
    assert renew_at == NOW - timedelta(minutes=5) + (timedelta(days=90, minutes=5) * 2 / 3)
    assert due(data, NOW) is None
    assert due(data, renew_at - timedelta(seconds=1)) is None
    found = due(data, renew_at)
    assert found is not None and found.reason == "Due"
    assert "two thirds of the server certificate's lifetime" in found.message
    assert "2027-02-25" in found.message  # when it expires


def test_an_hour_long_lifetime_is_renewed_after_about_forty_minutes(issuer: dict[str, str]) -> None:
    data = issued(issuer, timedelta(hours=1))
    assert due(data, NOW + timedelta(minutes=38), lifetime=timedelta(hours=1)) is None
    found = due(data, NOW + timedelta(minutes=39), lifetime=timedelta(hours=1))
    assert found is not None and found.reason == "Due"


def test_the_rotate_annotation_renews_at_once_for_a_value_not_seen(issuer: dict[str, str]) -> None:
    data = issued(issuer)
    assert due(data, NOW, requested=None, renewed_for=None) is None
    found = due(data, NOW, requested="1", renewed_for=None)
    assert found is not None and found.reason == "Requested"
    assert found.message == "asked for by pgherd.io/rotate-certificates=1"
    assert due(data, NOW, requested="1", renewed_for="1") is None  # renewed for it already
    assert due(data, NOW, requested="2", renewed_for="1") is not None
    assert due(data, NOW, requested=None, renewed_for="1") is None  # the annotation removed: nothing


def test_a_secret_made_before_tls_lacks_keys_and_names(issuer: dict[str, str]) -> None:
    """The agents' Secret as pgherd made it before: no replication certificate, a server certificate
    for the headless names alone, valid 825 days."""
    cert, key = make_server_cert(
        issuer["ca.crt"].encode(),
        issuer["ca.key"].encode(),
        f"*.{CLUSTER}-headless.{NAMESPACE}.svc",
        dns=[f"*.{CLUSTER}-headless.{NAMESPACE}", f"*.{CLUSTER}-headless"],
    )
    old = {"tls.crt": cert.decode(), "tls.key": key.decode(), "ca.crt": issuer["ca.crt"], "token.sha256": "d"}
    found = due(old, NOW)
    assert found is not None and found.reason == "KeysMissing"
    assert found.message == "the Secret lacks replication.crt, replication.key"
    with_client = {**issued(issuer), **old}
    found = due(with_client, NOW)
    assert found is not None and found.reason == "NamesMissing"
    assert found.message.startswith(
        "the server certificate does not name demo-rw, demo-rw.shop, demo-rw.shop.svc"
    )
    assert due({**old, "tls.crt": ""}, NOW) is not None  # an empty value counts as missing


def test_a_certificate_longer_lived_than_asked_is_issued_again(issuer: dict[str, str]) -> None:
    data = issued(issuer, timedelta(days=825))
    assert due(data, NOW, lifetime=timedelta(days=825)) is None
    found = due(data, NOW, lifetime=timedelta(days=90))
    assert found is not None and found.reason == "LifetimeChanged"
    assert "825 days, longer than the certificateLifetime of 90 days" in found.message
    assert due(issued(issuer, timedelta(days=30)), NOW, lifetime=timedelta(days=90)) is None  # shorter: kept


def test_certificates_of_another_ca_are_issued_again(issuer: dict[str, str]) -> None:
    other = secrets.generate_operator_data("other")
    data = issued(issuer)
    assert due(data, NOW, ca_cert=issuer["ca.crt"]) is None
    found = due(data, NOW, ca_cert=other["ca.crt"])
    assert found is not None and found.reason == "CAChanged"


def test_the_token_digest_and_the_ca_stay_across_a_renewal(issuer: dict[str, str]) -> None:
    first = issued(issuer)
    again = secrets.generate_agent_data(
        CLUSTER, NAMESPACE, issuer, now=NOW + timedelta(days=61), token_sha256=first["token.sha256"]
    )
    assert again["ca.crt"] == first["ca.crt"] and again["token.sha256"] == first["token.sha256"]
    assert again["tls.crt"] != first["tls.crt"] and again["replication.key"] != first["replication.key"]
    assert secrets.certificate_not_after(again["tls.crt"]) == NOW + timedelta(days=151)


def test_status_records_and_the_condition(issuer: dict[str, str]) -> None:
    data = issued(issuer)
    secret = {"metadata": {"name": "demo-agent"}, "data": encoded(data)}
    check = OwnedObjects._check("demo-agent", secret)
    assert check.records() == [
        {
            "name": "server",
            "secret": "demo-agent",
            "notAfter": "2027-02-25T12:00:00Z",
            "renewAt": "2027-01-26T11:58:20Z",
        },
        {
            "name": "replication",
            "secret": "demo-agent",
            "notAfter": "2027-02-25T12:00:00Z",
            "renewAt": "2027-01-26T11:58:20Z",
        },
    ]
    assert check.records() == secrets.certificate_records(data, "demo-agent")
    valid = certificates_valid(check, NOW)
    assert (valid.status, valid.reason) == (True, "Valid")
    assert valid.message == "valid until 2027-02-25T12:00:00Z; renewed at 2027-01-26T11:58:20Z"
    expired = certificates_valid(check, NOW + timedelta(days=91))
    assert (expired.status, expired.reason, expired.message) == (
        False,
        "Expired",
        "expired: server, replication",
    )
    failed = certificates_valid(
        CertificateCheck("demo-agent", check.expiry, check.renew_at, error="forbidden"), NOW
    )
    assert (failed.status, failed.reason, failed.message) == (False, "RenewalFailed", "forbidden")
    old = OwnedObjects._check("demo-agent", {"metadata": {}, "data": encoded({"tls.crt": data["tls.crt"]})})
    missing = certificates_valid(old, NOW)
    assert (missing.status, missing.reason, missing.message) == (
        False,
        "NotIssued",
        "not issued yet: replication",
    )
    assert secrets.CERTIFICATES["replication"] == names.KEY_REPLICATION_CERT
