"""A CA the test makes, issuing certificates the way cert-manager writes them into a Secret.

cert-manager's Secret (type kubernetes.io/tls): `tls.crt` the leaf followed by its chain, `tls.key` its
private key (PKCS#1 for RSA, cert-manager's default), `ca.crt` the root that signed them. The users'
certificates of spec.tls.serverCertSecret and spec.tls.clientCASecret are tested with these, made
apart from pgherd's own issuer: RSA keys (cert-manager's default algorithm) and, on request, an
intermediate CA between the root and the leaves.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey


def new_key(kind: str = "rsa") -> PrivateKey:
    if kind == "rsa":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return ec.generate_private_key(ec.SECP256R1())


def pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def key_pem(key: PrivateKey) -> str:
    # What cert-manager writes by default: PKCS#1 for RSA ("RSA PRIVATE KEY"), SEC1 for ECDSA.
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    ).decode()


@dataclass(frozen=True)
class Issued:
    """A certificate with its key, the chain between it and the root, and the root."""

    cert: x509.Certificate
    key: PrivateKey
    chain: tuple[x509.Certificate, ...]
    root: x509.Certificate

    @property
    def serial(self) -> int:
        return self.cert.serial_number

    def secret_data(self) -> dict[str, str]:
        """cert-manager's keys: tls.crt (the leaf, then its chain), tls.key, ca.crt (the root)."""
        return {
            "tls.crt": pem(self.cert) + "".join(pem(c) for c in self.chain),
            "tls.key": key_pem(self.key),
            "ca.crt": pem(self.root),
        }

    def secret(
        self, name: str, namespace: str | None = None, *, drop: Sequence[str] = (), opaque: bool = False
    ) -> dict[str, Any]:
        """The Secret cert-manager would write (without the keys in `drop`; of type Opaque, which the
        API server lets lack tls.key, with `opaque`)."""
        data = {k: v for k, v in self.secret_data().items() if k not in drop}
        metadata: dict[str, Any] = {"name": name}
        if namespace is not None:
            metadata["namespace"] = namespace
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque" if opaque else "kubernetes.io/tls",
            "metadata": metadata,
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        }


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pgherd tests"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _ca_extensions(builder: x509.CertificateBuilder, key: PrivateKey) -> x509.CertificateBuilder:
    return (
        builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
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
    )


class TestCA:
    """A root CA (RSA), optionally with an intermediate that signs the leaves."""

    __test__ = False  # not a pytest test class

    def __init__(self, name: str = "pgherd test root", *, intermediate: bool = False) -> None:
        now = datetime.now(UTC)
        self.root_key = new_key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.root_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(hours=1))
            .not_valid_after(now + timedelta(days=365))
        )
        self.root = _ca_extensions(builder, self.root_key).sign(self.root_key, hashes.SHA256())
        self.signer: Issued = Issued(self.root, self.root_key, (), self.root)
        if intermediate:
            self.signer = self.issue_ca(f"{name} intermediate")

    @property
    def root_pem(self) -> str:
        return pem(self.root)

    def _sign(
        self,
        builder: x509.CertificateBuilder,
        key: PrivateKey,
        common_name: str,
        not_before: datetime | None,
        lifetime: timedelta,
    ) -> Issued:
        start = not_before or datetime.now(UTC) - timedelta(minutes=5)
        cert = (
            builder.subject_name(_name(common_name))
            .issuer_name(self.signer.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + lifetime)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.signer.key.public_key()),
                critical=False,
            )
            .sign(self.signer.key, hashes.SHA256())
        )
        chain = (self.signer.cert, *self.signer.chain) if self.signer.cert != self.root else ()
        return Issued(cert, key, chain, self.root)

    def issue_ca(self, common_name: str, *, lifetime: timedelta = timedelta(days=180)) -> Issued:
        """A CA signed by this one: what cert-manager writes for a Certificate with `isCA: true`."""
        key = new_key()
        return self._sign(_ca_extensions(x509.CertificateBuilder(), key), key, common_name, None, lifetime)

    def server(
        self,
        dns_names: Sequence[str],
        *,
        not_before: datetime | None = None,
        lifetime: timedelta = timedelta(days=30),
        key: PrivateKey | None = None,
    ) -> Issued:
        """A server certificate for `dns_names` (the first is its common name)."""
        key = key or new_key()
        builder = (
            x509.CertificateBuilder()
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        )
        return self._sign(builder, key, dns_names[0][:64], not_before, lifetime)


def cluster_names(cluster: str, namespace: str) -> list[str]:
    """The names a cert-manager Certificate for a cluster's members lists (docs/security.md): the -rw,
    -ro and -r Services in their four spellings, every member under the headless Service."""
    names: list[str] = []
    for suffix in ("rw", "ro", "r"):
        service = f"{cluster}-{suffix}"
        names += [service, f"{service}.{namespace}", f"{service}.{namespace}.svc"]
        names.append(f"{service}.{namespace}.svc.cluster.local")
    headless = f"{cluster}-headless"
    names += [f"*.{headless}.{namespace}.svc", f"*.{headless}.{namespace}", f"*.{headless}"]
    return names
