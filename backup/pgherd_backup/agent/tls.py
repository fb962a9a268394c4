"""The agent's TLS: a per-cluster CA, one server certificate per member, and the SSL contexts.

The CA signs only its cluster's agents, so an operator trusting one cluster's CA cannot be answered by
another cluster's member. Keys are ECDSA P-256: small, and made in milliseconds.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import ipaddress
import logging
import os
import ssl
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger("pgherd.agent")

CA_DAYS = 3650
SERVER_DAYS = 825  # the longest validity clients commonly accept for a server certificate


def write_private(path: Path, data: bytes) -> None:
    """Write `data` readable by its owner only (0600), atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


# A certificate is issued again once two thirds of its lifetime have passed (on Kubernetes and in the
# sandbox alike): the last third is the time the new one has to reach every member.
RENEW_AFTER = 2 / 3


@dataclass(frozen=True)
class CertificateFacts:
    not_before: datetime.datetime
    not_after: datetime.datetime
    common_name: str
    dns_names: frozenset[str]

    @property
    def lifetime(self) -> datetime.timedelta:
        return self.not_after - self.not_before

    @property
    def renew_at(self) -> datetime.datetime:
        """When two thirds of its lifetime have passed."""
        return self.not_before + self.lifetime * RENEW_AFTER


# Two certificates per cluster, asked for at every tick of each: a cache smaller than that would evict
# every entry before its next use (a round robin) and parse each again at each tick. Room for 8,192 clusters.
@functools.lru_cache(maxsize=16384)
def certificate_facts(pem: str) -> CertificateFacts:
    """What the renewal rule reads of a PEM certificate (parsed once per certificate: every tick asks)."""
    cert = x509.load_pem_x509_certificate(pem.encode())
    common = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    try:
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = frozenset(alt.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        dns = frozenset()
    return CertificateFacts(
        cert.not_valid_before_utc,
        cert.not_valid_after_utc,
        str(common[0].value) if common else "",
        dns,
    )


def _validity(
    now: datetime.datetime | None, lifetime: datetime.timedelta | None, days: int
) -> tuple[datetime.datetime, datetime.datetime]:
    start = now or _now()
    return start - datetime.timedelta(minutes=5), start + (lifetime or datetime.timedelta(days=days))


# X.509 caps a common name at 64 characters; a member's DNS name in a long namespace is longer. Clients
# check the subject alternative names (which hold every name in full), never the common name.
_COMMON_NAME_MAX = 64


def _common_name(text: str) -> str:
    return text[:_COMMON_NAME_MAX]


def make_ca(cluster: str, *, days: int = CA_DAYS) -> tuple[bytes, bytes]:
    """A new CA for `cluster`: (certificate PEM, private key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pgherd"),
            x509.NameAttribute(NameOID.COMMON_NAME, _common_name(f"pgherd agents of {cluster}")),
        ]
    )
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def server_names(
    member: str, *, ips: Iterable[str] = (), dns: Iterable[str] = (), headless_service: str | None = None
) -> tuple[list[str], list[str]]:
    """The names a member's certificate carries: (DNS names, IP addresses). Always the member name,
    localhost and 127.0.0.1 (the sandbox, and a probe from inside the pod); with a headless Service
    `<member>.<service>` (and `.svc` forms when the service is given as `<service>.<namespace>`)."""
    names = [member, "localhost"]
    if headless_service:
        names.append(f"{member}.{headless_service}")
        if "." in headless_service:
            names.append(f"{member}.{headless_service}.svc")
    names.extend(dns)
    addresses = ["127.0.0.1", *ips]
    return list(dict.fromkeys(names)), list(dict.fromkeys(addresses))


def make_server_cert(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    member: str,
    *,
    ips: Iterable[str] = (),
    dns: Iterable[str] = (),
    headless_service: str | None = None,
    days: int = SERVER_DAYS,
    lifetime: datetime.timedelta | None = None,
    now: datetime.datetime | None = None,
) -> tuple[bytes, bytes]:
    """A server certificate for `member`, signed by the cluster CA: (certificate PEM, key PEM), valid
    from `now` (5 minutes before, for clocks a little behind) for `lifetime` (else `days`)."""
    dns_names, addresses = server_names(member, ips=ips, dns=dns, headless_service=headless_service)
    alt_names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    alt_names += [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    return _signed_leaf(
        ca_cert_pem,
        ca_key_pem,
        _common_name(member),
        ExtendedKeyUsageOID.SERVER_AUTH,
        _validity(now, lifetime, days),
        x509.SubjectAlternativeName(alt_names),
    )


def make_client_cert(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    user: str,
    *,
    days: int = SERVER_DAYS,
    lifetime: datetime.timedelta | None = None,
    now: datetime.datetime | None = None,
) -> tuple[bytes, bytes]:
    """A client certificate for the PostgreSQL role `user` (its common name: what pg_hba's `cert`
    method matches), signed by the cluster CA: (certificate PEM, key PEM); validity as
    `make_server_cert`'s."""
    if len(user) > _COMMON_NAME_MAX:
        raise ValueError(f"a client certificate's user name is at most {_COMMON_NAME_MAX} characters")
    return _signed_leaf(
        ca_cert_pem, ca_key_pem, user, ExtendedKeyUsageOID.CLIENT_AUTH, _validity(now, lifetime, days)
    )


def _signed_leaf(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    common_name: str,
    usage: x509.ObjectIdentifier,
    validity: tuple[datetime.datetime, datetime.datetime],
    alt_names: x509.SubjectAlternativeName | None = None,
) -> tuple[bytes, bytes]:
    """A new key and its certificate (not a CA) for `common_name` and `usage`, signed by the CA: the
    cluster's (ECDSA), or a user's (the replication certificate: RSA, ECDSA or EdDSA)."""
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey):
        raise ValueError("the CA key is none of RSA, ECDSA or Ed25519")
    # EdDSA signs without a separate digest.
    digest = None if isinstance(ca_key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pgherd"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity[0])
        .not_valid_after(validity[1])
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if alt_names is not None:
        builder = builder.add_extension(alt_names, critical=False)
    cert = (
        builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(_authority_key_identifier(ca_cert, ca_key), critical=False)
        .sign(ca_key, digest)
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _authority_key_identifier(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey,
) -> x509.AuthorityKeyIdentifier:
    """The CA's own subject key identifier when it has one (OpenSSL matches the two when it builds a
    chain, and a CA made elsewhere may compute it another way), else one from its public key."""
    try:
        found = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(found)


@dataclass(frozen=True)
class IssuedFiles:
    ca_cert: Path
    ca_key: Path
    members: dict[str, tuple[Path, Path]]  # member -> (certificate, key)
    clients: dict[str, tuple[Path, Path]] = field(default_factory=dict)  # user -> (certificate, key)


def issue(
    out: Path,
    cluster: str,
    members: Iterable[str] = (),
    *,
    ips: Iterable[str] = (),
    dns: Iterable[str] = (),
    headless_service: str | None = None,
    clients: Iterable[str] = (),
    lifetime: datetime.timedelta | None = None,
) -> IssuedFiles:
    """Files in `out` (0700, each 0600): `ca.crt`, `ca.key` (kept when they exist, so that members
    added later share the CA), `<member>.crt`, `<member>.key` and `<user>.client.crt`,
    `<user>.client.key` for each client user (made again each time, valid for `lifetime`)."""
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    ca_cert, ca_key = out / "ca.crt", out / "ca.key"
    if not (ca_cert.exists() and ca_key.exists()):
        cert_pem, key_pem = make_ca(cluster)
        write_private(ca_key, key_pem)
        write_private(ca_cert, cert_pem)
    issued: dict[str, tuple[Path, Path]] = {}
    ips, dns = list(ips), list(dns)
    for member in members:
        cert_pem, key_pem = make_server_cert(
            ca_cert.read_bytes(),
            ca_key.read_bytes(),
            member,
            ips=ips,
            dns=dns,
            headless_service=headless_service,
            lifetime=lifetime,
        )
        write_private(out / f"{member}.key", key_pem)
        write_private(out / f"{member}.crt", cert_pem)
        issued[member] = (out / f"{member}.crt", out / f"{member}.key")
    client_files: dict[str, tuple[Path, Path]] = {}
    for user in clients:
        cert_pem, key_pem = make_client_cert(
            ca_cert.read_bytes(), ca_key.read_bytes(), user, lifetime=lifetime
        )
        paths = (out / f"{user}.client.crt", out / f"{user}.client.key")
        write_private(paths[1], key_pem)
        write_private(paths[0], cert_pem)
        client_files[user] = paths
    return IssuedFiles(ca_cert, ca_key, issued, client_files)


class ServedCertificate:
    """The agent's HTTPS certificate, followed: `refresh()` makes a new SSLContext once the files
    changed (a renewed Secret, which the kubelet swaps whole), for the server's next handshakes; the
    connections already open keep theirs, and a pair that does not load keeps the one in use."""

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self.context = server_context(cert_file, key_file)
        self._loaded = self._digest()

    def _digest(self) -> bytes:
        return hashlib.sha256(self.cert_file.read_bytes() + b"\0" + self.key_file.read_bytes()).digest()

    def refresh(self) -> ssl.SSLContext | None:
        """The new context when the files changed and load, else None."""
        try:
            digest = self._digest()
            if digest == self._loaded:
                return None
            context = server_context(self.cert_file, self.key_file)
        except (OSError, ValueError, ssl.SSLError) as exc:
            log.warning(
                "cannot load the renewed certificate %s (%s): keeping the one served", self.cert_file, exc
            )
            return None
        self.context, self._loaded = context, digest
        log.info("serving the renewed certificate %s", self.cert_file)
        return context


def server_context(cert_file: Path | str, key_file: Path | str) -> ssl.SSLContext:
    """What the agent serves with: TLS 1.2 at least, its member certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert_file), str(key_file))
    return context


def client_context(ca_file: Path | str | None) -> ssl.SSLContext:
    """What the operator connects with: the cluster CA only (never the system's), hostname checked."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_file is not None:
        context.load_verify_locations(cafile=str(ca_file))
    return context
