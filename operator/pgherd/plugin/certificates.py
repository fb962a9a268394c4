"""Certificates' public facts (subject, expiry) from PEM text: what `status` and `report` show of the
cluster's TLS, never a key."""

from __future__ import annotations

from cryptography import x509

from pgherd.plugin.document import CertificateRecord
from pgherd_backup.timestamps import rfc3339


def records(pem: str, name: str, source: str) -> list[CertificateRecord]:
    """One record per certificate in ``pem`` (a chain lists several); an unreadable one says so."""
    blocks = [b for b in pem.split("-----END CERTIFICATE-----") if "-----BEGIN CERTIFICATE-----" in b]
    out: list[CertificateRecord] = []
    for block in blocks:
        text = (block.strip() + "\n-----END CERTIFICATE-----\n").encode()
        try:
            cert = x509.load_pem_x509_certificate(text)
        except ValueError as exc:
            out.append(
                CertificateRecord(name=name, subject=f"unreadable: {exc}", not_after=None, source=source)
            )
            continue
        expires = rfc3339(cert.not_valid_after_utc)
        out.append(
            CertificateRecord(
                name=name, subject=cert.subject.rfc4514_string(), not_after=expires, source=source
            )
        )
    return out


def from_status(value: object) -> list[CertificateRecord]:
    """``status.certificates`` when the operator reports them: a list (or a map by name) of objects
    with a ``notAfter`` (or ``expiresAt``), read leniently."""
    items: list[tuple[str, dict[str, object]]] = []
    if isinstance(value, list):
        items = [(_status_name(v), v) for v in value if isinstance(v, dict)]
    elif isinstance(value, dict):
        items = [(str(k), v) for k, v in value.items() if isinstance(v, dict)]
    return [
        CertificateRecord(
            name=name,
            subject=str(v.get("subject") or ""),
            not_after=None
            if (v.get("notAfter") or v.get("expiresAt")) is None
            else str(v.get("notAfter") or v.get("expiresAt")),
            source="status",
        )
        for name, v in items
    ]


def _status_name(entry: dict[str, object]) -> str:
    """ "server (Secret hippo-agent)": the operator's name for it, and the Secret that holds it."""
    name, secret = entry.get("name"), entry.get("secret")
    if name and secret:
        return f"{name} (Secret {secret})"
    return str(name or secret or "certificate")
