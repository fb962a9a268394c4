"""The cluster's PKI and kubeconfigs: one CA for every serving and client certificate (ECDSA P-256),
a front-proxy CA for the API server's request-header authentication (the controller-manager's and
scheduler's delegated authentication read it), and the ServiceAccount signing key (RSA). Each client's
identity is its certificate's subject: CN the user, O the groups, as Kubernetes' authenticator reads it."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from e2e.localkube.settings import CLUSTER_DOMAIN, NODE_NAME, Layout, Settings

DAYS = 3650
PrivateKey = ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class Client:
    """A client certificate: file name, user (CN), groups (O)."""

    name: str
    user: str
    groups: tuple[str, ...] = ()


ADMIN = Client("admin", "kubernetes-admin", ("system:masters",))
CONTROLLER_MANAGER = Client("controller-manager", "system:kube-controller-manager")
SCHEDULER = Client("scheduler", "system:kube-scheduler")
KUBELET = Client("kubelet", f"system:node:{NODE_NAME}", ("system:nodes",))
KUBE_PROXY = Client("kube-proxy", "system:kube-proxy")
APISERVER_KUBELET_CLIENT = Client("apiserver-kubelet-client", "kube-apiserver-kubelet-client")
COREDNS = Client("coredns", "localkube:coredns")
STORAGE = Client("local-path-provisioner", "localkube:local-path-provisioner")
NETWORK_POLICY = Client("kube-router", "localkube:kube-router")
CLIENTS = (
    ADMIN,
    CONTROLLER_MANAGER,
    SCHEDULER,
    KUBELET,
    KUBE_PROXY,
    APISERVER_KUBELET_CLIENT,
    COREDNS,
    STORAGE,
    NETWORK_POLICY,
)


def write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _key() -> PrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _save(pki: Path, name: str, cert: x509.Certificate, key: PrivateKey | rsa.RSAPrivateKey) -> None:
    (pki / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_private(
        pki / f"{name}.key",
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        key_encipherment=not ca,
        key_cert_sign=ca,
        crl_sign=ca,
        content_commitment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=DAYS))
    )


def _ca(pki: Path, name: str, common_name: str) -> tuple[x509.Certificate, PrivateKey]:
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        _builder(subject, subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _save(pki, name, cert, key)
    return cert, key


def _leaf(
    pki: Path,
    name: str,
    ca: tuple[x509.Certificate, PrivateKey],
    *,
    common_name: str,
    groups: tuple[str, ...] = (),
    server: bool = False,
    ips: tuple[str, ...] = (),
    dns: tuple[str, ...] = (),
) -> None:
    key = _key()
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, group) for group in groups]
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    builder = (
        _builder(x509.Name(attributes), ca[0].subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca[1].public_key()), critical=False)
    )
    if ips or dns:
        names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        names += [x509.DNSName(host) for host in dns]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    _save(pki, name, builder.sign(ca[1], hashes.SHA256()), key)


def make_pki(layout: Layout, settings: Settings) -> None:
    """Every certificate and key the cluster needs, in DIR/pki (made once: kept across up/down of the
    same DIR would need the same etcd too, so `up` always starts from an empty DIR/pki)."""
    pki = layout.pki
    pki.mkdir(parents=True, exist_ok=True)
    ca = _ca(pki, "ca", "localkube-ca")
    service = "kubernetes.default.svc"
    _leaf(
        pki, "apiserver", ca, common_name="kube-apiserver", server=True,
        ips=(settings.node_ip, "127.0.0.1", settings.kubernetes_service_ip),
        dns=("localhost", "kubernetes", "kubernetes.default", service, f"{service}.{CLUSTER_DOMAIN}"),
    )  # fmt: skip
    _leaf(
        pki,
        "kubelet-serving",
        ca,
        common_name=NODE_NAME,
        server=True,
        ips=(settings.node_ip,),
        dns=(NODE_NAME,),
    )
    for client in CLIENTS:
        _leaf(pki, client.name, ca, common_name=client.user, groups=client.groups)
    front_proxy = _ca(pki, "front-proxy-ca", "localkube-front-proxy-ca")
    _leaf(pki, "front-proxy-client", front_proxy, common_name="front-proxy-client")
    service_account = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    write_private(
        pki / "sa.key",
        service_account.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )
    (pki / "sa.pub").write_bytes(
        service_account.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def write_kubeconfig(path: Path, layout: Layout, settings: Settings, client: Client) -> None:
    """A kubeconfig for `client`, the certificates embedded (a copy works anywhere on this machine)."""

    def data(name: str) -> str:
        return base64.b64encode((layout.pki / name).read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "localkube",
                "cluster": {"server": settings.api_url, "certificate-authority-data": data("ca.crt")},
            }
        ],
        "users": [
            {
                "name": client.user,
                "user": {
                    "client-certificate-data": data(f"{client.name}.crt"),
                    "client-key-data": data(f"{client.name}.key"),
                },
            }
        ],
        "contexts": [{"name": "localkube", "context": {"cluster": "localkube", "user": client.user}}],
        "current-context": "localkube",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, yaml.safe_dump(config, sort_keys=False).encode())


def write_kubeconfigs(layout: Layout, settings: Settings) -> None:
    write_kubeconfig(layout.kubeconfig, layout, settings, ADMIN)
    for client in CLIENTS:
        if client is not ADMIN and client is not APISERVER_KUBELET_CLIENT:
            write_kubeconfig(layout.component_kubeconfig(client.name), layout, settings, client)
