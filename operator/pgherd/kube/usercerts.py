"""The user's own certificates (spec.tls.serverCertSecret, spec.tls.clientCASecret), read from the
Secrets cert-manager writes, and checked before any member gets them.

- The server certificate (`tls.crt`: the leaf, then its chain; `tls.key`; `ca.crt`: the root) is
  PostgreSQL's on every member in place of the cluster CA's. It must be readable, its key must be the
  certificate's, it must be valid now, chain up to a root in `ca.crt` (members verify each other, and
  clients the server, against it), and name every name clients reach the members by
  (`required_names`).
- The client CA (`tls.crt` and `tls.key` of a CA; `ca.crt`, the root above it, unless it is a root
  itself) is which client certificates PostgreSQL accepts, and the signer of the replication account's.

A Secret that fails a check is a `Problem` (CertificatesValid False and an Event, by the caller) and is
never installed: the members keep what they serve. Pure: no I/O, nothing logged; a key is never part
of a message.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from pgherd.kube import names

SERVER_FIELD = "spec.tls.serverCertSecret"
CLIENT_CA_FIELD = "spec.tls.clientCASecret"
# Keys whose certificates can sign the replication account's certificate and that PostgreSQL serves.
SIGNING_KEYS = (rsa.RSAPrivateKey, ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey)
# What reading a certificate someone else made may raise (a malformed or unsupported extension or key):
# reported as the Secret's problem, never a failed tick.
UNREADABLE = (
    ValueError,
    TypeError,
    UnsupportedAlgorithm,
    x509.DuplicateExtension,
    x509.UnsupportedGeneralNameType,
)
# A chain longer than this is not followed (a loop, or not a chain at all).
MAX_CHAIN = 8
NAMES_SHOWN = 8


@dataclass(frozen=True)
class Problem:
    """Why a Secret of the user's cannot be installed: `reason` (CamelCase, for the condition and the
    Event) and `message` (a sentence naming the Secret and the field, and what to do)."""

    secret: str
    reason: str
    message: str


@dataclass(frozen=True)
class ServerCertificate:
    """A server certificate that passed: PostgreSQL's files as the Secret holds them."""

    secret: str
    cert: str  # the leaf, then its chain
    key: str
    ca: str  # the root(s) the members and the clients verify it against
    serial: int
    not_after: datetime


@dataclass(frozen=True)
class ClientCA:
    """A client CA that passed: its certificate and key (to sign the replication certificate), and
    `roots`, PostgreSQL's ssl_ca_file (the CA, then its root when it is not one itself)."""

    secret: str
    cert: str
    key: str
    roots: str
    not_after: datetime


def required_names(cluster: str, namespace: str, instances: int) -> list[str]:
    """The names the user's server certificate must cover: what a client can resolve and reach the
    members by. The -rw, -ro and -r Services in the four spellings of the operator's own certificate,
    and each member under the headless Service in its three (a wildcard `*.<cluster>-headless.<ns>.svc`
    and its shorter forms cover every member, those added later too). A member's bare pod name, which
    the operator's certificate also holds, is no DNS name in Kubernetes and is not asked for."""
    found: list[str] = []
    for service in (names.service_rw(cluster), names.service_ro(cluster), names.service_r(cluster)):
        found += [service, f"{service}.{namespace}", f"{service}.{namespace}.svc"]
        found.append(f"{service}.{namespace}.svc.cluster.local")
    headless = names.service_headless(cluster)
    for ordinal in range(instances):
        member = names.member(cluster, ordinal)
        found += [
            f"{member}.{headless}.{namespace}.svc",
            f"{member}.{headless}.{namespace}",
            f"{member}.{headless}",
        ]
    return found


def covers(dns_names: Iterable[str], name: str) -> bool:
    """Whether a certificate's DNS names cover `name` as a client checks it: the same name (case
    aside), or a wildcard standing for its whole first label."""
    wanted = name.lower()
    _, _, parent = wanted.partition(".")
    for held in dns_names:
        held = held.lower()
        if held == wanted or (parent and held == f"*.{parent}"):
            return True
    return False


def check_server(
    secret_name: str,
    secret: Mapping[str, Any] | None,
    *,
    cluster: str,
    namespace: str,
    instances: int,
    now: datetime,
) -> ServerCertificate | Problem:
    """The server Secret as cert-manager writes it, checked (see the module's docstring)."""
    try:
        return _check_server(
            secret_name, secret, cluster=cluster, namespace=namespace, instances=instances, now=now
        )
    except UNREADABLE as exc:
        return _unreadable(secret_name, SERVER_FIELD, exc)


def check_client_ca(
    secret_name: str, secret: Mapping[str, Any] | None, *, namespace: str, now: datetime
) -> ClientCA | Problem:
    """The client CA Secret, as cert-manager writes it for a Certificate with `isCA: true`, checked."""
    try:
        return _check_client_ca(secret_name, secret, namespace=namespace, now=now)
    except UNREADABLE as exc:
        return _unreadable(secret_name, CLIENT_CA_FIELD, exc)


def _unreadable(secret_name: str, spec_field: str, exc: Exception) -> Problem:
    # cryptography's messages name what it could not parse, never a key's bytes.
    return Problem(secret_name, "Unreadable", f"Secret {secret_name} ({spec_field}) cannot be read: {exc}")


def _check_server(
    secret_name: str,
    secret: Mapping[str, Any] | None,
    *,
    cluster: str,
    namespace: str,
    instances: int,
    now: datetime,
) -> ServerCertificate | Problem:
    where = f"Secret {secret_name} ({SERVER_FIELD})"
    if secret is None:
        return Problem(
            secret_name,
            "SecretMissing",
            f"{where} does not exist in namespace {namespace}: the members serve the cluster CA's certificate"
            " until it does",
        )
    data = _values(secret, (names.KEY_TLS_CERT, names.KEY_TLS_KEY, names.KEY_CA_CERT))
    if isinstance(data, str):
        return Problem(secret_name, "Unreadable", f"{where}: {data}")
    missing = [key for key in (names.KEY_TLS_CERT, names.KEY_TLS_KEY, names.KEY_CA_CERT) if not data.get(key)]
    if missing:
        return Problem(
            secret_name,
            "KeysMissing",
            f"{where} lacks {', '.join(missing)}: it needs tls.crt, tls.key and ca.crt (the CA that signed"
            " it: cert-manager writes it for a CA Issuer)",
        )
    parsed = _certificates(data[names.KEY_TLS_CERT], names.KEY_TLS_CERT)
    roots = _certificates(data[names.KEY_CA_CERT], names.KEY_CA_CERT)
    key = _private_key(data[names.KEY_TLS_KEY])
    for found in (parsed, roots, key):
        if isinstance(found, str):
            return Problem(secret_name, "Unreadable", f"{where}: {found}")
    assert not isinstance(parsed, str) and not isinstance(roots, str) and not isinstance(key, str)
    leaf, chain = parsed[0], parsed[1:]
    if not _same_key(key, leaf):
        return Problem(
            secret_name, "KeyMismatch", f"{where}: tls.key is not the key of tls.crt (its first certificate)"
        )
    expiry = _validity_problem(leaf, now)
    if expiry is not None:
        return Problem(secret_name, "Expired", f"{where}: its certificate {expiry}")
    if not _chains_to_root(leaf, chain, roots):
        return Problem(
            secret_name,
            "NotSignedByCA",
            f"{where}: tls.crt does not chain up to a root CA in ca.crt, which members and clients verify it"
            " against (ca.crt must hold the root: a self-signed certificate)",
        )
    if not _serves(leaf):
        return Problem(
            secret_name,
            "UsageMissing",
            f"{where}: its extended key usage does not allow a TLS server (serverAuth)",
        )
    held = _dns_names(leaf)
    lacking = [name for name in required_names(cluster, namespace, instances) if not covers(held, name)]
    if lacking:
        more = f" and {len(lacking) - NAMES_SHOWN} more" if len(lacking) > NAMES_SHOWN else ""
        return Problem(
            secret_name,
            "NamesMissing",
            f"{where}: its certificate does not name {', '.join(lacking[:NAMES_SHOWN])}{more} (clients"
            " verify the name they connect to: docs/security.md lists the names)",
        )
    return ServerCertificate(
        secret_name,
        data[names.KEY_TLS_CERT],
        data[names.KEY_TLS_KEY],
        data[names.KEY_CA_CERT],
        leaf.serial_number,
        leaf.not_valid_after_utc,
    )


def _check_client_ca(
    secret_name: str, secret: Mapping[str, Any] | None, *, namespace: str, now: datetime
) -> ClientCA | Problem:
    where = f"Secret {secret_name} ({CLIENT_CA_FIELD})"
    if secret is None:
        return Problem(
            secret_name,
            "SecretMissing",
            f"{where} does not exist in namespace {namespace}: the replication certificate stays as it is"
            " until it does",
        )
    data = _values(secret, (names.KEY_TLS_CERT, names.KEY_TLS_KEY, names.KEY_CA_CERT))
    if isinstance(data, str):
        return Problem(secret_name, "Unreadable", f"{where}: {data}")
    missing = [key for key in (names.KEY_TLS_CERT, names.KEY_TLS_KEY) if not data.get(key)]
    if missing:
        return Problem(
            secret_name,
            "KeysMissing",
            f"{where} lacks {', '.join(missing)}: pgherd signs the replication account's client certificate"
            " with the CA's key (a cert-manager Certificate with isCA: true writes tls.crt and tls.key)",
        )
    parsed = _certificates(data[names.KEY_TLS_CERT], names.KEY_TLS_CERT)
    above = _certificates(data[names.KEY_CA_CERT], names.KEY_CA_CERT) if data.get(names.KEY_CA_CERT) else []
    key = _private_key(data[names.KEY_TLS_KEY])
    for found in (parsed, above, key):
        if isinstance(found, str):
            return Problem(secret_name, "Unreadable", f"{where}: {found}")
    assert not isinstance(parsed, str) and not isinstance(above, str) and not isinstance(key, str)
    ca, chain = parsed[0], parsed[1:]
    if not _same_key(key, ca):
        return Problem(secret_name, "KeyMismatch", f"{where}: tls.key is not the key of tls.crt")
    if not isinstance(key, SIGNING_KEYS):
        return Problem(
            secret_name,
            "Unreadable",
            f"{where}: its key is of a kind pgherd cannot sign with (RSA, ECDSA or Ed25519)",
        )
    if not _is_ca(ca):
        return Problem(
            secret_name,
            "NotACA",
            f"{where}: tls.crt is not a CA certificate (basicConstraints CA, keyCertSign): make it with"
            " isCA: true",
        )
    expiry = _validity_problem(ca, now)
    if expiry is not None:
        return Problem(secret_name, "Expired", f"{where}: the CA {expiry}")
    if not _chains_to_root(ca, chain, [*above, *parsed]):  # a self-signed CA is its own root
        return Problem(
            secret_name,
            "NotSignedByCA",
            f"{where}: tls.crt is not a root and ca.crt does not hold the root above it, which PostgreSQL"
            " needs to verify the replication certificate",
        )
    own = [ca, *chain]
    trusted = own + [c for c in above if c not in own]
    return ClientCA(
        secret_name,
        _pem(ca),
        data[names.KEY_TLS_KEY],
        "".join(_pem(c) for c in trusted),
        ca.not_valid_after_utc,
    )


# -- reading ------------------------------------------------------------------------------------------


def _values(secret: Mapping[str, Any], keys: Sequence[str]) -> dict[str, str] | str:
    """The Secret's `keys` as text (others, such as cert-manager's binary keystores, never decoded),
    or what is wrong."""
    data = secret.get("data") or {}
    found: dict[str, str] = {}
    for key in keys:
        raw = data.get(key) if isinstance(data, Mapping) else None
        if raw is None:
            continue
        try:
            found[key] = base64.b64decode(str(raw), validate=True).decode("ascii")
        except (binascii.Error, UnicodeDecodeError):
            return f"{key} is not PEM text"
    return found


def _certificates(pem: str, key: str) -> list[x509.Certificate] | str:
    try:
        found = x509.load_pem_x509_certificates(pem.encode())
    except ValueError:
        return f"{key} holds no PEM certificate that can be read"
    return found or f"{key} holds no certificate"


def _private_key(pem: str) -> Any:
    try:
        return serialization.load_pem_private_key(pem.encode(), password=None)
    except TypeError:
        return "tls.key is encrypted: PostgreSQL needs it unencrypted (as cert-manager writes it)"
    except (ValueError, UnsupportedAlgorithm):
        return "tls.key holds no PEM private key that can be read"


def _pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def _public(item: Any) -> bytes:
    return bytes(
        item.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def _same_key(key: Any, cert: x509.Certificate) -> bool:
    try:
        return _public(key) == _public(cert)
    except (AttributeError, ValueError, TypeError):
        return False


def _validity_problem(cert: x509.Certificate, now: datetime) -> str | None:
    if cert.not_valid_after_utc <= now:
        return f"expired at {cert.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}"
    if cert.not_valid_before_utc > now:
        return f"is not valid before {cert.not_valid_before_utc:%Y-%m-%dT%H:%M:%SZ}"
    return None


def issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """Whether `ca` signed `cert` (its name and its signature)."""
    if cert.issuer != ca.subject:
        return False
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
        return False
    return True


def _self_signed(cert: x509.Certificate) -> bool:
    return issued_by(cert, cert)


def _chains_to_root(
    cert: x509.Certificate, chain: Sequence[x509.Certificate], roots: Sequence[x509.Certificate]
) -> bool:
    """Whether `cert` leads, through certificates of `chain` or `roots`, to a self-signed one in
    `roots` (OpenSSL, in libpq and PostgreSQL, verifies up to a root)."""
    pool = [*chain, *roots]
    current = cert
    for _ in range(MAX_CHAIN):
        if _self_signed(current):
            return current in roots
        issuer = next((c for c in pool if c != current and issued_by(current, c)), None)
        if issuer is None:
            return False
        current = issuer
    return False


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return False
    if not constraints.ca:
        return False
    try:
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return True
    return bool(usage.key_cert_sign)


def _serves(cert: x509.Certificate) -> bool:
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return True  # no extended key usage: any (cert-manager's default)
    return ExtendedKeyUsageOID.SERVER_AUTH in usages or ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE in usages


def _dns_names(cert: x509.Certificate) -> list[str]:
    try:
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return list(alt.get_values_for_type(x509.DNSName))
