"""The actuator's Platform (pgherd/actuator.py) in the sandbox: a new member's process (its pod), each
member's agent at its process' port, long calls in the member's worker thread (LocalPlatform._spawn),
the rw record (what a pod label would say, for the engine's ClusterView.rw_member), a process killed to
fence an unanswering member, and the events log. The sandbox has no role labels.

The sandbox's tick is a thread of its own, running one action at a time through ``asyncio.run``: agent
calls are made in place (nothing else waits on that loop), and a spawned call's ``then`` runs in the
worker thread on a loop of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import actions as act
from pgherd_backup.agent.client import AgentClient
from pgherd_backup.agent.wire import ActionResult, Status

if TYPE_CHECKING:
    from pgherd.local.platform import LocalPlatform

log = logging.getLogger("pgherd.sandbox")

# An agent that does not answer a fence this long after its pod started is hung: its pod is killed.
# Before that it is starting (it listens within a second or two): never killed, asked again.
AGENT_START_GRACE = 30.0

T = TypeVar("T")


class SandboxMembers:
    def __init__(self, platform: LocalPlatform, spec: PostgresClusterSpec) -> None:
        self.platform = platform
        self.spec = spec

    @property
    def current_primary(self) -> str | None:
        return self.platform.current_primary

    def status(self, member: str) -> Status | None:
        return self.platform.status(member)

    def silent(self, member: str) -> bool:
        # Asked this pass and did not answer; a member not observed yet (a new platform) is asked.
        statuses = self.platform.observed_statuses()
        return member in statuses and statuses[member] is None

    def exists(self, member: str) -> bool:
        return self.platform.has(member)

    def reachable(self, member: str) -> bool:
        return self.platform.has(member) and self.platform.pod_running(member)

    def started(self, member: str) -> bool:
        # An agent process listens within a second or two: a running one is asked (and a starting one
        # spared by fence_unanswering's grace).
        return self.reachable(member)

    def busy(self, member: str) -> bool:
        return self.platform.busy(member)

    def upstream_address(self, member: str) -> str | None:
        return self.platform.address(member) if self.platform.has(member) else None

    def snapshot_of(self, backup: str | None, snapshot_id: str | None) -> str:
        return self.platform.backups.snapshot_id(backup, snapshot_id)

    async def add_member(self, action: act.CreateMember) -> bool:
        return self.platform.add_member(action, self.spec)

    async def call(self, member: str, what: str, fn: Callable[[AgentClient], T]) -> T:
        result = fn(self.platform.client(member))
        if isinstance(result, ActionResult) and result.changed:
            log.info("%s %s: %s", what, member, result.detail or "done")
        return result

    def spawn(
        self,
        member: str,
        what: str,
        fn: Callable[[AgentClient], Any],
        then: Callable[[Any], Awaitable[None]] | None = None,
    ) -> bool:
        client = self.platform.client(member)

        def work() -> None:
            result = fn(client)
            if isinstance(result, ActionResult) and result.changed:
                log.info("%s %s: %s", what, member, result.detail or "done")
            if then is not None:
                asyncio.run(_awaited(then(result)))

        return self.platform.spawn(member, what, work)

    def at_revision(self, member: str, revision: str) -> bool:
        status = self.platform.status(member)
        return status is not None and status.revision == revision

    async def roll(self, member: str, revision: str) -> bool:
        """The revision's parameters, read by the agent at its restart (and by a pod started again)."""
        self.platform.write_parameters(member, self.spec)
        return False

    async def restarted(self, member: str, revision: str) -> None:
        """The revision a pod of the member's started again gets (before its agent's next /status)."""
        record = self.platform.members.get(member)
        if record is not None:
            record.revision = revision
            record.save(self.platform.paths)

    async def route(self, member: str) -> bool:
        if self.platform.rw_member != member:
            log.info("primary is now %s", member)
        self.platform.point_rw_endpoint(member)
        return True

    async def unroute(self, member: str) -> None:
        if self.platform.rw_member == member:
            self.platform.point_rw_endpoint(None)

    async def mark_primary(self, member: str) -> None:
        pass  # no role labels: the rw record is the route itself

    async def unmark(self, member: str) -> None:
        pass

    async def fence_acknowledged(self, member: str, result: ActionResult) -> None:
        # Out of the rw record at once: a record only (the rw DSN finds the writable member by itself),
        # which the engine reads as "no member routed" until the next SetPrimary.
        await self.unroute(member)

    async def fence_unanswering(self, member: str, reason: str) -> None:
        started = self.platform.pods.started_at(member)
        if started is not None and time.time() - started < AGENT_START_GRACE:
            # Starting: it does not run PostgreSQL read-write on its own; asked again next tick.
            log.info("fencing %s: its agent is starting: asking again", member)
            return
        log.warning("fencing %s: its agent does not answer: killing its pod (%s)", member, reason)
        self.platform.pods.kill(member)

    async def event(self, event: act.RecordEvent) -> None:
        self.platform.record_event(event)


async def _awaited(awaitable: Awaitable[None]) -> None:
    await awaitable
