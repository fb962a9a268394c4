"""The engine's actions on Kubernetes: pods, PVCs, StatefulSet replicas, Jobs, Backup and Restore
status, Events; and ``KubeMembers``, this platform's side of the actuator (pgherd/actuator.py), which
carries out the member actions (seed, fence, promote, rejoin...) for both platforms: the StatefulSet
scaled to a new member, the agents at their pods' IPs, the -rw EndpointSlice, the role labels, a pod
deleted to fence an unanswering member.

What an action did is an Event on the cluster when it did something (the engine repeats an action until
it sees its effect; an effect is told once): a member fenced, promoted in place, rejoined; the
StatefulSet scaled; a Backup created, its Job started, its end; a prune Job. The engine's decisions
themselves (an operation's start, steps and end, a new primary) are its own Events (engine/narrate.py).

Each action is idempotent here as the engine requires: it is repeated until its effect is observed.
Every action first checks that this operator still holds the leadership (``may_act``): a replica that
lost the Lease stops at once, even in the middle of a decision's action list.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from pgherd import actuator
from pgherd.api.backup import status_from_summary
from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import actions as act
from pgherd.engine.view import JobState
from pgherd.kube import names
from pgherd.kube.agents import Agents
from pgherd.kube.api import ApiError, KubeApi
from pgherd.kube.builders import services
from pgherd.kube.observe import (
    ClusterObjects,
    container_started,
    job_result,
    job_state,
    pod_ip,
    rw_member,
    rw_slice,
    slice_summary,
)
from pgherd.kube.restores import RestoreRecord, Restores, iso, restore_object, snapshot_to_restore
from pgherd_backup.agent.client import AgentActionError, AgentClient, AgentError, AgentUnreachable
from pgherd_backup.agent.wire import ActionResult, FenceRequest, Status
from pgherd_backup.logformat import log_context
from pgherd_backup.timestamps import now_rfc3339

log = logging.getLogger("pgherd.kube.actions")

# The pod of an agent that does not answer: deleted with the shortest grace the kubelet must confirm.
FENCE_DELETE_GRACE = 1
JSON = dict[str, Any]
T = TypeVar("T")


class NotLeader(Exception):
    """Leadership was lost: apply nothing more."""


@dataclass
class ActContext:
    api: KubeApi
    objects: ClusterObjects
    spec: PostgresClusterSpec
    statuses: Mapping[str, Status | None]
    agents: Agents
    current_primary: str | None
    member_address: Callable[[str], str | None]  # host:port of a member's PostgreSQL, for seeds/rejoins
    may_act: Callable[[], bool]
    snapshot_job: Callable[[str, str, str], JSON]  # (backup, member, member host) -> Job
    prune_job: Callable[[act.Prune], JSON]
    event: Callable[[act.RecordEvent], Awaitable[None]]  # on the cluster, posted every time (one-off)
    # On an object (the cluster, a Backup, a Restore), not posted again within minutes: for an effect an
    # action may repeat before the watch shows it.
    event_on: Callable[[JSON, act.RecordEvent], Awaitable[None]]
    restores: Restores

    @property
    def namespace(self) -> str:
        return self.objects.namespace

    @property
    def cluster(self) -> str:
        return self.objects.name


async def apply_all(ctx: ActContext, actions: tuple[act.Action, ...]) -> None:
    """Apply in order, stopping at the first failure (later actions may rely on it: no Promote after
    a failed SetSynchronousStandbys); the engine re-issues what is still needed next time."""
    for index, action in enumerate(actions):
        if not ctx.may_act():
            raise NotLeader()
        if not isinstance(action, act.RecordEvent | act.UpdateBackup | act.UpdateRestore):
            log.debug("%s/%s: %s", ctx.namespace, ctx.cluster, action)
        try:
            with log_context(member=getattr(action, "member", None)):
                await apply(ctx, action)
        except (ApiError, AgentError, OSError) as exc:
            skipped = ", ".join(type(a).__name__ for a in actions[index + 1 :]) or "none"
            log.warning(
                "%s/%s: %s failed: %s; not applied: %s",
                ctx.namespace,
                ctx.cluster,
                type(action).__name__,
                exc,
                skipped,
            )
            return


async def apply(ctx: ActContext, action: act.Action) -> None:
    if actuator.handles(action):
        await actuator.apply(KubeMembers(ctx), action)
        return
    handler = _HANDLERS[type(action)]
    await handler(ctx, action)


def _ip(ctx: ActContext, member: str) -> str | None:
    return pod_ip(ctx.objects.pod(member))


def _status(ctx: ActContext, member: str) -> Status | None:
    return ctx.statuses.get(member)


async def _set_replicas(ctx: ActContext, replicas: int, why: str) -> None:
    """The StatefulSet's replicas, and an Event (ScaledUp, ScaledDown) saying ``why``."""
    before = ctx.objects.replicas()
    statefulset = names.statefulset(ctx.cluster)
    await ctx.api.patch("StatefulSet", ctx.namespace, statefulset, {"spec": {"replicas": replicas}})
    if ctx.objects.statefulset is not None:
        ctx.objects.statefulset.setdefault("spec", {})["replicas"] = replicas
    reason = "ScaledUp" if replicas > before else "ScaledDown"
    # Patched again when the next tick's StatefulSet is older than this patch: told once all the same.
    await ctx.event_on(
        ctx.objects.cluster,
        act.RecordEvent(reason, f"{why} (StatefulSet {statefulset}: {before} -> {replicas} replicas)"),
    )


async def _label(ctx: ActContext, member: str, role: str | None) -> None:
    pod = ctx.objects.pod(member)
    if pod is None:
        return
    labels = pod["metadata"].setdefault("labels", {})
    if labels.get(names.LABEL_ROLE) == role:
        return
    await ctx.api.patch("Pod", ctx.namespace, member, {"metadata": {"labels": {names.LABEL_ROLE: role}}})
    if role is None:
        labels.pop(names.LABEL_ROLE, None)
    else:
        labels[names.LABEL_ROLE] = role


async def label_replicas(ctx: ActContext) -> None:
    """``pgherd.io/role=replica`` (what the -ro Service selects) on each unlabelled pod whose agent
    reports a replica. Never the primary label: only SetPrimary gives that, after a promotion."""
    for pod in ctx.objects.pods:
        member = pod["metadata"]["name"]
        status = _status(ctx, member)
        labels = pod["metadata"].get("labels") or {}
        if status is None or status.role != "replica" or labels.get(names.LABEL_ROLE) is not None:
            continue
        if pod["metadata"].get("deletionTimestamp"):
            continue
        if not ctx.may_act():
            raise NotLeader()
        try:
            await _label(ctx, member, names.ROLE_REPLICA)
        except ApiError as exc:  # the pod went meanwhile: seen again next time
            log.info("labelling %s as a replica: %s", member, exc)


async def delete_member(ctx: ActContext, action: act.DeleteMember) -> None:
    ordinal = int(action.member.rsplit("-", 1)[1])
    if ctx.objects.replicas() > ordinal:
        if ctx.objects.replicas() != ordinal + 1:
            log.warning("not deleting %s: only the highest ordinal can leave a StatefulSet", action.member)
            return
        volume = "its volume kept" if action.keep_data else "its volume deleted"
        await _set_replicas(ctx, ordinal, f"removing {action.member} ({volume}): {action.reason}")
    if not action.keep_data:
        # PVC protection keeps the volume until its pod is gone; the data goes only on this request.
        await ctx.api.delete("PersistentVolumeClaim", ctx.namespace, names.pvc(ctx.cluster, action.member))


class KubeMembers:
    """The actuator's Platform (pgherd/actuator.py) on Kubernetes: agents at their pods' IPs, the -rw
    EndpointSlice, the role labels, a pod deleted to fence an unanswering member, Events."""

    def __init__(self, ctx: ActContext) -> None:
        self.ctx = ctx

    @property
    def current_primary(self) -> str | None:
        return self.ctx.current_primary

    def status(self, member: str) -> Status | None:
        return _status(self.ctx, member)

    def silent(self, member: str) -> bool:
        return _status(self.ctx, member) is None

    def exists(self, member: str) -> bool:
        return self.ctx.objects.pod(member) is not None

    def reachable(self, member: str) -> bool:
        return self.ctx.objects.pod(member) is not None and _ip(self.ctx, member) is not None

    def started(self, member: str) -> bool:
        pod = self.ctx.objects.pod(member)
        return pod is not None and _ip(self.ctx, member) is not None and container_started(pod)

    def busy(self, member: str) -> bool:
        ip = _ip(self.ctx, member)
        return ip is not None and self.ctx.agents.busy(member, ip)

    def upstream_address(self, member: str) -> str | None:
        return self.ctx.member_address(member)

    def snapshot_of(self, backup: str | None, snapshot_id: str | None) -> str:
        return snapshot_to_restore(self.ctx.objects, backup, snapshot_id)

    async def add_member(self, action: act.CreateMember) -> bool:
        """The StatefulSet scaled to the member: its controller creates the pod (and its volume)."""
        if self.ctx.objects.replicas() > action.ordinal:
            return False
        source = action.source or action.snapshot_id
        origin = f" from {source}" if source else ""
        why = f"creating {action.member}, to be seeded by {action.seed.value}{origin}: {action.reason}"
        await _set_replicas(self.ctx, action.ordinal + 1, why)
        return True

    async def call(self, member: str, what: str, fn: Callable[[AgentClient], T]) -> T:
        ip = _ip(self.ctx, member)
        if ip is None:
            raise AgentUnreachable(f"{member} has no address")
        return await self.ctx.agents.call(member, ip, what, fn)

    def spawn(
        self,
        member: str,
        what: str,
        fn: Callable[[AgentClient], Any],
        then: Callable[[Any], Awaitable[None]] | None = None,
    ) -> bool:
        ip = _ip(self.ctx, member)
        return ip is not None and self.ctx.agents.spawn(member, ip, what, fn, then=then)

    def at_revision(self, member: str, revision: str) -> bool:
        pod = self.ctx.objects.pod(member) or {}
        return (pod.get("metadata", {}).get("labels") or {}).get(names.LABEL_REVISION) == revision

    async def roll(self, member: str, revision: str) -> bool:
        """A new pod at the new revision (the StatefulSet's OnDelete): this one deleted, unless going."""
        pod = self.ctx.objects.pod(member)
        if pod is not None and not pod["metadata"].get("deletionTimestamp"):
            await self.ctx.api.delete("Pod", self.ctx.namespace, member, uid=pod["metadata"].get("uid"))
        return True

    async def restarted(self, member: str, revision: str) -> None:
        pass  # its pod's label is the record: a new pod is the only restart ``roll`` asks for

    async def route(self, member: str) -> bool:
        target, ip = self.ctx.objects.pod(member), _ip(self.ctx, member)
        if target is None or ip is None:
            return False  # no address yet: the engine asks again
        if rw_member(self.ctx.objects) != member:
            await _write_rw_slice(self.ctx, [services.rw_endpoint(target, ip)])
        return True

    async def unroute(self, member: str) -> None:
        await _unroute(self.ctx, member)

    async def mark_primary(self, member: str) -> None:
        for pod in self.ctx.objects.pods:
            name = pod["metadata"]["name"]
            labels = pod["metadata"].get("labels") or {}
            if name != member and labels.get(names.LABEL_ROLE) == names.ROLE_PRIMARY:
                await _label(self.ctx, name, names.ROLE_REPLICA)
        await _label(self.ctx, member, names.ROLE_PRIMARY)

    async def unmark(self, member: str) -> None:
        await _label(self.ctx, member, None)

    async def fence_acknowledged(self, member: str, result: ActionResult) -> None:
        """Remembered while its volume is the same, for a drained primary's agent that exits once
        fenced (kube/agents.py)."""
        volume = self.ctx.objects.pvc(member)
        self.ctx.agents.remember_fence(
            member, None if volume is None else volume["metadata"].get("uid"), result
        )

    async def fence_unanswering(self, member: str, reason: str) -> None:
        """Its pod deleted, graceful (1 s, never 0): a grace period of 0 removes the object unconfirmed,
        and the StatefulSet would start the member again on its volume while the old PostgreSQL may still
        run there. A pod going already is left to its kubelet, which confirms when its processes are gone."""
        pod = self.ctx.objects.pod(member)
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            return
        ctx = self.ctx
        await ctx.api.delete(
            "Pod", ctx.namespace, member, grace_seconds=FENCE_DELETE_GRACE, uid=pod["metadata"].get("uid")
        )
        message = f"{member}'s agent does not answer: its pod is deleted, so that nothing of it writes"
        await ctx.event_on(ctx.objects.cluster, act.RecordEvent("Fenced", f"{message}: {reason}", True))

    async def event(self, event: act.RecordEvent) -> None:
        await self.ctx.event(event)


async def _unroute(ctx: ActContext, member: str) -> None:
    """The -rw slice without ``member``'s endpoint, when it has one (whatever its address)."""
    found = rw_slice(ctx.objects)
    endpoints = (found or {}).get("endpoints") or []
    if any((e.get("targetRef") or {}).get("name") == member for e in endpoints):
        await _write_rw_slice(ctx, [])


async def _write_rw_slice(ctx: ActContext, endpoints: list[JSON]) -> None:
    """One write of the -rw slice's endpoints (a merge patch replaces the whole list); created when the
    watch has not seen it. The watch's copy is updated, so that the rest of this pass sees it."""
    body = services.rw_endpoint_slice(ctx.objects.cluster, endpoints)
    name = body["metadata"]["name"]
    patch = {"metadata": {"labels": body["metadata"]["labels"]}, "endpoints": endpoints}
    if rw_slice(ctx.objects) is None:
        try:
            await ctx.api.create("EndpointSlice", ctx.namespace, body)
        except ApiError as exc:
            if not exc.conflict:
                raise
            await ctx.api.patch("EndpointSlice", ctx.namespace, name, patch)
    else:
        try:
            await ctx.api.patch("EndpointSlice", ctx.namespace, name, patch)
        except ApiError as exc:
            if not exc.not_found:
                raise
            await ctx.api.create("EndpointSlice", ctx.namespace, body)
    seen = slice_summary(body)
    others = [s for s in ctx.objects.rw_slices or [] if s.get("name") != name]
    ctx.objects.rw_slices = [*others, seen]


async def start_snapshot(ctx: ActContext, action: act.StartSnapshot) -> None:
    """The Backup's snapshot Job, only while the Backup, read from the API, still waits for one
    (Pending or Running): the watch may show the Job of a Backup just failed as deleted before the
    Backup as Failed, and a Job must not be made again for it."""
    host = ctx.member_address(action.member)
    if host is None:
        return
    backup = await ctx.api.find("Backup", ctx.namespace, action.backup)
    if backup is None or (backup.get("status") or {}).get("phase", "Pending") not in ("Pending", "Running"):
        return
    job = ctx.snapshot_job(action.backup, action.member, host)
    job["metadata"].setdefault("labels", {})[names.LABEL_MEMBER] = action.member
    try:
        await ctx.api.create("Job", ctx.namespace, job)
    except ApiError as exc:
        if not exc.conflict:
            raise
        return
    message = f"Backup {action.backup}: snapshot Job {job['metadata']['name']} from {action.member}: {action.reason}"
    await ctx.event(act.RecordEvent("BackupStarted", message))


async def start_restore(ctx: ActContext, action: act.StartRestore) -> None:
    """The member's agent restores in place (restores.py); the record is written once it took the order.
    Asked again under the same requestId, an agent answers that restore's state and never starts
    another; a restore that already ran and failed (500) is recorded too: its lastAction tells how."""
    if ctx.restores.taken(action.restore):
        return
    try:
        snapshot = snapshot_to_restore(ctx.objects, action.backup, action.snapshot_id)
    except ValueError as exc:
        await ctx.restores.save(RestoreRecord(action.restore, action.member, datetime.now(UTC), str(exc)))
        return
    status, ip = _status(ctx, action.member), _ip(ctx, action.member)
    if status is None or ip is None:
        return  # not answering: the engine asks again
    # A member with data is fenced by the engine first; an empty one (a lost volume, which the engine
    # does not count as a member) has nothing to fence, but its agent restores only under a fence.
    fence_first = not status.fenced and not status.data_present
    if not status.fenced and not fence_first:
        return  # not fenced yet: the agent would refuse; the engine asks again
    started = datetime.now(UTC)

    def call(client: AgentClient) -> ActionResult | AgentActionError:
        try:
            if fence_first:
                client.act(FenceRequest(reason=f"restore {action.restore} into an empty member"))
            return client.restore(snapshot, action.target, request_id=action.restore, reason=action.reason)
        except AgentActionError as exc:
            if exc.status != 500:
                raise  # refused or busy: asked again
            return exc

    async def taken(_: object) -> None:
        await ctx.restores.save(RestoreRecord(action.restore, action.member, started))
        if restore_object(ctx.objects, action.restore) is not None:
            fields: JSON = {"startedAt": iso(started)}
            if snapshot != "latest":
                fields["snapshotId"] = snapshot
            await ctx.api.patch(
                "Restore", ctx.namespace, action.restore, {"status": fields}, subresource="status"
            )

    ctx.agents.spawn(action.member, ip, "restore", call, then=taken)


async def create_backup(ctx: ActContext, action: act.CreateBackup) -> None:
    body = {
        "apiVersion": names.API_VERSION,
        "kind": "Backup",
        "metadata": {
            "name": action.name,
            "namespace": ctx.namespace,
            "labels": {names.LABEL_CLUSTER: ctx.cluster},
        },
        "spec": {"cluster": {"name": ctx.cluster}},
    }
    try:
        await ctx.api.create("Backup", ctx.namespace, body)
    except ApiError as exc:
        if not exc.conflict:
            raise
        return
    await ctx.event(act.RecordEvent("BackupCreated", f"Backup {action.name}: {action.reason}"))


def _stamp() -> str:
    return now_rfc3339()


async def update_backup(ctx: ActContext, action: act.UpdateBackup) -> None:
    status: JSON = {"phase": action.phase}
    if action.source_member is not None:
        status["sourceMember"] = action.source_member
    if action.error is not None:
        status["error"] = action.error
    if action.phase == "Running":
        status["startedAt"] = _stamp()
    if action.phase in ("Completed", "Failed"):
        status["completedAt"] = _stamp()
        status.update(_snapshot_summary(ctx, action.name))
    await ctx.api.patch("Backup", ctx.namespace, action.name, {"status": status}, subresource="status")
    backup = next((b for b in ctx.objects.backups if b["metadata"]["name"] == action.name), None)
    if action.phase == "Failed":
        failed = act.RecordEvent("BackupFailed", f"backup {action.name} failed: {action.error}", warning=True)
        for regarding in (backup, ctx.objects.cluster):
            if regarding is not None:
                await ctx.event_on(regarding, failed)
    elif action.phase == "Completed":
        done = f"Backup {action.name} completed" + (
            f", from {action.source_member}" if action.source_member else ""
        )
        await ctx.event_on(ctx.objects.cluster, act.RecordEvent("BackupCompleted", done))
    if action.phase == "Failed":
        await _delete_unfinished_job(ctx, action.name)


def _snapshot_job(ctx: ActContext, backup: str) -> JSON | None:
    return next(
        (
            j
            for j in ctx.objects.jobs
            if (j["metadata"].get("labels") or {}).get(names.LABEL_BACKUP) == backup
        ),
        None,
    )


async def _delete_unfinished_job(ctx: ActContext, backup: str) -> None:
    """A Failed Backup's Job that has not finished (its pod never started: backup.jobStartTimeoutSeconds)
    is deleted with its pods (Background: a Job's API default would orphan them), rather than left
    waiting for its 6-hour deadline. A finished Job stays: its pod's status says how it failed."""
    job = _snapshot_job(ctx, backup)
    if job is None or job_state(job) is not JobState.RUNNING or job["metadata"].get("deletionTimestamp"):
        return
    meta = job["metadata"]
    log.info(
        "%s/%s: deleting the snapshot Job %s of the failed Backup %s",
        ctx.namespace,
        ctx.cluster,
        meta["name"],
        backup,
    )
    await ctx.api.delete("Job", ctx.namespace, meta["name"], uid=meta.get("uid"), propagation="Background")


def _snapshot_summary(ctx: ActContext, backup: str) -> JSON:
    job = _snapshot_job(ctx, backup)
    return {} if job is None else status_from_summary(job_result(ctx.objects, job))


async def update_restore(ctx: ActContext, action: act.UpdateRestore) -> None:
    status: JSON = {"phase": action.phase}
    if action.error is not None:
        status["error"] = action.error
    if action.restored_timeline is not None:
        status["restoredTimeline"] = action.restored_timeline
    if action.phase in ("Completed", "Failed"):
        status["completedAt"] = _stamp()
        kept = ctx.restores.kept_data(action.name, ctx.statuses)
        if kept:
            status["keptData"] = kept
    await ctx.api.patch("Restore", ctx.namespace, action.name, {"status": status}, subresource="status")
    restore = restore_object(ctx.objects, action.name)
    if action.phase == "Failed" and restore is not None:
        await ctx.event_on(
            restore,
            act.RecordEvent("RestoreFailed", f"restore {action.name} failed: {action.error}", warning=True),
        )


async def prune(ctx: ActContext, action: act.Prune) -> None:
    job = ctx.prune_job(action)
    try:
        await ctx.api.create("Job", ctx.namespace, job)
    except ApiError as exc:
        if not exc.conflict:
            raise
        return
    keep = ", ".join(
        f"{name} {value}"
        for name, value in (("keepLast", action.keep_last), ("keepWithin", action.keep_within))
        if value
    )
    message = f"prune Job {job['metadata']['name']}: retention {keep} ({action.reason})"
    await ctx.event(act.RecordEvent("PruneStarted", message))


_HANDLERS: dict[type, Callable[[ActContext, Any], Awaitable[None]]] = {
    act.DeleteMember: delete_member,
    act.StartSnapshot: start_snapshot,
    act.StartRestore: start_restore,
    act.CreateBackup: create_backup,
    act.UpdateBackup: update_backup,
    act.UpdateRestore: update_restore,
    act.Prune: prune,
}
