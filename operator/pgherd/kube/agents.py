"""The members' agents as the operator reaches them: HTTPS to each pod's IP, the cluster CA, the
operator's bearer token, and the certificate name checked (see builders.secrets.agent_server_hostname).

AgentClient is synchronous (http.client): calls run in threads so that one slow member never holds
the operator's event loop. Long actions (seed, rejoin, demote, unfence, restart, restore) run as one
background task per member: ``busy(member)`` says whether one is still running, and the engine simply
repeats a step until it observes its effect.

A fence the agent acknowledged is remembered (``remember_fence``) until the member answers again or
any other action is sent to it: while its agent does not answer (a terminating primary's agent exits
once fenced; its pod is made again, on another node for a drain) and its data volume is the same PVC,
the member is observed as that answer said: fenced, stopped, its WAL ending at the final LSN. The
fence is kept on that volume and an agent never starts PostgreSQL again without an order, so this is
what the member is; a drained primary's switchover goes on without waiting for a new pod's agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pgherd.agentview import STATUS_TIMEOUT
from pgherd.kube import metrics
from pgherd_backup.agent.client import AgentClient, AgentError, Connections, agent_context
from pgherd_backup.agent.isolation import IsolationOrder
from pgherd_backup.agent.wire import ActionResult, Status

log = logging.getLogger("pgherd.kube.agents")
T = TypeVar("T")


@dataclass(frozen=True)
class Fenced:
    """An acknowledged fence: the data volume (PVC uid) that keeps it, and the agent's answer."""

    volume_uid: str | None
    result: ActionResult

    def status(self, cluster: str, member: str) -> Status:
        return Status(
            member=member,
            cluster=cluster,
            postmaster="stopped",
            fenced=True,
            data_present=True,
            final_lsn=self.result.final_lsn,
            shutdown_clean=self.result.shutdown_clean,
            timeline=self.result.timeline,
        )


class Agents:
    """The agents of one cluster."""

    def __init__(
        self,
        cluster: str,
        *,
        token: str,
        ca_pem: str | None,
        server_hostname: Callable[[str], str | None],
        scheme: str = "https",
        port: int = 8008,
    ) -> None:
        self.cluster = cluster
        self.token = token
        self.scheme = scheme
        self.port = port
        self.server_hostname = server_hostname
        self._ca_file: Path | None = None
        if ca_pem is not None:
            folder = Path(tempfile.mkdtemp(prefix=f"pgherd-{cluster}-"))
            self._ca_file = folder / "ca.crt"
            self._ca_file.write_text(ca_pem)
        # One TLS context for every call to the cluster's agents (a client is made per call), built at
        # the first call: ~17 KB each, 34 MB for 2,000 clusters that have no member yet.
        self._context: ssl.SSLContext | None = None
        # The /status polls' connections, kept open between polls (a TLS handshake per poll cost more
        # CPU than the poll's answer).
        self._connections = Connections()
        # member -> (the address its long action went to, the task awaiting the answer)
        self._tasks: dict[str, tuple[str, asyncio.Task[None]]] = {}
        self._fenced: dict[str, Fenced] = {}

    def client(self, member: str, ip: str) -> AgentClient:
        host = f"[{ip}]" if ":" in ip else ip
        if self._context is None and self.scheme == "https":
            self._context = agent_context(self._ca_file)
        return AgentClient(
            f"{self.scheme}://{host}:{self.port}",
            ca_file=self._ca_file,
            context=self._context,
            token=self.token,
            server_hostname=self.server_hostname(member),
            connections=self._connections,
        )

    async def statuses(
        self,
        addresses: Mapping[str, str],
        timeout: float = STATUS_TIMEOUT,
        isolation: IsolationOrder | None = None,
    ) -> dict[str, Status | None]:
        """Every member's /status at once (with the isolation order, agent/isolation.py); None for one
        that did not answer within ``timeout``."""

        async def one(member: str, ip: str) -> Status | None:
            with metrics.agent_call("status") as outcome:
                try:
                    return await asyncio.to_thread(self.client(member, ip).status, timeout, isolation)
                except (AgentError, OSError) as exc:
                    outcome.failed(exc)
                    return None

        names = list(addresses)
        results = await asyncio.gather(*(one(n, addresses[n]) for n in names))
        return dict(zip(names, results, strict=True))

    async def call(self, member: str, ip: str, what: str, fn: Callable[[AgentClient], T]) -> T:
        """A short action, awaited (fence, promote, set-sync, drop-slot)."""
        if what != "fence":
            self._fenced.pop(member, None)  # it may act: a fence remembered says nothing any more
        with metrics.agent_call(what) as outcome:
            try:
                result = await asyncio.to_thread(fn, self.client(member, ip))
            except Exception as exc:
                outcome.failed(exc)
                raise
        if isinstance(result, ActionResult):
            _log(member, what, result)
        return result

    def busy(self, member: str, ip: str | None = None) -> bool:
        """A long action of the member's is awaited; with ``ip``, one sent to that address: an action sent
        to a pod that is gone (the call waits for its timeout) does not hold back the member's new pod."""
        running = self._tasks.get(member)
        if running is None or running[1].done():
            return False
        return ip is None or running[0] == ip

    def spawn(
        self,
        member: str,
        ip: str,
        what: str,
        fn: Callable[[AgentClient], Any],
        then: Callable[[Any], Awaitable[None]] | None = None,
    ) -> bool:
        """Start a long action in the background unless one already runs on the member; ``then`` is
        given its result once the agent answered (not when the call failed)."""
        if self.busy(member, ip):
            return False
        previous = self._tasks.pop(member, None)
        if previous is not None and not previous[1].done():
            # Sent to a pod that is gone: its answer no longer matters (the thread ends at its timeout).
            log.info("%s of %s: its pod at %s is gone, the answer is not awaited", what, member, previous[0])
            previous[1].cancel()
        self._fenced.pop(member, None)
        client = self.client(member, ip)

        async def run() -> None:
            try:
                with metrics.agent_call(what) as outcome:
                    try:
                        result = await asyncio.to_thread(fn, client)
                    except Exception as exc:
                        outcome.failed(exc)
                        raise
                if isinstance(result, ActionResult):
                    _log(member, what, result)
                if then is not None:
                    await then(result)
            except AgentError as exc:
                log.warning("%s of %s failed: %s", what, member, exc)
            except Exception:
                log.exception("%s of %s failed", what, member)

        self._tasks[member] = (ip, asyncio.get_running_loop().create_task(run(), name=f"{what} {member}"))
        return True

    def remember_fence(self, member: str, volume_uid: str | None, result: ActionResult) -> None:
        if volume_uid is not None:
            self._fenced[member] = Fenced(volume_uid, result)

    def with_fences(
        self, statuses: Mapping[str, Status | None], volumes: Mapping[str, str | None]
    ) -> dict[str, Status | None]:
        """``statuses`` with each remembered fence standing for a member that did not answer, while its
        data volume (``volumes``: member -> the uid of its PVC) is the one that keeps the fence. A member
        that answers, or whose volume is another (or gone), is forgotten: its own agent tells."""
        out = dict(statuses)
        for member, fenced in list(self._fenced.items()):
            if out.get(member) is not None or volumes.get(member) != fenced.volume_uid:
                del self._fenced[member]
                continue
            out[member] = fenced.status(self.cluster, member)
        return out

    async def close(self) -> None:
        for _, task in self._tasks.values():
            task.cancel()
        for _, task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):  # closing: results no longer matter
                await task
        self._tasks.clear()
        self._connections.close()
        if self._ca_file is not None:
            self._ca_file.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self._ca_file.parent.rmdir()


def _log(member: str, what: str, result: ActionResult) -> None:
    if result.changed:
        log.info("%s %s: %s", what, member, result.detail or "done")
