"""A thin asynchronous Kubernetes API client for the operator's own requests (kopf has its own).

Plain REST over aiohttp: the operator needs a handful of verbs on a handful of kinds, and a small
client keeps every request visible (the chart's ClusterRole is checked against what it sends) and the
memory low (the official client's models cost tens of MB and a thread per call). Credentials are kopf's:
in-cluster ServiceAccount first, else the current kubeconfig context.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf

log = logging.getLogger("pgherd.kube")

JSON = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"

# (apiVersion, plural) of every kind the operator reads or writes.
KINDS: dict[str, tuple[str, str]] = {
    "PostgresCluster": ("pgherd.io/v1alpha1", "postgresclusters"),
    "Backup": ("pgherd.io/v1alpha1", "backups"),
    "Restore": ("pgherd.io/v1alpha1", "restores"),
    "Pod": ("v1", "pods"),
    "PersistentVolumeClaim": ("v1", "persistentvolumeclaims"),
    "Service": ("v1", "services"),
    "Secret": ("v1", "secrets"),
    "ConfigMap": ("v1", "configmaps"),
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Event": ("events.k8s.io/v1", "events"),
    "StatefulSet": ("apps/v1", "statefulsets"),
    "Job": ("batch/v1", "jobs"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "Lease": ("coordination.k8s.io/v1", "leases"),
}


class ApiError(Exception):
    """The API server refused a request: ``status`` (HTTP), ``reason`` (Kubernetes' reason word)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


def path(
    kind: str, namespace: str | None = None, name: str | None = None, subresource: str | None = None
) -> str:
    api_version, plural = KINDS[kind]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [base]
    if namespace is not None:
        parts.append(f"namespaces/{quote(namespace, safe='')}")
    parts.append(plural)
    if name is not None:
        parts.append(quote(name, safe=""))
        if subresource is not None:
            parts.append(subresource)
    return "/".join(parts)


def selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


@dataclass(frozen=True)
class Credentials:
    server: str
    token: str | None = None
    ssl_context: ssl.SSLContext | bool = True

    @classmethod
    def from_kopf(cls, info: kopf.ConnectionInfo) -> Credentials:
        context: ssl.SSLContext | bool = True
        if info.server.startswith("https"):
            ctx = ssl.create_default_context()
            if info.insecure:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            if info.ca_path:
                ctx.load_verify_locations(cafile=str(info.ca_path))
            elif info.ca_data:
                ctx.load_verify_locations(cadata=_pem(info.ca_data))
            cert, key = _pair(info)
            if cert is not None:
                ctx.load_cert_chain(cert, key)
            context = ctx
        return cls(server=info.server.rstrip("/"), token=info.token, ssl_context=context)

    @staticmethod
    def kopf_login(settings: kopf.OperatorSettings | None = None) -> kopf.ConnectionInfo:
        """In-cluster configuration, else the current kubeconfig context (as kopf logs in)."""
        logger = logging.getLogger("pgherd.kube.login")
        settings = settings or kopf.OperatorSettings()
        info = kopf.login_with_service_account(
            logger=logger, settings=settings
        ) or kopf.login_with_kubeconfig(logger=logger, settings=settings)
        if info is None:
            raise kopf.LoginError("no Kubernetes credentials: neither in-cluster nor a kubeconfig")
        return info

    @classmethod
    def discover(cls) -> Credentials:
        return cls.from_kopf(cls.kopf_login())


def _pem(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    if b"-----BEGIN" in raw:
        return raw.decode()
    return base64.b64decode(raw).decode()


def _pair(info: kopf.ConnectionInfo) -> tuple[str | None, str | None]:
    """Client certificate and key as file paths (ssl wants files)."""
    cert = str(info.certificate_path) if info.certificate_path else None
    key = str(info.private_key_path) if info.private_key_path else None
    if cert is None and info.certificate_data:
        cert = _spill(_pem(info.certificate_data))
    if key is None and info.private_key_data:
        key = _spill(_pem(info.private_key_data))
    return cert, key


def _spill(text: str) -> str:
    handle = tempfile.NamedTemporaryFile("w", prefix="pgherd-", suffix=".pem", delete=False)  # noqa: SIM115
    with handle:
        handle.write(text)
    return handle.name


class KubeApi:
    """get / list / create / patch / delete on the kinds in KINDS. One aiohttp session, reused, with at
    most ``pool`` connections.

    ``timeout`` bounds connecting and each read of an answer, not the whole request: a request waiting
    for one of the pool's connections is not failed for the wait (seen against a real API server with
    2,000 clusters: nearly every tick failed with an empty TimeoutError before it was even sent)."""

    def __init__(
        self,
        credentials: Credentials,
        *,
        timeout: float = 10.0,
        user_agent: str = "pgherd",
        pool: int = 32,
    ) -> None:
        self.credentials = credentials
        self._pool = pool
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        self._headers = {"User-Agent": user_agent, "Accept": "application/json"}
        if credentials.token:
            self._headers["Authorization"] = f"Bearer {credentials.token}"
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self.credentials.ssl_context, limit=self._pool)
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers, timeout=self._timeout
            )
        return self._session

    async def request(
        self,
        method: str,
        url_path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> JSON:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        async with self._client().request(
            method, self.credentials.server + url_path, data=data, params=params, headers=headers
        ) as response:
            text = await response.text()
            if response.status >= 400:
                reason, message = "", text[:500]
                try:
                    doc = json.loads(text)
                    reason, message = str(doc.get("reason", "")), str(doc.get("message", message))
                except ValueError:
                    pass
                raise ApiError(response.status, reason or response.reason or "", message)
            return json.loads(text) if text else {}

    async def get(self, kind: str, namespace: str | None, name: str, subresource: str | None = None) -> JSON:
        return await self.request("GET", path(kind, namespace, name, subresource))

    async def find(self, kind: str, namespace: str | None, name: str) -> JSON | None:
        try:
            return await self.get(kind, namespace, name)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def list(
        self, kind: str, namespace: str | None, labels: Mapping[str, str] | None = None
    ) -> list[JSON]:
        params = {"labelSelector": selector(labels)} if labels else None
        doc = await self.request("GET", path(kind, namespace), params=params)
        return list(doc.get("items") or [])

    async def create(self, kind: str, namespace: str | None, body: JSON) -> JSON:
        return await self.request("POST", path(kind, namespace), body=body)

    async def patch(
        self, kind: str, namespace: str | None, name: str, body: JSON, subresource: str | None = None
    ) -> JSON:
        return await self.request(
            "PATCH", path(kind, namespace, name, subresource), body=body, content_type=MERGE_PATCH
        )

    async def replace(self, kind: str, namespace: str | None, name: str, body: JSON) -> JSON:
        return await self.request("PUT", path(kind, namespace, name), body=body)

    async def delete(
        self,
        kind: str,
        namespace: str | None,
        name: str,
        *,
        grace_seconds: int | None = None,
        uid: str | None = None,
        propagation: str | None = None,
    ) -> bool:
        """Delete; False when it was already gone. ``uid``: only that incarnation of the object."""
        options: JSON = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if grace_seconds is not None:
            options["gracePeriodSeconds"] = grace_seconds
        if uid is not None:
            options["preconditions"] = {"uid": uid}
        if propagation is not None:
            options["propagationPolicy"] = propagation
        try:
            await self.request("DELETE", path(kind, namespace, name), body=options)
        except ApiError as exc:
            if exc.not_found:
                return False
            raise
        return True
