"""The engine's member actions carried out once, for every platform: which agent call each makes, in
which order, behind which guards, and what is told of it. Each platform (kube/acting.py, the sandbox's
local/acting.py) implements ``Platform``: its agents' door and its own effects (Kubernetes' pods, role
labels and -rw EndpointSlice; the sandbox's processes and rw record).

Async, because the Kubernetes operator is: its effects are API calls on kopf's event loop, and an
actuator that blocked would hold every cluster's reconciliation. The agent client is synchronous
(http.client); a platform runs its calls off its loop (Kubernetes in threads) or in place (the
sandbox, whose tick is a thread of its own and runs each action through ``asyncio.run``). Long agent
actions (seed, rejoin, demote, unfence, restart, upgrade) are spawned: the platform keeps one per
member (``busy``) and the engine repeats a step until it observes its effect, so every action here is
idempotent.

A new member is the platform's (``add_member``: a pod, a process, its agent waiting with an empty
volume) and then the actuator's: the agent's seed, once it answers for that empty volume. The actions
whose work is the platform's own (deleting members, backups, restores, Jobs) stay with each platform.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from pgherd.engine import actions as act
from pgherd_backup.agent.client import AgentActionError, AgentClient, AgentError, AgentUnreachable
from pgherd_backup.agent.wire import ActionResult, FenceRequest, Status

log = logging.getLogger("pgherd.actuator")

# A fence answers once PostgreSQL stopped (CHECKPOINT and a fast shutdown): bounded, but not quick.
FENCE_TIMEOUT = 30.0

T = TypeVar("T")


class Platform(Protocol):
    """What the actuator needs of a platform: its view of the members, its door to their agents, and
    its own effects."""

    @property
    def current_primary(self) -> str | None:
        """The primary the cluster records (an Unfence starts only that one read-write)."""

    def status(self, member: str) -> Status | None:
        """The member's /status as this pass observed it (None: no answer, or not observed)."""

    def silent(self, member: str) -> bool:
        """Its started agent was asked for its /status this pass and did not answer."""

    def exists(self, member: str) -> bool:
        """The platform has the member (its pod, its process' record), running or not."""

    def reachable(self, member: str) -> bool:
        """The member's agent has an address to call (a pod with an IP; a running process)."""

    def started(self, member: str) -> bool:
        """Its agent runs past its start (Kubernetes: the container's startup probe passed)."""

    def busy(self, member: str) -> bool:
        """A long action spawned for the member (at its present address) is still awaited."""

    def upstream_address(self, member: str) -> str | None:
        """host:port of the member's PostgreSQL, as an agent names its upstream."""

    def snapshot_of(self, backup: str | None, snapshot_id: str | None) -> str:
        """The snapshot a seed restores, as the agents find it in the store: ``snapshot_id``, Backup
        ``backup``'s id, or ``latest`` (neither). ValueError, saying why, for a Backup this platform does
        not have, one without a completed snapshot, or an Expired one."""

    async def add_member(self, action: act.CreateMember) -> bool:
        """The platform's part of a new member: Kubernetes' StatefulSet scaled to it, the sandbox's process
        started (an agent that waits for its seed, as any pod started again does). True when it did that
        now, False when the member is there already."""

    async def call(self, member: str, what: str, fn: Callable[[AgentClient], T]) -> T:
        """A short agent call, awaited (fence, promote, set-sync, drop-slot)."""

    def spawn(
        self,
        member: str,
        what: str,
        fn: Callable[[AgentClient], Any],
        then: Callable[[Any], Awaitable[None]] | None = None,
    ) -> bool:
        """A long agent call in the background, unless the member is busy; ``then`` gets its answer."""

    def at_revision(self, member: str, revision: str) -> bool:
        """The member runs the revision's template (its pod's label; the revision its agent reports)."""

    async def roll(self, member: str, revision: str) -> bool:
        """The platform's part of restarting the member at ``revision``: True when the platform
        restarts it itself (a new pod), False when its agent is to restart PostgreSQL in place (the
        revision's parameters written first)."""

    async def restarted(self, member: str, revision: str) -> None:
        """The member's agent restarted it at ``revision`` (the platform's record of it)."""

    async def route(self, member: str) -> bool:
        """Point -rw at the member (once, when it points elsewhere); False when it has no address yet."""

    async def unroute(self, member: str) -> None:
        """Take the member out of -rw when it is there."""

    async def mark_primary(self, member: str) -> None:
        """The role marks (Kubernetes' pod labels) name the member the primary, and no other."""

    async def unmark(self, member: str) -> None:
        """The member carries no role mark: it serves neither -ro nor -rw."""

    async def fence_acknowledged(self, member: str, result: ActionResult) -> None:
        """The platform's part once the agent fenced the member."""

    async def fence_unanswering(self, member: str, reason: str) -> None:
        """Stop by force a member whose started agent does not answer (delete its pod, kill its
        process), so that nothing of it writes."""

    async def event(self, event: act.RecordEvent) -> None:
        """Tell it on the cluster."""


async def create_member(p: Platform, action: act.CreateMember) -> None:
    """The platform's part first (a pod, a process); then, once the member's agent answers for an empty
    volume and carries out nothing, its seed: initdb, pg_basebackup from ``source``, or a snapshot (a
    standby of ``upstream``, or without one recovered to ``target`` and promoted). Both platforms report
    such a member as not existing yet, so the engine issues CreateMember until its data is seen: a member
    whose pod started again before its seed completed is seeded again. The agent seeds an empty data
    directory only: one that holds anything is never seeded over."""
    if await p.add_member(action):
        return  # its agent is seeded once it answers (the engine asks again)
    member = action.member
    status = p.status(member)
    if status is None or status.data_present or status.action is not None:
        return
    if not p.reachable(member) or p.busy(member):
        return
    upstream = None
    if action.seed is act.Seed.BASEBACKUP:
        source = action.source or action.upstream
        upstream = p.upstream_address(source) if source else None
        if upstream is None:
            return
    elif action.seed is act.Seed.SNAPSHOT and action.upstream:
        upstream = p.upstream_address(action.upstream)
        if upstream is None:
            return  # never a recovery that promotes in place of a standby of it
    snapshot = None
    if action.seed is act.Seed.SNAPSHOT:
        try:
            snapshot = p.snapshot_of(action.source, action.snapshot_id)
        except ValueError as exc:
            log.warning("not seeding %s from a snapshot: %s", member, exc)
            return
    p.spawn(
        member,
        "seed",
        lambda c: c.seed(
            action.seed.value,
            upstream=upstream,
            snapshot=snapshot,
            target=action.target,
            reason=action.reason,
        ),
    )


async def fence(p: Platform, action: act.Fence) -> None:
    """The agent stops PostgreSQL and keeps it stopped; -rw keeps its address meanwhile (connections to
    a stopped PostgreSQL are refused at once, and the promotion's route then moves it in one change).
    A member whose started agent does not answer leaves -rw first (its address may stop answering at
    all: clients would wait for a timeout) and is stopped by the platform. A member whose agent has not
    started is left alone: nothing there runs PostgreSQL read-write, and its agent soon reports the
    fence it keeps on its volume."""
    member = action.member
    if not p.started(member):
        await _out_of_service(p, member)
        return
    if p.silent(member):
        # It did not answer this pass's observation (cut off, hung): asking it again would only wait out
        # the connection timeout before the same stop.
        await _out_of_service(p, member)
        await p.fence_unanswering(member, action.reason)
        return
    try:
        result = await p.call(
            member, "fence", lambda c: c.act(FenceRequest(reason=action.reason), timeout=FENCE_TIMEOUT)
        )
    except AgentUnreachable as exc:
        log.warning("fencing %s: its agent does not answer (%s)", member, exc)
        await _out_of_service(p, member)
        await p.fence_unanswering(member, action.reason)
        return
    await p.fence_acknowledged(member, result)
    if result.changed:
        await p.event(act.RecordEvent("Fenced", f"{member} {_fenced(result)}: {action.reason}"))
    await p.unmark(member)


async def _out_of_service(p: Platform, member: str) -> None:
    await p.unroute(member)
    await p.unmark(member)


def _fenced(result: ActionResult) -> str:
    """A fence as the agent answered it: how PostgreSQL stopped, and where its WAL ends."""
    how = "stopped and fenced" if result.detail == "stopped" else "fenced (PostgreSQL was not running)"
    if result.shutdown_clean is not None:
        how += ", after a clean shutdown" if result.shutdown_clean else ", after an unclean stop"
    if result.final_lsn is not None:
        how += f"; its WAL ends at {result.final_lsn}"
        how += f" on timeline {result.timeline}" if result.timeline is not None else ""
    return how


def _spawn(
    p: Platform,
    member: str,
    what: str,
    fn: Callable[[AgentClient], Any],
    then: Callable[[Any], Awaitable[None]] | None = None,
) -> None:
    if p.reachable(member):
        p.spawn(member, what, fn, then)


async def demote(p: Platform, action: act.Demote) -> None:
    # Read-only from now on: out of -rw first (a client there would meet a read-only server, not a
    # refusal), as the fence of an unanswering member; the promotion routes -rw again.
    await p.unroute(action.member)
    _spawn(p, action.member, "read-only start", lambda c: c.demote(reason=action.reason))


async def unfence(p: Platform, action: act.Unfence) -> None:
    primary = action.member == p.current_primary  # read-write only for the recorded primary
    _spawn(p, action.member, "unfence", lambda c: c.unfence(primary=primary, reason=action.reason))


async def promote(p: Platform, action: act.Promote) -> None:
    member = action.member
    if not p.reachable(member) or p.busy(member):
        return
    result = await p.call(member, "promote", lambda c: c.promote(reason=action.reason))
    # Its agent answers once it is writable: -rw routes there now rather than after the next observation
    # (the engine's SetPrimary then finds it done and moves the role marks).
    await p.route(member)
    # A new primary is the engine's own Event once it sees it (Promoted, engine/narrate.py); the recorded
    # primary promoted again in place (it came back read-only) changes no record: told here.
    if result.changed and member == p.current_primary:
        await p.event(act.RecordEvent("Promoted", f"{member} promoted in place: {action.reason}"))


async def set_primary(p: Platform, action: act.SetPrimary) -> None:
    """-rw names the new primary in one change, then the role marks follow (never two primaries)."""
    if await p.route(action.member):
        await p.mark_primary(action.member)


async def restart_member(p: Platform, action: act.RestartMember) -> None:
    """The member at a new revision: restarted by its platform (a new pod) or by its agent; a planned
    primary restart then starts read-write on the engine's explicit order (an agent only ever starts a
    restarted member read-only on its own). A fenced member is never restarted by its agent here: it
    starts again only on Unfence or Demote."""
    member = action.member
    if not p.exists(member) or p.busy(member):
        return
    status = p.status(member)
    fenced = status is not None and status.fenced
    if not p.at_revision(member, action.revision):
        if await p.roll(member, action.revision) or fenced or not p.reachable(member):
            return
        primary, revision = action.primary, action.revision

        async def restarted(_: object) -> None:
            await p.restarted(member, revision)

        _spawn(
            p,
            member,
            "restart",
            lambda c: c.restart(revision, primary=primary, reason=action.reason),
            then=restarted,
        )
        return
    if not action.primary or status is None or fenced or not p.reachable(member):
        return
    if status.role == "primary" or status.action is not None:
        return
    _spawn(
        p,
        member,
        "restart as primary",
        lambda c: c.restart(action.revision, primary=True, reason=action.reason),
    )


async def set_sync(p: Platform, action: act.SetSynchronousStandbys) -> None:
    member = action.member
    value = action.config.render()
    status = p.status(member)
    if status is not None and status.synchronous_standby_names == value:
        return  # in force: the engine repeats a step until it observes it
    if not p.reachable(member) or p.busy(member):
        # Not set: a failure, so that the pass stops here (a Promote after it must not run without it).
        why = "its agent is busy with another action" if p.reachable(member) else "it has no address"
        raise AgentError(f"synchronous_standby_names not set on {member}: {why}; asked again")
    await p.call(member, "set-sync", lambda c: c.set_sync(value, reason=action.reason))


async def rejoin(p: Platform, action: act.Rejoin) -> None:
    if action.member == action.upstream:
        log.error("refusing to rejoin %s to itself (%s)", action.member, action.reason)
        return
    upstream = p.upstream_address(action.upstream)
    if upstream is None:
        return

    async def rejoined(result: object) -> None:
        if isinstance(result, ActionResult) and result.changed:
            message = f"{action.member} follows {action.upstream} ({result.detail}): {action.reason}"
            await p.event(act.RecordEvent("MemberRejoined", message))

    _spawn(
        p,
        action.member,
        "rejoin",
        lambda c: c.rejoin(
            upstream,
            reclone=action.reclone,
            reason=action.reason,
            ahead_of_promotion=action.ahead_of_promotion,
        ),
        then=rejoined,
    )


async def drop_slot(p: Platform, action: act.DropReplicationSlot) -> None:
    if not p.reachable(action.member):
        return
    try:
        await p.call(
            action.member,
            "drop-slot",
            lambda c: c.drop_slot(action.slot.replace("-", "_"), reason=action.reason),
        )
    except AgentError as exc:  # refused while a standby still uses it: asked again
        log.info("drop-slot %s on %s: %s", action.slot, action.member, exc)


async def check_upgrade(p: Platform, action: act.CheckUpgrade) -> None:
    _upgrade(p, action.member, action.major, action.request_id, check=True, reason=action.reason)


async def upgrade_member(p: Platform, action: act.UpgradeMember) -> None:
    _upgrade(p, action.member, action.major, action.request_id, check=False, reason=action.reason)


def _upgrade(p: Platform, member: str, major: int, request_id: str, *, check: bool, reason: str) -> None:
    """The agent's upgrade or its check (agent/upgrading.py): answered at once, followed in /status;
    an order it carries out or ended already (its request id) is not sent again."""
    status = p.status(member)
    if status is None or not p.reachable(member) or p.busy(member):
        return
    ended, progress = status.last_action, status.action_progress
    if (ended is not None and ended.request_id == request_id) or (
        progress is not None and progress.request_id == request_id
    ):
        return

    def call(client: AgentClient) -> ActionResult | AgentActionError:
        try:
            return client.upgrade(major, check=check, request_id=request_id, reason=reason)
        except AgentActionError as exc:
            if exc.status != 500:
                raise  # refused or busy: asked again
            return exc  # it ran and failed: its lastAction says how

    p.spawn(member, "upgrade check" if check else "upgrade", call)


async def record_event(p: Platform, action: act.RecordEvent) -> None:
    await p.event(action)


HANDLERS: dict[type[act.Action], Callable[[Platform, Any], Awaitable[None]]] = {
    act.CreateMember: create_member,
    act.Fence: fence,
    act.Demote: demote,
    act.Unfence: unfence,
    act.Promote: promote,
    act.SetPrimary: set_primary,
    act.SetSynchronousStandbys: set_sync,
    act.RestartMember: restart_member,
    act.Rejoin: rejoin,
    act.DropReplicationSlot: drop_slot,
    act.CheckUpgrade: check_upgrade,
    act.UpgradeMember: upgrade_member,
    act.RecordEvent: record_event,
}


def handles(action: act.Action) -> bool:
    return type(action) in HANDLERS


async def apply(p: Platform, action: act.Action) -> None:
    """One of the engine's member actions (``handles``), on platform ``p``."""
    await HANDLERS[type(action)](p, action)
