"""The agent's HTTPS server.

  GET  /healthz /readyz /startupz    probes for the kubelet: no credential, no detail worth hiding
  GET  /status                       the operator only (bearer token)
  POST /actions/<name>               the operator only (bearer token)

One event loop, in a thread of its own, holds every connection as a coroutine: its TLS handshake and
the reading of its request each have a deadline, and a slow or hostile client holds no thread. A GET
over HTTP/1.1 keeps its connection open (KEEPALIVE_IDLE for the next request): the operator polls
/status every few seconds, and a TLS handshake per poll cost it more than the poll itself. The
probes are answered in the loop from the agent's cached view of PostgreSQL (view.py): no PostgreSQL
session per probe. Only the operator's requests, once their credential is checked, run in threads, at
most OPERATOR_THREADS at once (503 beyond). Connections beyond a limit (in all, and from one address)
are closed before their handshake. A refused request (401/403) is answered before its body is read: it
changes nothing. Every error text goes through the credentials' redaction before it leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import io
import json
import logging
import resource
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

import psycopg

from pgherd_backup.agent import actions, status
from pgherd_backup.agent.auth import Verdict, check_bearer
from pgherd_backup.agent.instance import Busy, Instance, Refused
from pgherd_backup.agent.isolation import ISOLATION_HEADER, IsolationOrder
from pgherd_backup.agent.view import View
from pgherd_backup.agent.wire import ACTIONS, ErrorBody, WireError
from pgherd_backup.errors import BackupError, UsageError

log = logging.getLogger("pgherd.agent")

MAX_BODY = 64 << 10
MAX_HEAD = 64 << 10  # request line and headers
HANDSHAKE_TIMEOUT = 5.0
REQUEST_TIMEOUT = 10.0  # reading a request, head and body; an action's own duration is not bounded by it
# A kept connection's wait for its next request; longer than the client's own reuse limit
# (client.KEEPALIVE_REUSE), so that a client does not send into a connection being closed.
KEEPALIVE_IDLE = 10.0
WRITE_TIMEOUT = 10.0  # a client that does not read its answer
CLOSE_TIMEOUT = 2.0  # its TLS close_notify
PROBES = ("/healthz", "/readyz", "/startupz")
PROBE_WAIT = 1.0  # how long a probe waits for the view being refreshed (the kubelet's timeout is 2 s)
READY_STALE = 5.0  # /readyz: an older view (PostgreSQL slow to answer) is no answer
HEALTH_STUCK = 60.0  # /healthz: a view this old means the agent itself is stuck
OPERATOR_THREADS = 16
MAX_CONNECTIONS = 1024  # fewer when the file descriptor limit is low (half of it)
BACKLOG = 1024
# At stop, how long the requests being answered may take to get their answer out (a fence that let a
# terminating primary go on): the process exits after stop(), and the requests' threads with it.
ANSWER_WAIT = 10.0


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    target: str
    headers: http.client.HTTPMessage
    client: str
    deadline: float  # loop time by which its body must have come
    version: str = "HTTP/1.0"

    @property
    def keeps_alive(self) -> bool:
        """A GET over HTTP/1.1, with no body, that did not ask to close: its connection stays open after
        the answer (a body, never read for a GET, would be taken for the next request)."""
        connection = (self.headers.get("Connection") or "").strip().lower()
        bodiless = (
            self.headers.get("Content-Length") in (None, "0") and "Transfer-Encoding" not in self.headers
        )
        return self.method == "GET" and self.version == "HTTP/1.1" and connection != "close" and bodiless


Answer = tuple[int, dict[str, Any]]


class _Refusal(Exception):
    """A request answered with an error without going further."""

    def __init__(self, code: int, message: str, reason: str, action: str | None = None) -> None:
        super().__init__(message)
        self.answer = (code, message, reason, action)


def connection_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else max(16, min(MAX_CONNECTIONS, soft // 2))


def listening_socket(host: str, port: int) -> socket.socket:
    """A non-blocking socket listening on host:port (IPv6 when the host is), for an event loop."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class AgentServer:
    """The server's event loop in a thread; `stop()` closes it."""

    def __init__(
        self,
        instance: Instance,
        host: str,
        port: int,
        context: ssl.SSLContext | None,
        view: View | None = None,
    ) -> None:
        self.instance = instance
        self.context = context
        self.view = view or View(instance)
        self.max_connections = connection_limit()
        # Half from one address: a flood of hundreds at once from one pod, or from the node the kubelet
        # probes from, still leaves room for everyone else.
        self.max_per_client = max(4, self.max_connections // 2)
        self._sock = listening_socket(host, port)
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._stopping: asyncio.Event | None = None
        self._connections: Counter[str] = Counter()  # open connections by client address
        self._open: dict[asyncio.Task[None], asyncio.StreamWriter] = {}  # each connection's task
        self._dropped = 0  # connections closed over the limit since the last warning
        self._dropped_logged = 0.0
        self._threads = threading.BoundedSemaphore(OPERATOR_THREADS)
        self._answering = 0  # requests read and not answered yet
        self._answered = threading.Condition()

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    # -- life -----------------------------------------------------------------------------------------
    def start(self) -> AgentServer:
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="agent-http", daemon=True)
        self._thread.start()
        started.wait(10)
        return self

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve(started))
        finally:
            self._loop.close()

    async def _serve(self, started: threading.Event) -> None:
        self._stopping = asyncio.Event()
        self._server = await asyncio.start_server(
            self._connection, sock=self._sock, limit=MAX_HEAD, backlog=BACKLOG
        )
        started.set()
        await self._stopping.wait()
        self._server.close()
        for task, writer in list(self._open.items()):  # what stop() did not wait for: cut
            writer.transport.abort()
            task.cancel()
        if self._open:
            await asyncio.wait(list(self._open), timeout=1.0)

    async def _stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()

    def stop(self) -> None:
        """No new connection; the requests being answered get up to ANSWER_WAIT; then the loop ends."""
        if self._thread is None or not self._thread.is_alive():
            self._sock.close()
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._stop_listening(), self._loop).result(5)
        if not self._wait_answered(ANSWER_WAIT):
            log.warning("stopping with requests still unanswered after %.0fs", ANSWER_WAIT)
        if self._stopping is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(5)

    def _begin_answer(self) -> None:
        with self._answered:
            self._answering += 1

    def _end_answer(self) -> None:
        with self._answered:
            self._answering -= 1
            self._answered.notify_all()

    def _wait_answered(self, timeout: float) -> bool:
        """Wait until no request is being answered (or `timeout`); whether none is."""
        with self._answered:
            return self._answered.wait_for(lambda: self._answering == 0, timeout)

    # -- a connection ---------------------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        client = str(peer[0]) if peer else "?"
        if sum(self._connections.values()) >= self.max_connections or (
            self._connections[client] >= self.max_per_client
        ):
            self._drop(client)
            writer.transport.abort()
            return
        self._connections[client] += 1
        task = asyncio.current_task()
        assert task is not None
        self._open[task] = writer
        try:
            await self._exchange(reader, writer, client)
        except Exception:  # a bug: log it, close this connection, keep serving
            log.exception("answering %s failed unexpectedly", client)
        finally:
            self._open.pop(task, None)
            self._connections[client] -= 1
            if self._connections[client] <= 0:
                del self._connections[client]
            await _close(writer)

    def _drop(self, client: str) -> None:
        self._dropped += 1
        now = time.monotonic()
        if now - self._dropped_logged >= 60:
            log.warning(
                "closed %d connection(s) over the limit (%d open, %d from %s; at most %d, %d per address)",
                self._dropped,
                sum(self._connections.values()),
                self._connections[client],
                client,
                self.max_connections,
                self.max_per_client,
            )
            self._dropped, self._dropped_logged = 0, now

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: str
    ) -> None:
        if self.context is not None:
            try:
                await writer.start_tls(self.context, ssl_handshake_timeout=HANDSHAKE_TIMEOUT)
            except (OSError, ssl.SSLError, TimeoutError) as exc:
                log.debug("TLS handshake with %s failed: %s", client, exc)
                return
        idle: float | None = None  # the first request: head and body within REQUEST_TIMEOUT
        while await self._one_request(reader, writer, client, idle):
            idle = KEEPALIVE_IDLE

    async def _one_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: str, idle: float | None
    ) -> bool:
        """Read and answer one request; whether the connection stays open. `idle`: on a kept connection,
        how long the next request may take to begin (its body then has REQUEST_TIMEOUT)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (REQUEST_TIMEOUT if idle is None else idle)
        try:
            async with asyncio.timeout_at(deadline):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            await self._send(writer, None, 431, _error_body(self.instance, "the request head is too large"))
            return False
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            return False  # gone, too slow, or a kept connection left idle: no request
        if idle is not None:
            deadline = loop.time() + REQUEST_TIMEOUT
        try:
            request = _parse(head, client, deadline)
        except ValueError as exc:
            await self._send(writer, None, 400, _error_body(self.instance, f"bad request: {exc}"))
            return False
        self._begin_answer()
        try:
            code, body = await self._answer(request, reader)
            keep = request.keeps_alive and code < 400 and not self._closing()
            return await self._send(writer, request, code, body, keep=keep) and keep
        finally:
            self._end_answer()

    def _closing(self) -> bool:
        """The agent stops (no longer listening): answer, then close; stop() waits for answers only."""
        return self._server is None or not self._server.is_serving()

    # -- routing --------------------------------------------------------------------------------------
    async def _answer(self, request: Request, reader: asyncio.StreamReader) -> Answer:
        try:
            if request.method == "GET":
                if request.path in PROBES:
                    return await self._probe(request.path)
                self._authorize(request)
                if request.path == "/status":
                    return await self._in_thread(request, None, self._status)
                raise _Refusal(404, f"no such endpoint: GET {request.path}", "not-found")
            if request.method == "POST":
                return await self._post(request, reader)
            if request.method in ("PUT", "DELETE", "PATCH"):
                raise _Refusal(405, "use GET for probes and /status, POST for /actions/<name>", "bad-request")
            raise _Refusal(501, f"unsupported method {request.method!r}", "bad-request")
        except _Refusal as refusal:
            code, message, reason, action = refusal.answer
            return self._error(request, code, message, reason, action)

    async def _post(self, request: Request, reader: asyncio.StreamReader) -> Answer:
        path = request.path
        if path in PROBES:
            raise _Refusal(405, f"{path} answers GET only", "bad-request")
        self._authorize(request)
        name = path.removeprefix("/actions/") if path.startswith("/actions/") else None
        if name is None or name not in ACTIONS:
            known = ", ".join(ACTIONS)
            raise _Refusal(404, f"no such action: POST {path} (actions: {known})", "not-found", name)
        try:
            order = ACTIONS[name].from_dict(await _body(request, reader))
        except WireError as exc:
            raise _Refusal(400, f"invalid {name} request: {exc}", "bad-request", name) from None
        return await self._in_thread(request, name, lambda: self._act(request, name, order))

    # -- probes: in the loop, from the view -------------------------------------------------------------
    async def _probe(self, path: str) -> Answer:
        inst = self.instance
        if path == "/startupz":
            done = inst.boot_done.is_set()
            return (200 if done else 503), {"status": "started" if done else "starting"}
        sample = await self.view.aget(PROBE_WAIT)
        if path == "/healthz":
            if sample is None or sample.age > HEALTH_STUCK:
                ok, why = False, "the agent has no recent view of its PostgreSQL"
            else:
                ok, why = sample.healthy, sample.health_detail
            return (200 if ok else 500), {"status": "ok" if ok else "unhealthy", "detail": why}
        if sample is None or sample.age > READY_STALE or sample.key != self.view.key():
            ready, why = False, "PostgreSQL's state is being read"
        else:
            ready, why = sample.serving, sample.serving_detail
        return (200 if ready else 503), {"status": "ready" if ready else "not ready", "detail": why}

    # -- the operator's endpoints: in threads, once authorized -----------------------------------------
    def _authorize(self, request: Request) -> None:
        try:
            token = self.instance.credentials.token.value()
        except BackupError as exc:
            raise _Refusal(503, exc.message, "failed") from None
        verdict = check_bearer(request.headers.get("Authorization"), token)
        if verdict is Verdict.ALLOWED:
            self.instance.isolation.heard_operator(
                IsolationOrder.parse(request.headers.get(ISOLATION_HEADER))
            )
            return
        how = "no credential" if verdict is Verdict.MISSING else "wrong credential"
        log.warning("refused %s %s from %s: %s", request.method, request.target, request.client, how)
        if verdict is Verdict.MISSING:
            raise _Refusal(
                401, "a bearer token is required (the operator's per-cluster token)", "unauthorized"
            )
        raise _Refusal(403, "the bearer token is not this cluster's operator token", "forbidden")

    async def _in_thread(self, request: Request, name: str | None, work: Callable[[], Answer]) -> Answer:
        """`work` in a thread of its own, within OPERATOR_THREADS (503 beyond: nothing was done)."""
        if not self._threads.acquire(blocking=False):
            return self._error(
                request,
                503,
                f"the agent is answering {OPERATOR_THREADS} requests already: nothing was done; ask again",
                "busy",
                name,
            )
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Answer] = loop.create_future()

        def run() -> None:
            try:
                result = work()
            except Exception as exc:  # a bug: answer, log the traceback, keep serving
                log.exception("%s %s failed unexpectedly", request.method, request.path)
                result = self._error(
                    request,
                    500,
                    f"internal error ({type(exc).__name__}: {exc}); see the agent's log",
                    "failed",
                    name,
                )
            finally:
                self._threads.release()
            with contextlib.suppress(RuntimeError):  # the loop ended (the agent stops)
                loop.call_soon_threadsafe(_settle, answer, result)

        threading.Thread(target=run, name=f"agent-{name or 'status'}", daemon=True).start()
        return await answer

    def _status(self) -> Answer:
        return 200, status.gather(self.instance).to_dict()

    def _act(self, request: Request, name: str, order: Any) -> Answer:
        inst = self.instance
        started = time.monotonic()
        try:
            result = actions.perform(inst, order)
        except Busy as exc:
            return self._error(request, 409, exc.message, "busy", name)
        except Refused as exc:
            return self._error(request, 409, exc.message, "refused", name)
        except UsageError as exc:
            return self._error(request, 400, exc.message, "bad-request", name)
        except BackupError as exc:
            inst.last_error = inst.credentials.redact(f"{name}: {exc.message}")
            return self._error(request, 500, exc.message, "failed", name)
        except psycopg.Error as exc:
            text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            return self._error(request, 500, f"PostgreSQL refused it: {text}", "failed", name)
        if result.in_progress:  # accepted: it goes on in the background, followed in /status
            log.info("%s: %s", name, result.detail)
            return 202, result.to_dict()
        log.info("%s done in %.1fs: %s", name, time.monotonic() - started, result.detail)
        return 200, result.to_dict()

    # -- answers --------------------------------------------------------------------------------------
    def _error(
        self, request: Request, code: int, message: str, reason: str, action: str | None = None
    ) -> Answer:
        body = _error_body(self.instance, message, reason, action)
        if (code >= 500 and code != 501) or code == 409:  # not every odd method a stranger tries
            log.warning("%s %s -> %d: %s", request.method, request.target, code, body["error"])
        return code, body

    async def _send(
        self,
        writer: asyncio.StreamWriter,
        request: Request | None,
        code: int,
        body: dict[str, Any],
        *,
        keep: bool = False,
    ) -> bool:
        """Write the answer; whether it went out. `keep`: the connection stays open for another request."""
        data = json.dumps(body).encode()
        lines = [
            f"HTTP/1.{1 if keep else 0} {code} {HTTPStatus(code).phrase}",
            "Server: pgherd-agent",
            f"Date: {formatdate(usegmt=True)}",
            "Content-Type: application/json",
            f"Content-Length: {len(data)}",
            "Cache-Control: no-store",
            "Connection: keep-alive" if keep else "Connection: close",
        ]
        if code == 401:
            lines.append('WWW-Authenticate: Bearer realm="pgherd-agent"')
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data)
            async with asyncio.timeout(WRITE_TIMEOUT):
                await writer.drain()
        except (OSError, TimeoutError) as exc:  # the caller went away (a timed-out client): done anyway
            what = f"{request.method} {request.target}" if request is not None else "a bad request"
            log.info("could not answer %s: %s", what, exc or type(exc).__name__)
            return False
        return True


def _settle(future: asyncio.Future[Answer], answer: Answer) -> None:
    if not future.done():  # not cancelled (the agent stops)
        future.set_result(answer)


def _error_body(
    inst: Instance, message: str, reason: str = "bad-request", action: str | None = None
) -> dict[str, Any]:
    return ErrorBody(error=inst.credentials.redact(message), reason=reason, action=action).to_dict()


def _parse(head: bytes, client: str, deadline: float) -> Request:
    """The request line and headers (what http.server accepts, CRLF line ends)."""
    line, _, rest = head.partition(b"\r\n")
    words = line.decode("latin-1").split()
    if len(words) != 3 or not words[2].startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x request line: {line[:100]!r}")
    method, target, _ = words
    try:
        headers = http.client.parse_headers(io.BytesIO(rest))
    except http.client.HTTPException as exc:
        raise ValueError(str(exc)) from None
    return Request(method, target.split("?", 1)[0], target, headers, client, deadline, words[2])


async def _body(request: Request, reader: asyncio.StreamReader) -> Any:
    """The JSON body ({} when none), read by the request's deadline; WireError when it is not."""
    try:
        length = int(request.headers.get("Content-Length") or 0)
    except ValueError:
        raise WireError("the Content-Length header is not a number") from None
    if length < 0:
        raise WireError("the Content-Length header is negative")
    if length > MAX_BODY:
        raise WireError(f"the request body is larger than {MAX_BODY} bytes")
    try:
        async with asyncio.timeout_at(request.deadline):
            raw = await reader.readexactly(length) if length else b""
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        raise WireError(f"the request body did not come within {REQUEST_TIMEOUT:.0f}s") from None
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise WireError(f"the body is not JSON ({exc})") from None


async def _close(writer: asyncio.StreamWriter) -> None:
    """Close a connection; one whose TLS close does not end in time is cut."""
    writer.close()
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT):
            await writer.wait_closed()
    except (OSError, TimeoutError, ssl.SSLError):
        writer.transport.abort()
    except asyncio.CancelledError:
        writer.transport.abort()
        raise
