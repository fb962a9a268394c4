"""The cluster's Secrets: passwords, the agent's TLS material and the operator's credentials.

Two halves. `generate_*` make new random values (secrets.token_urlsafe, new keys and certificates):
the only impure functions of the builders, called when a Secret is missing or its certificates are due.
The builders (`*_secret`) take that data and return the Secret object. The adapter creates a Secret
only when it is missing; the only values it ever replaces are the certificates of the agents' Secret
(`agent_certificate_due`) and PostgreSQL's files in it (`postgres_tls_data`: the user's certificates),
and the app Secret's CA, which follows PostgreSQL's (its password kept). The values live in the Secrets alone, never in logs, events, status, labels or annotations.
Every Secret carries its values base64-encoded in `data` (never `stringData`): what is written is what
is read back, by the API server.

Trust between the operator and the agents: the operator's Secret holds the bearer token and the
cluster CA's key and is mounted in no pod; the agent's Secret, mounted in every member, holds the
token's digest only (a compromised pod cannot call the other members' agents), the CA certificate,
one server certificate for all members (the agent's HTTPS port, and PostgreSQL's unless the user brings
theirs: every member by its headless name and pod name, and the -rw, -ro and -r Services) and the
replication account's client certificate, by which members replicate and snapshot Jobs read.
PostgreSQL's files have keys of their own (`POSTGRES_KEYS`): copies of the agent's certificate and
the cluster CA, or the user's certificate and CAs (spec.tls.serverCertSecret, clientCASecret; the
replication certificate is then signed by the user's client CA).
"""

from __future__ import annotations

import base64
import functools
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import quote

from cryptography import x509

from pgherd.api.annotations import ROTATE_CERTIFICATES
from pgherd.api.cluster import MAX_INSTANCES, Tls
from pgherd.kube import names
from pgherd.kube.builders.common import ClusterRef, Manifest, app_account, metadata
from pgherd.kube.usercerts import ClientCA, issued_by
from pgherd_backup.agent.auth import token_digest
from pgherd_backup.agent.tls import (
    certificate_facts,
    make_ca,
    make_client_cert,
    make_server_cert,
)

DEFAULT_LIFETIME = Tls().lifetime

# A certificate is issued again once this share of its lifetime has passed (a third of it left: 30 days
# of the default 90), time enough for a failed renewal to be seen (an alert, a condition) and fixed.
# A certificate valid this much longer than spec.tls.certificateLifetime asks is issued again (a lifetime
# made shorter; the 825-day certificates of before): the start's 5 minutes back are not a difference.
LIFETIME_SLACK = timedelta(hours=1)

# 32 random bytes: 256 bits, 43 URL-safe characters (no quoting needed in a URI or a pgpass line).
RANDOM_BYTES = 32

APP_KEYS = (
    names.KEY_USERNAME,
    names.KEY_PASSWORD,
    names.KEY_DBNAME,
    names.KEY_HOST,
    names.KEY_PORT,
    names.KEY_URI,
    names.KEY_CA_CERT,
)
ACCOUNT_KEYS = (names.KEY_USERNAME, names.KEY_PASSWORD)
# What the operator issues into the agents' Secret (and renews: `agent_certificate_due`).
ISSUED_KEYS = (
    names.KEY_TLS_CERT,
    names.KEY_TLS_KEY,
    names.KEY_CA_CERT,
    names.KEY_TOKEN_DIGEST,
    names.KEY_REPLICATION_CERT,
    names.KEY_REPLICATION_KEY,
)
# PostgreSQL's TLS files (`postgres_tls_data`): the operator's own, or the user's.
POSTGRES_KEYS = (names.KEY_POSTGRES_CERT, names.KEY_POSTGRES_KEY, names.KEY_POSTGRES_CA, names.KEY_CLIENT_CA)
AGENT_KEYS = ISSUED_KEYS + POSTGRES_KEYS
OPERATOR_KEYS = (names.KEY_TOKEN, names.KEY_CA_CERT, names.KEY_CA_KEY)
# The certificates pgherd issues into the agents' Secret, by the name status.certificates and the
# metrics give them: the members' server certificate and the replication account's client certificate.
CERTIFICATES = {"server": names.KEY_TLS_CERT, "replication": names.KEY_REPLICATION_CERT}


# --- random values (impure) ----------------------------------------------------------------------------


def generate_password() -> str:
    return secrets.token_urlsafe(RANDOM_BYTES)


def generate_token() -> str:
    return secrets.token_urlsafe(RANDOM_BYTES)


def generate_superuser_data() -> dict[str, str]:
    return {names.KEY_USERNAME: names.SUPERUSER, names.KEY_PASSWORD: generate_password()}


def generate_replication_data() -> dict[str, str]:
    return {names.KEY_USERNAME: names.REPLICATION_USER, names.KEY_PASSWORD: generate_password()}


def generate_app_data(ref: ClusterRef, ca_cert: str) -> dict[str, str]:
    return app_data(ref, generate_password(), ca_cert)


def generate_operator_data(cluster: str) -> dict[str, str]:
    """A new bearer token and a new cluster CA (ECDSA P-256, 10 years)."""
    ca_cert, ca_key = make_ca(cluster)
    return {
        names.KEY_TOKEN: generate_token(),
        names.KEY_CA_CERT: ca_cert.decode(),
        names.KEY_CA_KEY: ca_key.decode(),
    }


def generate_agent_data(
    cluster: str,
    namespace: str,
    operator_data: Mapping[str, str],
    *,
    lifetime: timedelta = DEFAULT_LIFETIME,
    now: datetime | None = None,
    token_sha256: str | None = None,
    client_ca: ClientCA | None = None,
) -> dict[str, str]:
    """The members' half, derived from the operator's Secret data: a server certificate signed by the
    cluster CA for `agent_server_names` and its key, the replication account's client certificate and
    key (signed by the user's `client_ca` when given, within its validity), both valid for `lifetime`
    from `now`; the CA certificate and the token's digest (`token_sha256`: the one a renewal keeps);
    PostgreSQL's files as `postgres_tls_data` makes them without the user's certificates."""
    ca_cert, ca_key = operator_data[names.KEY_CA_CERT], operator_data[names.KEY_CA_KEY]
    first, *others = agent_server_names(cluster, namespace)
    cert, key = make_server_cert(
        ca_cert.encode(), ca_key.encode(), first, dns=others, lifetime=lifetime, now=now
    )
    signer, signer_key, client_lifetime = ca_cert, ca_key, lifetime
    if client_ca is not None:
        signer, signer_key = client_ca.cert, client_ca.key
        client_lifetime = min(lifetime, client_ca.not_after - (now or datetime.now(UTC)))
    client_cert, client_key = make_client_cert(
        signer.encode(), signer_key.encode(), names.REPLICATION_USER, lifetime=client_lifetime, now=now
    )
    issued = {
        names.KEY_TLS_CERT: cert.decode(),
        names.KEY_TLS_KEY: key.decode(),
        names.KEY_CA_CERT: ca_cert,
        names.KEY_TOKEN_DIGEST: token_sha256 or token_digest(operator_data[names.KEY_TOKEN]),
        names.KEY_REPLICATION_CERT: client_cert.decode(),
        names.KEY_REPLICATION_KEY: client_key.decode(),
    }
    return {**issued, **postgres_tls_data(issued, client_ca=None if client_ca is None else client_ca.roots)}


def postgres_tls_data(
    agent_data: Mapping[str, str],
    *,
    server: tuple[str, str, str] | None = None,
    client_ca: str | None = None,
) -> dict[str, str]:
    """PostgreSQL's files in the agents' Secret: `server` (certificate with its chain, key, CA: the
    user's) or the agent's own certificate and the cluster CA; `client_ca` (the CAs whose client
    certificates it accepts: the user's) or the cluster CA."""
    cert, key, ca = server or (
        agent_data[names.KEY_TLS_CERT],
        agent_data[names.KEY_TLS_KEY],
        agent_data[names.KEY_CA_CERT],
    )
    return {
        names.KEY_POSTGRES_CERT: cert,
        names.KEY_POSTGRES_KEY: key,
        names.KEY_POSTGRES_CA: ca,
        names.KEY_CLIENT_CA: client_ca or agent_data[names.KEY_CA_CERT],
    }


# --- names and derived values (pure) -------------------------------------------------------------------


def agent_server_names(cluster: str, namespace: str) -> list[str]:
    """The DNS names of the members' shared server certificate (`make_server_cert` adds `localhost` and
    127.0.0.1): every member under the headless Service in its three spellings, the -rw, -ro and -r
    Services in their four (a client's verify-full through a Service), and every member's pod name,
    ordinals 0 to 14 (members added later need no new certificate)."""
    headless = names.service_headless(cluster)
    found = [f"*.{headless}.{namespace}.svc", f"*.{headless}.{namespace}", f"*.{headless}"]
    for service in (names.service_rw(cluster), names.service_ro(cluster), names.service_r(cluster)):
        found += [service, f"{service}.{namespace}", f"{service}.{namespace}.svc"]
        found.append(f"{service}.{namespace}.svc.cluster.local")
    found += [names.member(cluster, ordinal) for ordinal in range(MAX_INSTANCES)]
    return found


def agent_server_hostname(cluster: str, member: str, namespace: str) -> str:
    """The name the operator verifies a member's certificate against when it connects to the pod IP
    (AgentClient's `server_hostname`): the member's headless DNS name, `<member>.<cluster>-headless.
    <namespace>.svc`, which the certificate's first wildcard covers. It ties the answer to this
    cluster's CA and this cluster's headless Service; the pod IP itself is never in a certificate."""
    return names.member_host(cluster, member, namespace)


# One entry per cluster, asked for at every tick: smaller than the clusters, it evicts each entry before
# its next use (a round robin: 1,024 made every tick of 2,000 clusters verify a signature).
@functools.lru_cache(maxsize=8192)
def signed_by(cert_pem: str, ca_pem: str) -> bool:
    """Whether the first certificate of `ca_pem` signed the first of `cert_pem`."""
    try:
        cert = x509.load_pem_x509_certificates(cert_pem.encode())[0]
        ca = x509.load_pem_x509_certificates(ca_pem.encode())[0]
    except (ValueError, IndexError):
        return False
    return issued_by(cert, ca)


def certificate_not_after(pem: str) -> datetime:
    """When a PEM certificate expires (UTC)."""
    return certificate_facts(pem).not_after


@dataclass(frozen=True)
class Renewal:
    """Why the agents' certificates must be issued again: `reason` (a CamelCase word for Events and
    conditions) and `message` (what a person reads)."""

    reason: str
    message: str


def agent_certificate_due(
    agent_data: Mapping[str, str],
    now: datetime,
    *,
    cluster: str,
    namespace: str,
    lifetime: timedelta = DEFAULT_LIFETIME,
    ca_cert: str | None = None,
    client_ca_cert: str | None = None,
    hold_replication: bool = False,
    requested: str | None = None,
    renewed_for: str | None = None,
) -> Renewal | None:
    """Whether the agents' certificates must be issued again (`generate_agent_data`), and why: a key or
    a name missing (a Secret made before them: the cluster moves to TLS), not signed by the cluster's
    CA (`ca_cert`), the replication certificate not signed by the CA PostgreSQL takes client
    certificates from (`client_ca_cert`: the user's, else `ca_cert`), valid longer than `lifetime` asks,
    two thirds of a certificate's lifetime passed by `now`, or the cluster's
    pgherd.io/rotate-certificates at a value (`requested`) the certificates were not issued for
    (`renewed_for`). `hold_replication`: the replication certificate is left out (the user's client CA
    cannot sign one now). None: nothing to do. The only reason the adapter issues certificates again;
    the members reload what they get without a restart."""
    missing = [key for key in ISSUED_KEYS if not agent_data.get(key)]
    if missing:
        return Renewal("KeysMissing", f"the Secret lacks {', '.join(missing)}")
    if ca_cert is not None and agent_data[names.KEY_CA_CERT].strip() != ca_cert.strip():
        return Renewal("CAChanged", "its certificates were not issued by the cluster's CA")
    try:
        server = certificate_facts(agent_data[names.KEY_TLS_CERT])
        client = certificate_facts(agent_data[names.KEY_REPLICATION_CERT])
    except ValueError as exc:
        return Renewal("Unreadable", f"a certificate of the Secret cannot be read: {exc}")
    lacking = [n for n in agent_server_names(cluster, namespace) if n not in server.dns_names]
    if lacking:
        more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
        return Renewal("NamesMissing", f"the server certificate does not name {', '.join(lacking[:3])}{more}")
    if not hold_replication:
        if client.common_name != names.REPLICATION_USER:
            return Renewal("NamesMissing", f"the replication certificate is not for {names.REPLICATION_USER}")
        signer = client_ca_cert or ca_cert
        if signer is not None and not signed_by(agent_data[names.KEY_REPLICATION_CERT], signer):
            return Renewal(
                "ClientCAChanged",
                "the replication certificate is not signed by the CA PostgreSQL accepts client"
                " certificates from",
            )
    if requested is not None and requested != renewed_for:
        return Renewal("Requested", f"asked for by {ROTATE_CERTIFICATES}={requested}")
    checked = [("server", server)] if hold_replication else [("server", server), ("replication", client)]
    for name, facts in checked:
        if facts.lifetime > lifetime + LIFETIME_SLACK:
            return Renewal(
                "LifetimeChanged",
                f"the {name} certificate is valid for {_days(facts.lifetime)}, longer than the"
                f" certificateLifetime of {_days(lifetime)}",
            )
        if now >= facts.renew_at:
            return Renewal(
                "Due",
                f"two thirds of the {name} certificate's lifetime have passed (it expires at"
                f" {format_time(facts.not_after)})",
            )
    return None


def certificate_records(agent_data: Mapping[str, str], secret: str) -> list[dict[str, str | None]]:
    """status.certificates: each certificate of the agents' Secret, when it expires and is renewed."""
    records: list[dict[str, str | None]] = []
    for name, key in CERTIFICATES.items():
        pem = agent_data.get(key)
        try:
            facts = certificate_facts(pem) if pem else None
        except ValueError:
            facts = None
        records.append(
            {
                "name": name,
                "secret": secret,
                "notAfter": None if facts is None else format_time(facts.not_after),
                "renewAt": None if facts is None else format_time(facts.renew_at),
            }
        )
    return records


def format_time(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _days(value: timedelta) -> str:
    hours = value.total_seconds() / 3600
    return f"{round(hours / 24)} days" if hours >= 48 else f"{round(hours)} hours"


def app_host(ref: ClusterRef) -> str:
    return f"{names.service_rw(ref.name)}.{ref.namespace}.svc"


def app_uri(user: str, password: str, host: str, port: int, database: str) -> str:
    """`postgresql://user:password@host:port/database?sslmode=verify-full`, user, password and database
    percent-encoded (a password may hold @ : / % and the URI must still parse). verify-full: the client
    checks the server's certificate against the CA (the Secret's `ca.crt`, given as sslrootcert or
    PGSSLROOTCERT) and the host name, which the members' certificate carries."""
    credentials = f"{quote(user, safe='')}:{quote(password, safe='')}"
    return f"postgresql://{credentials}@{host}:{port}/{quote(database, safe='')}?sslmode=verify-full"


def app_data(ref: ClusterRef, password: str, ca_cert: str) -> dict[str, str]:
    """The application Secret's keys for `password`: what a client needs to connect through `-rw` and
    verify the server (`ca.crt`, the cluster's CA)."""
    user, database = app_account(ref)
    host = app_host(ref)
    return {
        names.KEY_USERNAME: user,
        names.KEY_PASSWORD: password,
        names.KEY_DBNAME: database,
        names.KEY_HOST: host,
        names.KEY_PORT: str(names.POSTGRES_PORT),
        names.KEY_URI: app_uri(user, password, host, names.POSTGRES_PORT, database),
        names.KEY_CA_CERT: ca_cert,
    }


def app_data_upgraded(ref: ClusterRef, data: Mapping[str, str], ca_cert: str) -> dict[str, str] | None:
    """The app Secret of a cluster made before TLS (no `ca.crt`, a URI without sslmode) with the CA and
    a verify-full URI, its password kept; None when it has them already."""
    if data.get(names.KEY_CA_CERT) and "sslmode=" in data.get(names.KEY_URI, ""):
        return None
    password = data.get(names.KEY_PASSWORD)
    if not password:
        return None
    return {**data, **app_data(ref, password, ca_cert)}


# --- the Secret objects (pure) ------------------------------------------------------------------------


def _secret(
    ref: ClusterRef, name: str, data: Mapping[str, str], keys: Sequence[str], kind: str = "Opaque"
) -> Manifest:
    missing = [key for key in keys if not data.get(key)]
    if missing:
        raise ValueError(f"Secret {name}: no value for {', '.join(missing)}")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(ref, name, names.COMPONENT_POSTGRES),
        "type": kind,
        "data": {key: base64.b64encode(data[key].encode()).decode() for key in keys},
    }


def superuser_secret(ref: ClusterRef, data: Mapping[str, str]) -> Manifest:
    """`<cluster>-superuser`: username postgres, password."""
    return _secret(ref, names.secret_superuser(ref.name), data, ACCOUNT_KEYS)


def replication_secret(ref: ClusterRef, data: Mapping[str, str]) -> Manifest:
    """`<cluster>-replication`: username streaming_replica, password (members and snapshot Jobs)."""
    return _secret(ref, names.secret_replication(ref.name), data, ACCOUNT_KEYS)


def app_secret(ref: ClusterRef, data: Mapping[str, str]) -> Manifest:
    """`<cluster>-app`: username, password, dbname, host, port, uri and ca.crt, for the application's
    pods."""
    return _secret(ref, names.secret_app(ref.name), data, APP_KEYS)


def agent_secret(ref: ClusterRef, data: Mapping[str, str], *, rotated_for: str | None = None) -> Manifest:
    """`<cluster>-agent`, mounted in every member: type kubernetes.io/tls (tls.crt, tls.key) plus the CA
    certificate, the token's digest and the replication client certificate (replication.crt, .key).
    `rotated_for`: the cluster's pgherd.io/rotate-certificates these certificates were issued for, kept
    in an annotation (not a secret)."""
    secret = _secret(ref, names.secret_agent(ref.name), data, AGENT_KEYS, "kubernetes.io/tls")
    if rotated_for is not None:
        secret["metadata"]["annotations"] = {names.ANNOTATION_ROTATED_FOR: rotated_for}
    return secret


def operator_secret(ref: ClusterRef, data: Mapping[str, str]) -> Manifest:
    """`<cluster>-operator`, read by the operator alone and mounted in no pod: the bearer token and the
    cluster CA with its key (to issue the agents' certificate again)."""
    return _secret(ref, names.secret_operator(ref.name), data, OPERATOR_KEYS)


def secret_values(secret: Mapping[str, object]) -> dict[str, str]:
    """A Secret's values as text (its `data`, decoded; `stringData` of an object not yet stored wins)."""
    values: dict[str, str] = {}
    data = secret.get("data") or {}
    if isinstance(data, Mapping):
        values.update({str(k): base64.b64decode(str(v)).decode() for k, v in data.items()})
    string_data = secret.get("stringData") or {}
    if isinstance(string_data, Mapping):
        values.update({str(k): str(v) for k, v in string_data.items()})
    return values
