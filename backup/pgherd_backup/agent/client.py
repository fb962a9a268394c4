"""AgentClient: the operator's one door to a member (both platform adapters use it).

Synchronous and standard library only (http.client over ssl): each call opens one connection, with a
short timeout for observation and a longer one for actions, which answer when they are done; a client
given a `Connections` pool keeps its /status connection open between polls (a TLS handshake per poll
cost the operator more than the poll itself). Every
failure is an `AgentError` whose message names the member's address and carries the agent's own
error text; subclasses say what kind of failure it is.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pgherd_backup.agent.isolation import ISOLATION_HEADER, IsolationOrder
from pgherd_backup.agent.tls import client_context
from pgherd_backup.agent.wire import (
    ActionResult,
    CheckpointRequest,
    DemoteRequest,
    DropSlotRequest,
    ErrorBody,
    FenceRequest,
    PromoteRequest,
    RejoinRequest,
    Request,
    RestartRequest,
    RestoreRequest,
    SeedRequest,
    SetSyncRequest,
    Status,
    UnfenceRequest,
    UpgradeRequest,
    WireError,
)

STATUS_TIMEOUT = 2.0
ACTION_TIMEOUT = 120.0
SLOW_ACTION_TIMEOUT = 3600.0  # rejoin and seed may copy a whole data directory
# A connection and its TLS handshake, whatever the call's timeout: an agent cut off by a partition
# (packets dropped, no reset) is known in seconds, not after a fence's or an action's whole timeout.
CONNECT_TIMEOUT = 2.0
# How long an idle kept connection is reused: under the agent's own KEEPALIVE_IDLE (10 s), so that a
# request is never sent into a connection the agent is closing.
KEEPALIVE_REUSE = 5.0
# What a kept connection that the agent closed meanwhile fails with, before any answer: asked once more on
# a new connection (never after a timeout, which is an answer that did not come).
_STALE = (
    http.client.RemoteDisconnected,
    http.client.BadStatusLine,
    http.client.CannotSendRequest,
    ConnectionResetError,
    BrokenPipeError,
    ssl.SSLEOFError,
    ssl.SSLZeroReturnError,
)


class AgentError(Exception):
    """A call to an agent failed. `status`: the HTTP status when the agent answered."""

    def __init__(self, message: str, status: int | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.reason = reason


class AgentUnreachable(AgentError):
    """No answer: connection refused or timed out, or TLS failed (e.g. the certificate is not the
    cluster CA's). Says nothing about PostgreSQL on the member."""


class AgentAuthError(AgentError):
    """401 (no credential sent) or 403 (wrong credential): the request changed nothing."""


class AgentBusy(AgentError):
    """409: another action is in progress on the member; ask again later."""


class AgentActionError(AgentError):
    """The agent refused the request (4xx) or tried and failed (5xx); the message is its own text."""


_Key = tuple[str, int, str | None]


class Connections:
    """Idle kept-alive connections to agents, by address and name, shared by the clients of one
    operator (thread-safe): at most one per address is kept, none longer than ``reuse`` seconds."""

    def __init__(self, reuse: float = KEEPALIVE_REUSE) -> None:
        self.reuse = reuse
        self._lock = threading.Lock()
        self._idle: dict[_Key, tuple[float, http.client.HTTPConnection]] = {}

    def take(self, key: _Key) -> http.client.HTTPConnection | None:
        with self._lock:
            kept = self._idle.pop(key, None)
        if kept is None:
            return None
        since, connection = kept
        if time.monotonic() - since < self.reuse:
            return connection
        connection.close()
        return None

    def give(self, key: _Key, connection: http.client.HTTPConnection) -> None:
        now = time.monotonic()
        with self._lock:
            replaced = self._idle.pop(key, None)
            self._idle[key] = (now, connection)
            expired = [k for k, (since, _) in self._idle.items() if now - since >= self.reuse]
            closing = [self._idle.pop(k)[1] for k in expired]
        for old in closing + ([replaced[1]] if replaced is not None else []):
            old.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = list(self._idle.values()), {}
        for _, connection in idle:
            connection.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._idle)


def agent_context(ca_file: Path | str | None) -> ssl.SSLContext:
    """The TLS context an AgentClient connects with: `ca_file` (None: the system's trust store)."""
    context = client_context(ca_file)
    if ca_file is None:
        context.load_default_certs()
    return context


class AgentClient:
    """`base_url`: https://host:8008 (http:// only for an agent run with --no-tls).
    `ca_file`: the cluster CA (None: the system's trust store, never advisable).
    `server_hostname`: the name to verify in the certificate when connecting by IP (e.g. the member)."""

    def __init__(
        self,
        base_url: str,
        *,
        ca_file: Path | str | None = None,
        token: str | None = None,
        server_hostname: str | None = None,
        timeout: float = STATUS_TIMEOUT,
        action_timeout: float = ACTION_TIMEOUT,
        context: ssl.SSLContext | None = None,
        connections: Connections | None = None,
    ) -> None:
        """`context`: a TLS context from `agent_context` to share between clients (building one reads
        the CA: 0.28 ms, at every call of a client made per call); else one is built from `ca_file`.
        `connections`: where GET /status keeps its connection between calls (None: one per call)."""
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"invalid agent URL {base_url!r}: expected https://host:port")
        self.base_url = base_url.rstrip("/")
        self.scheme = url.scheme
        self.host = url.hostname
        self.port = url.port or 8008
        self.token = token
        self.server_hostname = server_hostname
        self.timeout = timeout
        self.action_timeout = action_timeout
        self._context: ssl.SSLContext | None = None
        if self.scheme == "https":
            self._context = context or agent_context(ca_file)
        self.connections = connections
        self._key: _Key = (self.host, self.port, server_hostname)

    def __repr__(self) -> str:  # never the token
        return f"AgentClient({self.base_url!r})"

    # -- observation ------------------------------------------------------------------------------
    def status(self, timeout: float | None = None, isolation: IsolationOrder | None = None) -> Status:
        """/status; `isolation`: the order for a primary cut off (agent/isolation.py), sent with it."""
        headers = {ISOLATION_HEADER: isolation.render()} if isolation is not None else None
        body = self._call("GET", "/status", timeout=timeout or self.timeout, headers=headers)
        try:
            return Status.from_dict(body)
        except WireError as exc:
            raise AgentError(f"agent {self.base_url}: unexpected /status document ({exc})") from None

    def probe(self, name: str, timeout: float | None = None) -> int:
        """The HTTP status of a probe (`healthz`, `readyz`, `startupz`); no credential sent."""
        status, _ = self._request("GET", f"/{name}", None, timeout or self.timeout, auth=False)
        return status

    # -- actions (each idempotent; each returns once done, but restore, which goes on in the agent) --
    def promote(self, reason: str = "") -> ActionResult:
        return self.act(PromoteRequest(reason=reason))

    def fence(self, reason: str = "") -> ActionResult:
        return self.act(FenceRequest(reason=reason))

    def demote(self, reason: str = "") -> ActionResult:
        return self.act(DemoteRequest(reason=reason))

    def unfence(self, primary: bool = False, reason: str = "") -> ActionResult:
        return self.act(UnfenceRequest(reason=reason, primary=primary))

    def rejoin(
        self, upstream: str, reclone: bool = False, reason: str = "", *, ahead_of_promotion: bool = False
    ) -> ActionResult:
        request = RejoinRequest(
            reason=reason, upstream=upstream, reclone=reclone, ahead_of_promotion=ahead_of_promotion
        )
        return self.act(request, timeout=SLOW_ACTION_TIMEOUT)

    def restart(self, revision: str | None = None, primary: bool = False, reason: str = "") -> ActionResult:
        return self.act(RestartRequest(reason=reason, revision=revision, primary=primary))

    def set_sync(self, value: str, reason: str = "") -> ActionResult:
        return self.act(SetSyncRequest(reason=reason, value=value))

    def checkpoint(self, reason: str = "") -> ActionResult:
        return self.act(CheckpointRequest(reason=reason))

    def drop_slot(self, slot: str, reason: str = "") -> ActionResult:
        return self.act(DropSlotRequest(reason=reason, slot=slot))

    def seed(
        self,
        method: str,
        upstream: str | None = None,
        snapshot: str | None = None,
        target: str | None = None,
        reason: str = "",
    ) -> ActionResult:
        request = SeedRequest(
            reason=reason, method=method, upstream=upstream, snapshot=snapshot, target=target
        )
        return self.act(request, timeout=SLOW_ACTION_TIMEOUT)

    def restore(
        self,
        snapshot: str | None = None,
        target: str | None = None,
        request_id: str | None = None,
        reason: str = "",
    ) -> ActionResult:
        """Start an in-place restore of this fenced member (see RestoreRequest). It answers at once
        (`in_progress`: 202) and goes on in the agent: follow `status().action_progress` until
        `status().last_action` (its `request_id`) says how it ended. Asked again with the same
        `request_id`, it answers that restore's state and never starts another."""
        request = RestoreRequest(reason=reason, snapshot=snapshot, target=target, request_id=request_id)
        return self.act(request)

    def upgrade(
        self, major: int, check: bool = False, request_id: str | None = None, reason: str = ""
    ) -> ActionResult:
        """Start the major upgrade of this member's data to `major`, or (`check`) its preflight (see
        UpgradeRequest). Answered at once like `restore`: follow `status().last_action`."""
        request = UpgradeRequest(reason=reason, major=major, check=check, request_id=request_id)
        return self.act(request)

    def act(self, request: Request, timeout: float | None = None) -> ActionResult:
        body = self._call(
            "POST", f"/actions/{request.action}", request.to_dict(), timeout=timeout or self.action_timeout
        )
        try:
            return ActionResult.from_dict(body)
        except WireError as exc:
            raise AgentError(
                f"agent {self.base_url}: unexpected answer to {request.action} ({exc})"
            ) from None

    # -- transport --------------------------------------------------------------------------------
    def _call(
        self,
        method: str,
        path: str,
        payload: Mapping[str, Any] | None = None,
        *,
        timeout: float,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        status, text = self._request(method, path, payload, timeout, auth=True, extra=headers)
        try:
            body = json.loads(text) if text else {}
        except ValueError:
            body = {"error": text.strip()[:500]}
        if 200 <= status < 300:
            return body
        error = _error_body(body, status)
        message = f"agent {self.base_url}: {method} {path} answered {status}: {error.error}"
        if status in (401, 403):
            raise AgentAuthError(message, status, error.reason)
        if status == 409 and error.reason == "busy":
            raise AgentBusy(message, status, error.reason)
        raise AgentActionError(message, status, error.reason)

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self._context is None:
            return http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        if self.server_hostname and self.server_hostname != self.host:
            return _NamedHTTPSConnection(self.host, self.port, self.server_hostname, self._context, timeout)
        return http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=self._context)

    def _request(
        self,
        method: str,
        path: str,
        payload: Mapping[str, Any] | None,
        timeout: float,
        *,
        auth: bool,
        extra: Mapping[str, str] | None = None,
    ) -> tuple[int, str]:
        headers = {"Accept": "application/json", **(extra or {})}
        data: bytes | None = None
        if payload is not None:
            data = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        if auth and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        keep = self.connections is not None and method == "GET" and path == "/status"
        headers["Connection"] = "keep-alive" if keep else "close"
        kept = self.connections.take(self._key) if keep and self.connections is not None else None
        if kept is not None:
            try:
                return self._exchange(kept, method, path, data, headers, timeout, keep=True, fresh=False)
            except _Stale:
                pass  # the agent closed it meanwhile: once more, on a new connection
        connection = self._connection(min(timeout, CONNECT_TIMEOUT))
        try:
            return self._exchange(connection, method, path, data, headers, timeout, keep=keep, fresh=True)
        except _Stale as stale:
            raise AgentUnreachable(f"agent {self.base_url}: {method} {path} failed ({stale.cause})") from None

    def _exchange(
        self,
        connection: http.client.HTTPConnection,
        method: str,
        path: str,
        data: bytes | None,
        headers: Mapping[str, str],
        timeout: float,
        *,
        keep: bool,
        fresh: bool,
    ) -> tuple[int, str]:
        """One request on `connection` (connected here when `fresh`), kept for the next call when both
        sides keep it; closed otherwise and on any failure. _Stale: a kept connection found closed."""
        kept = False
        try:
            if fresh:
                try:
                    connection.connect()
                except TimeoutError:
                    raise AgentUnreachable(
                        f"agent {self.base_url}: no connection within {min(timeout, CONNECT_TIMEOUT):g}s"
                    ) from None
            assert connection.sock is not None
            connection.sock.settimeout(timeout)
            connection.request(method, path, body=data, headers=dict(headers))
            response = connection.getresponse()
            text = response.read().decode(errors="replace")
            if keep and not response.will_close and self.connections is not None:
                self.connections.give(self._key, connection)
                kept = True
            return response.status, text
        except ssl.SSLCertVerificationError as exc:
            raise AgentUnreachable(
                f"agent {self.base_url}: its TLS certificate is not trusted ({exc.verify_message}): "
                "check that the client uses this cluster's CA and the member's name",
            ) from None
        except TimeoutError:
            raise AgentUnreachable(
                f"agent {self.base_url}: no answer to {method} {path} within {timeout:g}s"
            ) from None
        except _STALE as exc:
            raise _Stale(exc) from None
        except (OSError, http.client.HTTPException) as exc:
            raise AgentUnreachable(f"agent {self.base_url}: {method} {path} failed ({exc})") from None
        finally:
            if not kept:
                connection.close()


class _Stale(Exception):
    """A connection closed by the agent before it answered (the request was not taken)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _error_body(body: Any, status: int) -> ErrorBody:
    try:
        return ErrorBody.from_dict(body)
    except WireError:
        return ErrorBody(error=f"HTTP {status}")


class _NamedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to an address, verifying the certificate against another name (a pod IP and its member)."""

    def __init__(
        self, host: str, port: int, server_hostname: str, context: ssl.SSLContext, timeout: float
    ) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._server_hostname = server_hostname
        self._ssl_context = context

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._ssl_context.wrap_socket(self.sock, server_hostname=self._server_hostname)
