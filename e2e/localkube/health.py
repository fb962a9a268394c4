"""Readiness checks over HTTP(S): a component answers 200 on its health path."""

from __future__ import annotations

import ssl
import urllib.request

from e2e.localkube.settings import Layout


def admin_tls(layout: Layout) -> ssl.SSLContext:
    """TLS as the administrator: the cluster's CA, the admin client certificate."""
    context = ssl.create_default_context(cafile=str(layout.pki / "ca.crt"))
    context.load_cert_chain(str(layout.pki / "admin.crt"), str(layout.pki / "admin.key"))
    return context


def insecure_tls() -> ssl.SSLContext:
    """For the components' own self-signed serving certificates on 127.0.0.1 (health endpoints only)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def answers(url: str, context: ssl.SSLContext | None = None, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            return bool(response.status == 200)
    except OSError:
        return False
