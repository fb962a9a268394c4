"""The cluster's Secrets: passwords, the agent's TLS material and the operator's credentials.

Two halves. `generate_*` make new random values (secrets.token_urlsafe, new keys and certificates):
the only impure functions of the builders, called only when a Secret is missing. The builders
(`*_secret`) take that data and return the Secret object. The adapter creates a Secret only when it is
missing and never overwrites one: the values live in the Secret alone, never in logs, events, status,
labels or annotations. Every Secret carries its values base64-encoded in `data` (never `stringData`):
what is written is what is read back, by the API server.

Trust between the operator and the agents: the operator's Secret holds the bearer token and the
cluster CA's key and is mounted in no pod; the agent's Secret, mounted in every member, holds the
token's digest only (a compromised pod cannot call the other members' agents), the CA certificate
and one server certificate for all members, valid for `*.<cluster>-headless.<namespace>.svc`.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from urllib.parse import quote

from cryptography import x509

from pgherd.kube import names
from pgherd.kube.builders.common import ClusterRef, Manifest, app_account, metadata
from pgherd_backup.agent.auth import token_digest
from pgherd_backup.agent.tls import make_ca, make_server_cert

# Renew the agents' certificate (825 days) this long before it expires: the operator would otherwise
# refuse every member at once on that day.
RENEW_BEFORE = timedelta(days=30)

# 32 random bytes: 256 bits, 43 URL-safe characters (no quoting needed in a URI or a pgpass line).
RANDOM_BYTES = 32

APP_KEYS = (
    names.KEY_USERNAME,
    names.KEY_PASSWORD,
    names.KEY_DBNAME,
    names.KEY_HOST,
    names.KEY_PORT,
    names.KEY_URI,
)
ACCOUNT_KEYS = (names.KEY_USERNAME, names.KEY_PASSWORD)
AGENT_KEYS = (names.KEY_TLS_CERT, names.KEY_TLS_KEY, names.KEY_CA_CERT, names.KEY_TOKEN_DIGEST)
OPERATOR_KEYS = (names.KEY_TOKEN, names.KEY_CA_CERT, names.KEY_CA_KEY)


# --- random values (impure) ----------------------------------------------------------------------------


def generate_password() -> str:
    return secrets.token_urlsafe(RANDOM_BYTES)


def generate_token() -> str:
    return secrets.token_urlsafe(RANDOM_BYTES)


def generate_superuser_data() -> dict[str, str]:
    return {names.KEY_USERNAME: names.SUPERUSER, names.KEY_PASSWORD: generate_password()}


def generate_replication_data() -> dict[str, str]:
    return {names.KEY_USERNAME: names.REPLICATION_USER, names.KEY_PASSWORD: generate_password()}


def generate_app_data(ref: ClusterRef) -> dict[str, str]:
    return app_data(ref, generate_password())


def generate_operator_data(cluster: str) -> dict[str, str]:
    """A new bearer token and a new cluster CA (ECDSA P-256, 10 years)."""
    ca_cert, ca_key = make_ca(cluster)
    return {
        names.KEY_TOKEN: generate_token(),
        names.KEY_CA_CERT: ca_cert.decode(),
        names.KEY_CA_KEY: ca_key.decode(),
    }


def generate_agent_data(cluster: str, namespace: str, operator_data: Mapping[str, str]) -> dict[str, str]:
    """The members' half, derived from the operator's Secret data: a server certificate signed by the
    cluster CA for `agent_server_names`, its key, the CA certificate and the token's digest."""
    ca_cert, ca_key = operator_data[names.KEY_CA_CERT], operator_data[names.KEY_CA_KEY]
    first, *others = agent_server_names(cluster, namespace)
    cert, key = make_server_cert(ca_cert.encode(), ca_key.encode(), first, dns=others)
    return {
        names.KEY_TLS_CERT: cert.decode(),
        names.KEY_TLS_KEY: key.decode(),
        names.KEY_CA_CERT: ca_cert,
        names.KEY_TOKEN_DIGEST: token_digest(operator_data[names.KEY_TOKEN]),
    }


# --- names and derived values (pure) -------------------------------------------------------------------


def agent_server_names(cluster: str, namespace: str) -> list[str]:
    """The DNS names of the members' shared server certificate: every member under the headless
    Service, in its three spellings (`make_server_cert` adds `localhost` and 127.0.0.1)."""
    headless = names.service_headless(cluster)
    return [f"*.{headless}.{namespace}.svc", f"*.{headless}.{namespace}", f"*.{headless}"]


def agent_server_hostname(cluster: str, member: str, namespace: str) -> str:
    """The name the operator verifies a member's certificate against when it connects to the pod IP
    (AgentClient's `server_hostname`): the member's headless DNS name, `<member>.<cluster>-headless.
    <namespace>.svc`, which the certificate's first wildcard covers. It ties the answer to this
    cluster's CA and this cluster's headless Service; the pod IP itself is never in a certificate."""
    return names.member_host(cluster, member, namespace)


def certificate_not_after(pem: str) -> datetime:
    """When a PEM certificate expires (UTC)."""
    return x509.load_pem_x509_certificate(pem.encode()).not_valid_after_utc


def agent_certificate_due(agent_data: Mapping[str, str], now: datetime) -> bool:
    """Whether the agents' certificate must be issued again (`generate_agent_data`) by `now`: the only
    case where the adapter replaces a Secret's value. The members read it at their next start."""
    return certificate_not_after(agent_data[names.KEY_TLS_CERT]) - RENEW_BEFORE <= now


def app_host(ref: ClusterRef) -> str:
    return f"{names.service_rw(ref.name)}.{ref.namespace}.svc"


def app_uri(user: str, password: str, host: str, port: int, database: str) -> str:
    """`postgresql://user:password@host:port/database`, user, password and database percent-encoded
    (a password may hold @ : / % and the URI must still parse)."""
    credentials = f"{quote(user, safe='')}:{quote(password, safe='')}"
    return f"postgresql://{credentials}@{host}:{port}/{quote(database, safe='')}"


def app_data(ref: ClusterRef, password: str) -> dict[str, str]:
    """The application Secret's keys for `password`: what a client needs to connect through `-rw`."""
    user, database = app_account(ref)
    host = app_host(ref)
    return {
        names.KEY_USERNAME: user,
        names.KEY_PASSWORD: password,
        names.KEY_DBNAME: database,
        names.KEY_HOST: host,
        names.KEY_PORT: str(names.POSTGRES_PORT),
        names.KEY_URI: app_uri(user, password, host, names.POSTGRES_PORT, database),
    }


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
    """`<cluster>-app`: username, password, dbname, host, port and uri, for the application's pods."""
    return _secret(ref, names.secret_app(ref.name), data, APP_KEYS)


def agent_secret(ref: ClusterRef, data: Mapping[str, str]) -> Manifest:
    """`<cluster>-agent`, mounted in every member: type kubernetes.io/tls (tls.crt, tls.key) plus the CA
    certificate and the token's digest."""
    return _secret(ref, names.secret_agent(ref.name), data, AGENT_KEYS, "kubernetes.io/tls")


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
