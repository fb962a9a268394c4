"""A thin asynchronous Kubernetes API client for the operator's own requests (kopf has its own).

Plain REST over aiohttp: the operator needs a handful of verbs on a handful of kinds, and a small
client keeps every request visible (the chart's ClusterRole is checked against what it sends) and the
memory low (the official client's models cost tens of MB and a thread per call). Credentials are kopf's:
in-cluster ServiceAccount first, else the current kubeconfig context.

In-cluster the token is the kubelet's projected one, which expires: it is read again from its file
whenever the file changed, and after a 401. Throttling (429, API Priority and Fairness) waits as long as
the API server's Retry-After says; 5xx answers and lost connections are retried with jittered
exponential backoff, only where sending the request again cannot do a thing twice (see RetryPolicy).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import random
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from pgherd.kube import metrics

log = logging.getLogger("pgherd.kube")

JSON = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"
# Where the kubelet projects the pod's ServiceAccount token (and rotates it).
SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")

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
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
    "Lease": ("coordination.k8s.io/v1", "leases"),
    "EndpointSlice": ("discovery.k8s.io/v1", "endpointslices"),
}


class ApiError(Exception):
    """The API server refused a request: ``status`` (HTTP), ``reason`` (Kubernetes' reason word)."""

    def __init__(self, status: int, reason: str, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message
        self.retry_after = retry_after  # seconds, from the Retry-After header (429, some 5xx)

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


class TokenFile:
    """A ServiceAccount token kept in a file that is rewritten under us: the kubelet writes a fresh
    token well before the old one expires (bound tokens live an hour by default). Read again when the
    file changed, and on demand after the API server refused the token (a rewrite stat cannot see)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        # (stat stamp, token) as one value: replaced whole, never seen half updated.
        self._cached: tuple[tuple[int, int, int], str] | None = None

    def current(self) -> str:
        """The token as the file holds it now: a stat per call, a read only when the file changed."""
        stamp = self._stamp()
        cached = self._cached
        if cached is not None and cached[0] == stamp:
            return cached[1]
        return self._load(stamp)

    def reread(self) -> str:
        return self._load(self._stamp())

    def _stamp(self) -> tuple[int, int, int]:
        # stat follows the kubelet's ..data symlink, swapped to a new file at each rotation.
        st = os.stat(self.path)
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _load(self, stamp: tuple[int, int, int]) -> str:
        token = self.path.read_text(encoding="utf-8").strip()
        if not token:
            raise kopf.LoginError(f"the ServiceAccount token file {self.path} is empty")
        previous = self._cached
        if previous is not None and previous[1] != token:
            log.info("ServiceAccount token read again from %s: a new token", self.path)
        self._cached = (stamp, token)
        return token


@dataclass(frozen=True)
class Credentials:
    server: str
    token: str | None = None
    ssl_context: ssl.SSLContext | bool = True
    # In-cluster: the token is this file's current one, not ``token`` (the kubelet rotates it).
    token_file: TokenFile | None = field(default=None, compare=False)

    def bearer(self) -> str | None:
        return self.token_file.current() if self.token_file is not None else self.token

    def fresh_bearer(self) -> str | None:
        """After a 401: the token read again from its file; a fixed token stays what it was."""
        return self.token_file.reread() if self.token_file is not None else self.token

    def kopf_info(self, info: kopf.ConnectionInfo) -> kopf.ConnectionInfo:
        """What kopf logs in with, now: ``info`` (server, CA, client certificate) with the current token.
        kopf calls its login handlers again after a 401, and refuses credentials it has seen refused:
        a cached token would leave kopf with no credentials once the first one expired."""
        if self.token_file is None:
            return info
        return dataclasses.replace(info, token=self.token_file.reread())

    @classmethod
    def from_kopf(cls, info: kopf.ConnectionInfo, token_file: TokenFile | None = None) -> Credentials:
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
        return cls(
            server=info.server.rstrip("/"), token=info.token, ssl_context=context, token_file=token_file
        )

    @classmethod
    def discover(
        cls, settings: kopf.OperatorSettings | None = None
    ) -> tuple[Credentials, kopf.ConnectionInfo]:
        """In-cluster configuration (its token followed in the kubelet's file), else the current
        kubeconfig context, as kopf logs in; and kopf's ConnectionInfo of the same."""
        logger = logging.getLogger("pgherd.kube.login")
        settings = settings or kopf.OperatorSettings()
        info = kopf.login_with_service_account(logger=logger, settings=settings)
        if info is not None:
            return cls.from_kopf(info, TokenFile(SERVICE_ACCOUNT_TOKEN)), info
        info = kopf.login_with_kubeconfig(logger=logger, settings=settings)
        if info is None:
            raise kopf.LoginError("no Kubernetes credentials: neither in-cluster nor a kubeconfig")
        return cls.from_kopf(info), info


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


# Sent again after a 5xx or a lost connection: doing them twice leaves what doing them once does (a PUT
# carries the resourceVersion it read: a second one that finds it changed gets 409, as a racing writer).
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "PATCH", "DELETE"})
RETRIED_STATUSES = frozenset({500, 502, 503, 504})
# Failures before the request left (no connection made) and after it may have been acted on.
NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
MAYBE_DONE = (
    aiohttp.ClientOSError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientPayloadError,
    TimeoutError,
)


@dataclass(frozen=True)
class RetryPolicy:
    """When and after how long a request is sent again, ``attempts`` sendings at most.

    - 429 (API Priority and Fairness, max-in-flight): refused before it was processed, so any verb, after
      the Retry-After it came with (at most ``max_retry_after``) plus up to half as much again, so that
      the clients told the same second do not all come back at once.
    - 500, 502, 503, 504, a timeout, a connection lost: only an IDEMPOTENT verb, after a full-jitter
      exponential backoff. A create (POST) may have been done: it fails, and the caller's next pass
      sees what is there.
    - A connection never made: any verb, nothing was sent.
    """

    attempts: int = 6
    max_retry_after: float = 10.0
    backoff: float = 0.2  # the first backoff's bound, doubled at each attempt up to max_backoff
    max_backoff: float = 5.0

    def retryable(self, method: str, exc: BaseException) -> bool:
        if isinstance(exc, ApiError):
            return exc.status == 429 or (exc.status in RETRIED_STATUSES and method in IDEMPOTENT)
        if isinstance(exc, (aiohttp.ClientSSLError, aiohttp.ClientConnectorCertificateError)):
            return False  # a certificate refused is refused again
        if isinstance(exc, NOT_SENT):
            return True
        if isinstance(exc, MAYBE_DONE):
            return method in IDEMPOTENT
        return False

    def wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, ApiError) and exc.retry_after is not None:
            seconds = min(exc.retry_after, self.max_retry_after)
            return seconds + random.uniform(0, seconds / 2)
        return float(wait_random_exponential(multiplier=self.backoff, max=self.max_backoff)(state))


class KubeApi:
    """get / list / create / patch / delete on the kinds in KINDS. One aiohttp session, reused, with at
    most ``pool`` connections; requests sent again as ``retry`` says.

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
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        self.credentials = credentials
        self.retry = retry
        self._pool = pool
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        # No Authorization here: the token is the credentials' current one, at each request.
        self._headers = {"User-Agent": user_agent, "Accept": "application/json"}
        self._session: aiohttp.ClientSession | None = None

    @property
    def pool(self) -> int:
        """How many connections its requests share at most."""
        return self._pool

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
        answer: bool = True,
    ) -> JSON:
        """The answer's document; with ``answer=False``, {} without parsing it (the object a write
        returns, managedFields and all, when the caller has no use for it). A refusal is an ApiError
        either way."""
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        policy = self.retry

        def retrying(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            throttled = isinstance(exc, ApiError) and exc.status == 429
            log.log(
                logging.DEBUG if throttled else logging.INFO,
                "%s %s: %s; sending it again in %.1f s (attempt %d of %d)",
                method,
                url_path,
                _describe(exc),
                state.next_action.sleep if state.next_action is not None else 0.0,
                state.attempt_number + 1,
                policy.attempts,
            )

        attempts = AsyncRetrying(
            stop=stop_after_attempt(policy.attempts),
            wait=policy.wait,
            retry=retry_if_exception(lambda exc: policy.retryable(method, exc)),
            before_sleep=retrying,
            reraise=True,
        )
        return await attempts(self._authenticated, method, url_path, data, params, headers, answer)

    async def _authenticated(
        self,
        method: str,
        url_path: str,
        data: str | None,
        params: Mapping[str, str] | None,
        headers: dict[str, str],
        answer: bool = True,
    ) -> JSON:
        """Sent with the current token; after a 401, once more if the token file holds another one by
        now (a 401 is refused before anything is done: any verb may be sent again)."""
        token = self.credentials.bearer()
        try:
            return await self._send(method, url_path, data, params, headers, token, answer)
        except ApiError as exc:
            token_file = self.credentials.token_file
            if exc.status != 401 or token_file is None:
                raise
            fresh = self.credentials.fresh_bearer()
            if fresh == token:
                raise
            log.info(
                "%s %s: 401 Unauthorized; sending it again with the new token of %s",
                method,
                url_path,
                token_file.path,
            )
            return await self._send(method, url_path, data, params, headers, fresh, answer)

    async def _send(
        self,
        method: str,
        url_path: str,
        data: str | None,
        params: Mapping[str, str] | None,
        headers: dict[str, str],
        token: str | None,
        answer: bool = True,
    ) -> JSON:
        if token:
            headers = {**headers, "Authorization": f"Bearer {token}"}
        try:
            async with self._client().request(
                method, self.credentials.server + url_path, data=data, params=params, headers=headers
            ) as response:
                raw = await response.read()
        except (aiohttp.ClientError, TimeoutError):
            metrics.API_REQUESTS.labels(method, "0").inc()
            raise
        metrics.API_REQUESTS.labels(method, str(response.status)).inc()
        if response.status >= 400:
            text = raw.decode(errors="replace")
            reason, message = "", text[:500]
            try:
                doc = json.loads(text)
                reason, message = str(doc.get("reason", "")), str(doc.get("message", message))
            except ValueError:
                pass
            raise ApiError(
                response.status,
                reason or response.reason or "",
                message,
                retry_after=_seconds(response.headers.get("Retry-After")),
            )
        if not answer or not raw:
            return {}
        return json.loads(raw)  # type: ignore[no-any-return]

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
        self,
        kind: str,
        namespace: str | None,
        name: str,
        body: JSON,
        subresource: str | None = None,
        *,
        answer: bool = True,
    ) -> JSON:
        """A merge patch; ``answer=False``: the patched object is not parsed, {} is returned."""
        return await self.request(
            "PATCH",
            path(kind, namespace, name, subresource),
            body=body,
            content_type=MERGE_PATCH,
            answer=answer,
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


def _seconds(value: str | None) -> float | None:
    """Retry-After in seconds, the form the API server sends (an HTTP date is left to the backoff)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, ApiError):
        return f"{exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
