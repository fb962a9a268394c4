"""What the engine sees of a member from its instance agent: /status -> MemberView.

One mapping for both platform adapters (the sandbox, Kubernetes), so that the engine's inputs mean the
same thing everywhere. The rules, and why:

- ``reachable``: the agent answered *and* PostgreSQL answered it (role known). An agent that answers
  for a PostgreSQL that is down gives ``stopped`` instead; an agent that does not answer says nothing
  about PostgreSQL — only the platform can add that its process (the pod) is gone.
- ``stopped``: the postmaster is stopped or crashed and nothing is about to start it (no action in
  progress other than a fence). A crashed PostgreSQL is restarted by its agent read-only only, so a
  stop is evidence that the member cannot write until the engine orders otherwise.
- ``received_lsn`` of a fenced, stopped member: its final WAL end (the switchover compares it).
- ``upstream``: the member the WAL receiver streams from, resolved by the platform from host:port.
- An agent that answers for an empty volume and carries out nothing is no member yet (``exists`` and
  ``data_present`` False): the engine has it seeded (CreateMember, which both platforms' actuator
  carries out) or restores into it. A member whose volume was lost comes back so: the engine decides
  what fills it, never its agent on its own.
- Unknown is None, never a guess.
- A restore (the engine's restore job) is the agent's own action, followed in its /status
  (``restore_job_view``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import PurePath
from typing import Any

from pgherd.api.backup import unrestorable
from pgherd.engine.quorum import SyncConfig, majority
from pgherd.engine.view import ActionEnd, JobKind, JobState, JobView, MemberView, Role
from pgherd_backup.agent.client import AgentClient, AgentError
from pgherd_backup.agent.isolation import IsolationOrder
from pgherd_backup.agent.wire import Status, lsn_value

__all__ = [
    "KEPT_STAMP",
    "STATUS_TIMEOUT",
    "fetch_statuses",
    "isolation_order",
    "kept_aside_since",
    "member_view",
    "parse_sync_standby_names",
    "port_resolver",
    "restore_job_view",
    "restore_snapshot",
]

# Observation must never wait on one slow member: a dead primary is noticed within this bound.
STATUS_TIMEOUT = 1.0

# How long an async primary may go without a word from the operator, and without replies from enough
# replicas for a majority, before it fences itself (agent/isolation.py): longer than an operator's
# restart and its Lease's handover with the replicas there, short enough to bound what a primary cut
# off where the operator cannot fence it (its node partitioned) acknowledges for nothing.
ISOLATION_SECONDS = 15


def isolation_order(detection_seconds: int, voters: int, *, steady: bool) -> IsolationOrder:
    """The order sent with every /status. Its peers: a majority of the voters less the primary; none
    (the check off, replacing any order sent before) for a single voter, which is its own majority, and
    while an operation runs (an upgrade, a restore, a rollout), which may leave the primary without
    replicas on purpose while the operator is away (killed, restarting)."""
    peers = majority(voters) - 1 if voters and steady else 0
    return IsolationOrder(seconds=max(ISOLATION_SECONDS, 3 * detection_seconds), peers=max(peers, 0))


# Actions during which the agent may start PostgreSQL: a member running one of them is not stopped.
_STOPPING_ONLY = frozenset({"fence"})

_ANY = re.compile(r"^\s*ANY\s+(\d+)\s*\((.*)\)\s*$", re.IGNORECASE)


def parse_sync_standby_names(value: str) -> SyncConfig:
    """The SyncConfig of a synchronous_standby_names value in the forms pgherd writes ('' or ANY k (...))."""
    if not value.strip():
        return SyncConfig()
    match = _ANY.match(value)
    if match is None:
        # Another form, set by hand: report it as it is, with k = 1 per PostgreSQL's FIRST 1 default.
        names = frozenset(n.strip().strip('"') for n in value.split(",") if n.strip())
        return SyncConfig(1, names)
    names = frozenset(n.strip().strip('"') for n in match.group(2).split(",") if n.strip())
    return SyncConfig(int(match.group(1)), names)


def port_resolver(ports: Mapping[int, str]) -> Callable[[str], str | None]:
    """Resolve a WAL receiver's ``host:port`` by its port (the sandbox: one port per member on one host)."""

    def resolve(address: str) -> str | None:
        _, _, port = address.rpartition(":")
        return ports.get(int(port)) if port.isdigit() else None

    return resolve


def member_view(
    name: str,
    ordinal: int,
    status: Status | None,
    *,
    resolve_upstream: Callable[[str], str | None],
    process_gone: bool = False,
    filling: bool = False,
) -> MemberView:
    """The MemberView of one member.

    ``status``: its agent's /status, None when the agent did not answer. ``process_gone``: the platform
    knows the member's agent (pod) is not running — a lost pod, stopped but still existing.
    ``filling``: a platform job is filling its data directory (a restore): neither stopped nor lost.
    """
    if status is None:
        gone = process_gone and not filling
        return MemberView(name=name, ordinal=ordinal, exists=True, reachable=False, stopped=gone, absent=gone)
    if not status.data_present and status.action is None and not filling:
        return MemberView(
            name=name,
            ordinal=ordinal,
            exists=False,
            data_present=False,
            stopped=True,
            reachable=False,
            fenced=status.fenced,
        )
    live = status.role in (Role.PRIMARY.value, Role.REPLICA.value)
    stopped = (
        not live
        and status.postmaster in ("stopped", "crashed")
        and (status.action is None or status.action in _STOPPING_ONLY)
        and not filling
    )
    received = lsn_value(status.received_lsn)
    if stopped and status.fenced:
        received = lsn_value(status.final_lsn)
    upstream = None
    if status.wal_receiver is not None and status.wal_receiver.upstream:
        upstream = resolve_upstream(status.wal_receiver.upstream)
    sync = None
    if live and status.synchronous_standby_names is not None:
        sync = parse_sync_standby_names(status.synchronous_standby_names)
    return MemberView(
        name=name,
        ordinal=ordinal,
        exists=True,
        reachable=live,
        role=Role(status.role) if live else Role.UNKNOWN,
        timeline=status.timeline,
        received_lsn=received,
        replayed_lsn=lsn_value(status.replayed_lsn),
        wal_receiver_streaming=status.streaming,
        upstream=upstream,
        upstream_silence=status.upstream_silent_seconds,
        upstream_heartbeat=status.wal_receiver.heartbeat_seconds if status.wal_receiver is not None else None,
        ready=status.ready,
        revision=status.revision,
        data_present=status.data_present or filling,
        fenced=status.fenced,
        sync=sync,
        stopped=stopped,
        shutdown_clean=status.shutdown_clean if stopped else None,
        held_lsn=lsn_value(status.held_lsn),
        kept_aside=len(status.kept_aside),
        terminating=status.terminating,
        # A fence remembered for a member whose pod is gone stands in for its agent: nothing runs.
        absent=process_gone and not filling,
        busy=status.action is not None,
        data_major=status.data_major,
        analyzing=status.analyzing,
        last_action=_action_end(status),
    )


def _action_end(status: Status) -> ActionEnd | None:
    last = status.last_action
    if last is None:
        return None
    return ActionEnd(last.name, last.request_id, last.ok, last.error, last.detail)


def restore_job_view(name: str, member: str, status: Status | None, last_stage: str = "restoring") -> JobView:
    """The engine's restore job `name`, carried out by `member`'s agent (`POST /actions/restore` with
    `requestId` = `name`), as its /status tells it: running, in its stage (`restoring`, `replaying`),
    while `action` is that restore, or while the agent does not answer (`last_stage`: as last seen);
    succeeded, with the new timeline, or failed, with its error, once `lastAction` names it; failed
    when the agent answers with no record of it (its volume or its state was lost)."""
    if status is None:
        return JobView(JobKind.RESTORE, name, JobState.RUNNING, member, last_stage)
    progress = status.action_progress
    if status.action == "restore" and progress is not None and progress.request_id == name:
        return JobView(JobKind.RESTORE, name, JobState.RUNNING, member, progress.stage or last_stage)
    last = status.last_action
    if last is not None and last.name == "restore" and last.request_id == name:
        if last.ok:
            return JobView(
                JobKind.RESTORE, name, JobState.SUCCEEDED, member, "replaying", timeline=last.timeline
            )
        return JobView(JobKind.RESTORE, name, JobState.FAILED, member, last_stage, last.error or "failed")
    return JobView(
        JobKind.RESTORE,
        name,
        JobState.FAILED,
        member,
        last_stage,
        f"the agent of {member} has no record of restore {name} (was its volume lost?)",
    )


def restore_snapshot(
    backup: str | None,
    snapshot_id: str | None,
    backup_status_of: Callable[[str], Mapping[str, Any] | None],
) -> str:
    """The snapshot a restore order names: its snapshot id, a Backup's backupId, or ``latest`` (no Backup,
    or the Backup ``latest``: the store's newest complete snapshot, which retention never deletes).
    ``backup_status_of(name)``: that Backup's status as stored, None when there is none. ValueError for
    a Backup without a completed snapshot, or Expired (its snapshot deleted by retention)."""
    if snapshot_id:
        return snapshot_id
    if backup in (None, "latest"):
        return "latest"
    status = backup_status_of(backup)
    refused = unrestorable(backup, status)
    if refused is not None:
        raise ValueError(refused)
    assert status is not None
    return str(status["backupId"])


# How the agents name a data directory they keep aside (`<volume>/kept/<stamp>`, UTC).
KEPT_STAMP = "%Y%m%dT%H%M%S%fZ"


def kept_aside_since(paths: Iterable[str], since: datetime) -> list[str]:
    """The kept-aside data directories among ``paths`` that were kept at ``since`` or later."""
    found = []
    for path in paths:
        try:
            at = datetime.strptime(PurePath(path).name, KEPT_STAMP).replace(tzinfo=UTC)
        except ValueError:
            continue
        if at >= since:
            found.append(path)
    return found


def fetch_statuses(
    clients: Mapping[str, AgentClient],
    timeout: float = STATUS_TIMEOUT,
    isolation: IsolationOrder | None = None,
) -> dict[str, Status | None]:
    """Every member's /status at once (one thread each), None for an agent that did not answer in
    ``timeout`` or answered with an error: one dead member never delays the others' observation."""
    if not clients:
        return {}

    def one(client: AgentClient) -> Status | None:
        try:
            return client.status(timeout=timeout, isolation=isolation)
        except AgentError:
            return None

    with ThreadPoolExecutor(max_workers=len(clients), thread_name_prefix="agent-status") as pool:
        futures = {name: pool.submit(one, client) for name, client in clients.items()}
        return {name: future.result() for name, future in futures.items()}
