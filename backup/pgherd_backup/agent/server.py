"""The agent's HTTPS server.

  GET  /healthz /readyz /startupz    probes for the kubelet: no credential, no detail worth hiding
  GET  /status                       the operator only (bearer token)
  POST /actions/<name>               the operator only (bearer token)

Each connection gets its own thread, and its TLS handshake happens there (a slow or hostile client
never blocks the accept loop). A refused request (401/403) is answered before its body is read: it
changes nothing. Every error text goes through the credentials' redaction before it leaves.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg

from pgherd_backup.agent import actions, status
from pgherd_backup.agent.auth import Verdict, check_bearer
from pgherd_backup.agent.instance import Busy, Instance, Refused
from pgherd_backup.agent.wire import ACTIONS, ErrorBody, WireError
from pgherd_backup.errors import BackupError, UsageError

log = logging.getLogger("pgherd.agent")

MAX_BODY = 64 << 10
HANDSHAKE_TIMEOUT = 10.0
PROBES = ("/healthz", "/readyz", "/startupz")
# At stop, how long the requests being answered may take to get their answer out (a fence that let a
# terminating primary go on): the process exits after stop(), and its handler threads with it.
ANSWER_WAIT = 10.0


class AgentHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], instance: Instance, context: ssl.SSLContext | None) -> None:
        self.instance = instance
        self.context = context
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._answering = 0  # requests read and not answered yet
        self._answered = threading.Condition()
        super().__init__(address, _Handler)

    def begin_answer(self) -> None:
        with self._answered:
            self._answering += 1

    def end_answer(self) -> None:
        with self._answered:
            self._answering -= 1
            self._answered.notify_all()

    def wait_answered(self, timeout: float) -> bool:
        """Wait until no request is being answered (or `timeout`); whether none is."""
        with self._answered:
            return self._answered.wait_for(lambda: self._answering == 0, timeout)

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.context is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(HANDSHAKE_TIMEOUT)
        try:
            tls = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            log.debug("TLS handshake with %s failed: %s", client_address[0], exc)
            return
        try:
            super().finish_request(tls, client_address)
        finally:
            self.shutdown_request(tls)


class _Handler(BaseHTTPRequestHandler):
    server: AgentHTTPServer
    timeout = 30  # reading a request; an action's own duration is not bounded by it
    server_version = "pgherd-agent"
    sys_version = ""

    # -- routing -------------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._answer(self._get)

    def do_POST(self) -> None:
        self._answer(self._post)

    def _answer(self, handle: Callable[[], None]) -> None:
        """A request, counted from when it was read to its answer (see AgentServer.stop)."""
        self.server.begin_answer()
        try:
            handle()
        finally:
            self.server.end_answer()

    def _get(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in PROBES:
            self._probe(path)
        elif self._authorized():
            if path == "/status":
                self._send(200, status.gather(self.server.instance).to_dict())
            else:
                self._error(404, f"no such endpoint: GET {path}", "not-found")

    def _post(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in PROBES:
            self._error(405, f"{path} answers GET only", "bad-request")
            return
        if not self._authorized():
            return
        name = path.removeprefix("/actions/") if path.startswith("/actions/") else None
        if name not in ACTIONS:
            known = ", ".join(ACTIONS)
            self._error(404, f"no such action: POST {path} (actions: {known})", "not-found", name)
            return
        self._action(name)

    def do_PUT(self) -> None:
        self._error(405, "use GET for probes and /status, POST for /actions/<name>", "bad-request")

    do_DELETE = do_PATCH = do_PUT

    # -- probes --------------------------------------------------------------------------------------
    def _probe(self, path: str) -> None:
        inst = self.server.instance
        if path == "/healthz":
            ok, why = inst.healthy()
            self._send(200 if ok else 500, {"status": "ok" if ok else "unhealthy", "detail": why})
        elif path == "/readyz":
            ok, why = status.readiness(inst, status.query_live(inst))
            self._send(200 if ok else 503, {"status": "ready" if ok else "not ready", "detail": why})
        else:
            done = inst.boot_done.is_set()
            self._send(200 if done else 503, {"status": "started" if done else "starting"})

    # -- the operator's endpoints --------------------------------------------------------------------
    def _authorized(self) -> bool:
        inst = self.server.instance
        try:
            token = inst.credentials.token.value()
        except BackupError as exc:
            self._error(503, exc.message, "failed")
            return False
        verdict = check_bearer(self.headers.get("Authorization"), token)
        if verdict is Verdict.ALLOWED:
            return True
        if verdict is Verdict.MISSING:
            log.warning(
                "refused %s %s from %s: no credential", self.command, self.path, self.client_address[0]
            )
            self._error(401, "a bearer token is required (the operator's per-cluster token)", "unauthorized")
        else:
            log.warning(
                "refused %s %s from %s: wrong credential", self.command, self.path, self.client_address[0]
            )
            self._error(403, "the bearer token is not this cluster's operator token", "forbidden")
        return False

    def _action(self, name: str) -> None:
        inst = self.server.instance
        try:
            request = ACTIONS[name].from_dict(self._body())
        except WireError as exc:
            self._error(400, f"invalid {name} request: {exc}", "bad-request", name)
            return
        started = time.monotonic()
        try:
            result = actions.perform(inst, request)
        except Busy as exc:
            self._error(409, exc.message, "busy", name)
        except Refused as exc:
            self._error(409, exc.message, "refused", name)
        except UsageError as exc:
            self._error(400, exc.message, "bad-request", name)
        except BackupError as exc:
            inst.last_error = inst.credentials.redact(f"{name}: {exc.message}")
            self._error(500, exc.message, "failed", name)
        except psycopg.Error as exc:
            text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            self._error(500, f"PostgreSQL refused it: {text}", "failed", name)
        except Exception as exc:  # a bug: answer, log the traceback, keep serving
            log.exception("action %s failed unexpectedly", name)
            self._error(
                500, f"internal error ({type(exc).__name__}: {exc}); see the agent's log", "failed", name
            )
        else:
            if result.in_progress:  # accepted: it goes on in the background, followed in /status
                log.info("%s: %s", name, result.detail)
                self._send(202, result.to_dict())
                return
            log.info("%s done in %.1fs: %s", name, time.monotonic() - started, result.detail)
            self._send(200, result.to_dict())

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise WireError(f"the request body is larger than {MAX_BODY} bytes")
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise WireError(f"the body is not JSON ({exc})") from None

    # -- answers -------------------------------------------------------------------------------------
    def _error(self, code: int, message: str, reason: str, action: str | None = None) -> None:
        text = self.server.instance.credentials.redact(message)
        if code >= 500 or code == 409:
            log.warning("%s %s -> %d: %s", self.command, self.path, code, text)
        self._send(code, ErrorBody(error=text, reason=reason, action=action).to_dict())

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(code)
            if code == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="pgherd-agent"')
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(data)
        except OSError as exc:  # the caller went away (a timed-out client): the action is done anyway
            log.info("could not answer %s %s: %s", self.command, self.path, exc)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # requests that matter are logged above, without headers


# How often the serving thread looks for stop(): socketserver's default (0.5 s) made every stop of an
# agent (SIGTERM, a pod's deletion, `sandbox down`) wait up to half a second after PostgreSQL was down.
SHUTDOWN_POLL = 0.05


class AgentServer:
    """The server in a thread; `stop()` closes it."""

    def __init__(self, instance: Instance, host: str, port: int, context: ssl.SSLContext | None) -> None:
        self.httpd = AgentHTTPServer((host, port), instance, context)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def start(self) -> AgentServer:
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, args=(SHUTDOWN_POLL,), name="agent-http", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()  # no new connection
        if not self.httpd.wait_answered(ANSWER_WAIT):
            log.warning("stopping with requests still unanswered after %.0fs", ANSWER_WAIT)
        self.httpd.server_close()
