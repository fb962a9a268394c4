"""What the operator sees of one cluster on Kubernetes: Pods, PVCs, the StatefulSet, Jobs, Backups and
Restores (from kopf's watch-fed indexes, no request per tick) and every member's agent ``/status`` (in
parallel, short timeouts) -> the engine's ClusterView.

The rules that matter for safety:

- a member *exists* while the StatefulSet keeps its ordinal or its pod exists, except a member whose
  agent positively reports an empty data directory and is doing nothing about it: that member is
  reported as not existing *and* as having lost its data, so the engine seeds it (a new pod waiting
  for its seed, or a rebuilt volume) and counts its data as gone (evidence for an automatic restore);
- *stopped* (evidence that it cannot write) only when its pod is gone or its container is not running
  (the kubelet reports it), or its agent says PostgreSQL is stopped. A pod the operator cannot reach
  says nothing: a partitioned node may still run it;
- the rw endpoint's member is the one pod labelled ``pgherd.io/role=primary`` (none when two are).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from pgherd.agentview import member_view
from pgherd.api.annotations import restart_request, upgrade_requests
from pgherd.engine.view import (
    BackupView,
    ClusterView,
    JobKind,
    JobState,
    JobView,
    MemberView,
    RestoreView,
    member_name,
    ordinal_of,
    parse_time,
)
from pgherd.kube import names
from pgherd.kube.builders.jobs import job_error
from pgherd_backup.agent.wire import Status

JSON = dict[str, Any]


@dataclass
class ClusterObjects:
    """The cluster's objects as the watches last saw them."""

    cluster: JSON
    pods: list[JSON] = field(default_factory=list)  # member pods (component postgres)
    job_pods: list[JSON] = field(default_factory=list)  # the pods of the cluster's Jobs
    pvcs: list[JSON] = field(default_factory=list)
    jobs: list[JSON] = field(default_factory=list)
    statefulset: JSON | None = None
    backups: list[JSON] = field(default_factory=list)
    restores: list[JSON] = field(default_factory=list)
    # The -rw Service's EndpointSlices; None: not watched (the operator cannot tell where -rw routes).
    rw_slices: list[JSON] | None = None

    @property
    def name(self) -> str:
        return str(self.cluster["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.cluster["metadata"]["namespace"])

    def pod(self, member: str) -> JSON | None:
        return next((p for p in self.pods if p["metadata"]["name"] == member), None)

    def pvc(self, member: str) -> JSON | None:
        wanted = names.pvc(self.name, member)
        return next((p for p in self.pvcs if p["metadata"]["name"] == wanted), None)

    def volume_uids(self) -> dict[str, str | None]:
        """member -> the uid of its data volume (PVC), for every member with one."""
        found: dict[str, str | None] = {}
        for member in self.member_names():
            volume = self.pvc(member)
            if volume is not None:
                found[member] = volume["metadata"].get("uid")
        return found

    def replicas(self) -> int:
        if self.statefulset is None:
            return 0
        return int((self.statefulset.get("spec") or {}).get("replicas") or 0)

    def member_names(self) -> list[str]:
        """Ordinals the StatefulSet keeps, and any member pod still present above them."""
        found = {member_name(self.name, i) for i in range(self.replicas())}
        for pod in self.pods:
            pod_name = pod["metadata"]["name"]
            if _is_member_pod(self.name, pod_name):
                found.add(pod_name)
        return sorted(found, key=ordinal_of)


def _is_member_pod(cluster: str, pod_name: str) -> bool:
    prefix, _, ordinal = pod_name.rpartition("-")
    return prefix == cluster and ordinal.isdigit()


def pod_ip(pod: JSON | None) -> str | None:
    if pod is None:
        return None
    ip: Any = (pod.get("status") or {}).get("podIP")
    return str(ip) if ip else None


def container_running(pod: JSON | None) -> bool:
    """The kubelet last reported the postgres container running (the agent, PID 1, is alive)."""
    if pod is None:
        return False
    status = pod.get("status") or {}
    if status.get("phase") in ("Failed", "Succeeded"):
        return False
    for container in status.get("containerStatuses") or []:
        if container.get("name") == names.CONTAINER_POSTGRES:
            return "running" in (container.get("state") or {})
    return False


def container_started(pod: JSON | None) -> bool:
    """The kubelet reports the postgres container running and past its startup probe: its agent has
    started (an agent still starting never runs PostgreSQL read-write: it waits for the operator)."""
    if pod is None or not container_running(pod):
        return False
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        if container.get("name") == names.CONTAINER_POSTGRES:
            return bool(container.get("started"))
    return False


def process_gone(pod: JSON | None) -> bool:
    """Positive evidence that nothing runs: no pod, or a pod whose container the kubelet reports not
    running (waiting or terminated). A pod not yet scheduled has nothing running either."""
    if pod is None:
        return True
    status = pod.get("status") or {}
    if status.get("phase") in ("Failed", "Succeeded"):
        return True
    if status.get("phase") == "Pending" and not status.get("containerStatuses"):
        return True
    for container in status.get("containerStatuses") or []:
        if container.get("name") == names.CONTAINER_POSTGRES:
            state = container.get("state") or {}
            return "running" not in state
    return False


def upstream_resolver(objects: ClusterObjects) -> Callable[[str], str | None]:
    """A WAL receiver's ``host:port`` -> member: by pod IP, or by the member's DNS name."""
    by_ip: dict[str, str] = {ip: str(p["metadata"]["name"]) for p in objects.pods if (ip := pod_ip(p))}
    members = set(objects.member_names())

    def resolve(address: str) -> str | None:
        host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
        host = host.strip("[]")
        if host in by_ip:
            return by_ip[host]
        first = host.split(".", 1)[0]
        return first if first in members else None

    return resolve


def members(
    objects: ClusterObjects, statuses: Mapping[str, Status | None], lost_volumes: Set[str] = frozenset()
) -> list[MemberView]:
    """The members' views. ``lost_volumes``: members whose volume that held their data is gone (see
    volumes.py): evidence of lost data while nothing of them runs to say so."""
    resolve = upstream_resolver(objects)
    views: list[MemberView] = []
    for name in objects.member_names():
        ordinal = ordinal_of(name)
        pod = objects.pod(name)
        status = statuses.get(name)
        wanted = ordinal < objects.replicas()
        if pod is None and objects.pvc(name) is None:
            # Never created (or its volume deleted): nothing to observe, nothing that could write.
            views.append(MemberView(name=name, ordinal=ordinal, exists=False, stopped=True, absent=True))
            continue
        view = member_view(name, ordinal, status, resolve_upstream=resolve, process_gone=process_gone(pod))
        if view.exists:  # not an agent answering for an empty volume (agentview): seeded, or restored into
            view = replace(view, platform_ready=pod_ready(pod))
        if view.reachable and pod is not None and pod["metadata"].get("deletionTimestamp"):
            # Deleted (a drain, an eviction, a person): its agent gets SIGTERM and says so in a moment,
            # but the deletion's own watch event wakes the loop first; a poll later is up to 2 s lost.
            view = replace(view, terminating=True)
        if not wanted and pod is None:
            view = MemberView(name=name, ordinal=ordinal, exists=False, stopped=True, absent=True)
        if view.absent and name in lost_volumes:
            view = replace(view, data_present=False)
        views.append(view)
    return views


def pod_ready(pod: JSON | None) -> bool:
    """The kubelet's Ready condition: what puts the pod's address among its Services' ready endpoints."""
    conditions = ((pod or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def rw_routes(objects: ClusterObjects) -> frozenset[str] | None:
    """The members the -rw Service routes to: the ready endpoints of its EndpointSlices (what kube-proxy
    programs), by the pod they name. None when the slices are not watched."""
    if objects.rw_slices is None:
        return None
    routed = set()
    for endpoint_slice in objects.rw_slices:
        for endpoint in endpoint_slice.get("endpoints") or []:
            # An unset ready condition means ready (discovery.k8s.io/v1).
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            target = endpoint.get("targetRef") or {}
            if target.get("kind") == "Pod" and target.get("name"):
                routed.add(str(target["name"]))
    return frozenset(routed)


def slice_summary(body: Mapping[str, Any]) -> JSON:
    """What the operator keeps of an EndpointSlice (its index): who writes it and where it routes."""
    meta = body.get("metadata") or {}
    endpoints = [
        {
            "addresses": e.get("addresses") or [],
            "conditions": e.get("conditions") or {},
            "targetRef": e.get("targetRef") or {},
        }
        for e in body.get("endpoints") or []
    ]
    managed_by = (meta.get("labels") or {}).get(names.LABEL_SLICE_MANAGED_BY)
    return {"name": meta.get("name"), "managedBy": managed_by, "endpoints": endpoints}


def rw_slice(objects: ClusterObjects) -> JSON | None:
    """The -rw slice the operator writes, as the watch last saw it."""
    return next(
        (
            s
            for s in objects.rw_slices or []
            if s.get("managedBy") == names.SLICE_MANAGER and s.get("name") == names.rw_slice(objects.name)
        ),
        None,
    )


def rw_member(objects: ClusterObjects) -> str | None:
    """The member the operator's -rw slice names: its one ready endpoint, at its pod's current address
    (a pod made again has another: the engine points the slice at it again)."""
    found = rw_slice(objects)
    endpoints = [e for e in (found or {}).get("endpoints") or [] if (e.get("conditions") or {}).get("ready")]
    if len(endpoints) != 1:
        return None
    name = (endpoints[0].get("targetRef") or {}).get("name")
    ip = pod_ip(objects.pod(str(name))) if name else None
    return str(name) if ip is not None and ip in (endpoints[0].get("addresses") or []) else None


def _cluster_of(obj: JSON) -> str | None:
    return ((obj.get("spec") or {}).get("cluster") or {}).get("name")


def backups(objects: ClusterObjects) -> tuple[BackupView, ...]:
    views = []
    for backup in objects.backups:
        if _cluster_of(backup) != objects.name:
            continue
        views.append(BackupView.of(backup))
    return tuple(sorted(views, key=lambda b: b.name))


def restores(objects: ClusterObjects) -> tuple[RestoreView, ...]:
    views = []
    for restore in objects.restores:
        if _cluster_of(restore) != objects.name:
            continue
        spec = restore.get("spec") or {}
        target = spec.get("target") or {}
        meta = restore["metadata"]
        views.append(
            RestoreView(
                name=meta["name"],
                backup=spec.get("backup"),
                snapshot_id=spec.get("snapshotId"),
                target_time=target.get("time"),
                target_lsn=target.get("lsn"),
                target_immediate=bool(target.get("immediate")),
                phase=(restore.get("status") or {}).get("phase") or "Pending",
                created_at=parse_time(meta.get("creationTimestamp")),
            )
        )
    return tuple(sorted(views, key=lambda r: r.name))


def pods_of_job(objects: ClusterObjects, job: JSON) -> list[JSON]:
    """The pods of a Job (the Job controller labels them with its name)."""
    job_name = job["metadata"]["name"]
    found = []
    for pod in objects.job_pods:
        labels = pod["metadata"].get("labels") or {}
        if job_name in (labels.get("job-name"), labels.get("batch.kubernetes.io/job-name")):
            found.append(pod)
    return found


def job_result(objects: ClusterObjects, job: JSON) -> JSON:
    """The JSON summary a Job's container left as its termination message (its last pod's), or {}."""
    found: JSON = {}
    for pod in pods_of_job(objects, job):
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (container.get("state") or {}).get("terminated") or {}
            result = parse_result(terminated.get("message"))
            if result:
                found = result
    return found


def failed_pod_error(objects: ClusterObjects, job: JSON) -> str | None:
    """What a failed Job's command said last (its log's tail, left as its termination message), from
    its newest pod that says anything: pgherd-backup's one-line error."""
    pods = sorted(
        pods_of_job(objects, job), key=lambda pod: str(pod["metadata"].get("creationTimestamp") or "")
    )
    said = [error for pod in pods if (error := job_error(pod))]
    return said[-1] if said else None


def jobs(objects: ClusterObjects) -> tuple[JobView, ...]:
    """Snapshot Jobs (labelled with their Backup), with the summary their pod left."""
    views = []
    for job in objects.jobs:
        labels = job["metadata"].get("labels") or {}
        backup = labels.get(names.LABEL_BACKUP)
        if backup is None or labels.get(names.LABEL_COMPONENT) != names.COMPONENT_SNAPSHOT:
            continue
        state = job_state(job)
        result = job_result(objects, job) if state is not JobState.RUNNING else {}
        failure = failed_pod_error(objects, job) if state is JobState.FAILED else None
        since, why = job_waiting(objects, job) if state is JobState.RUNNING else (None, "")
        views.append(
            JobView(
                kind=JobKind.SNAPSHOT,
                name=backup,
                state=state,
                member=labels.get(names.LABEL_MEMBER),
                message=str(result.get("error") or failure or _failure_message(job) or ""),
                backup_id=result.get("backupId") or result.get("backup_id") or result.get("id"),
                timeline=result.get("timeline"),
                waiting_since=since,
                waiting_reason=why,
            )
        )
    return tuple(views)


def pod_started(pod: JSON) -> bool:
    """A container of the pod has run (running or terminated, now or before a restart): the pod got past
    scheduling, its image and its Secrets."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Running", "Succeeded", "Failed"):
        return True
    for container in status.get("containerStatuses") or []:
        if {"running", "terminated"} & set(container.get("state") or {}):
            return True
        if (container.get("lastState") or {}).get("terminated"):
            return True
    return False


def job_waiting(objects: ClusterObjects, job: JSON) -> tuple[datetime | None, str]:
    """A running Job that waits for its pod to start: since when (the pod's creation; with no pod at
    all, the Job's) and why, as the scheduler or the kubelet says it (pod_problems' classification;
    else the normal wait, ContainerCreating, or the phase). (None, "") once its pod has started, between
    two attempts, and when the watch has not shown a pod the Job counts."""
    pods = pods_of_job(objects, job)
    active = [
        pod
        for pod in pods
        if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        and not pod["metadata"].get("deletionTimestamp")
    ]
    if any(pod_started(pod) for pod in active):
        return None, ""
    if active:  # one at a time (parallelism 1); the newest while one is replaced
        pod = max(active, key=lambda p: str(p["metadata"].get("creationTimestamp") or ""))
        since = parse_time(pod["metadata"].get("creationTimestamp"))
        return (since, _waiting_reason(pod)) if since is not None else (None, "")
    counted = job.get("status") or {}
    if pods or any(int(counted.get(key) or 0) for key in ("active", "succeeded", "failed")):
        return None, ""
    name = job["metadata"]["name"]
    since = parse_time(job["metadata"].get("creationTimestamp"))
    why = f"no pod of Job {name}: the Job controller could not create one (kubectl describe job {name})"
    return (since, why) if since is not None else (None, "")


def _waiting_reason(pod: JSON) -> str:
    problems = pod_problems_of(pod)
    if problems:
        return "; ".join(problem.describe() for problem in problems)
    name = str(pod["metadata"]["name"])
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            reason = condition.get("reason") or "NotScheduled"
            return PodProblem(name, str(reason), str(condition.get("message") or "")).describe()
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):
            return PodProblem(name, str(waiting["reason"]), str(waiting.get("message") or "")).describe()
    return f"pod {name}: {status.get('phase') or 'Pending'}"


def job_state(job: JSON) -> JobState:
    status = job.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("status") != "True":
            continue
        if condition.get("type") in ("Complete", "SuccessCriteriaMet"):
            return JobState.SUCCEEDED
        if condition.get("type") in ("Failed", "FailureTarget"):
            return JobState.FAILED
    if int(status.get("succeeded") or 0) > 0:
        return JobState.SUCCEEDED
    return JobState.RUNNING


def _failure_message(job: JSON) -> str:
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Failed" and condition.get("status") == "True":
            return f"{condition.get('reason', '')}: {condition.get('message', '')}".strip(": ")
    return ""


def parse_result(message: str | None) -> JSON:
    """A termination message holding the Job's JSON summary (its last JSON line)."""
    if not message:
        return {}
    for line in reversed(message.strip().splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            return doc
    return {}


def cluster_view(
    objects: ClusterObjects,
    statuses: Mapping[str, Status | None],
    now: datetime,
    *,
    switchover_to: str | None,
    image: str | None = None,
    extra_jobs: Iterable[JobView] = (),
    lost_volumes: Set[str] = frozenset(),
    busy: Set[str] = frozenset(),
) -> ClusterView:
    """``busy``: members with an action sent by the operator and still awaited (its agent may not say so
    yet)."""
    meta = objects.cluster["metadata"]
    views = tuple(
        replace(m, busy=True) if m.name in busy and not m.busy else m
        for m in members(objects, statuses, lost_volumes)
    )
    # The archiver of the primary (pg_stat_archiver, and why wal-push last failed) says how archiving goes.
    primary = next((statuses.get(m.name) for m in views if m.is_primary), None)
    return ClusterView(
        cluster=objects.name,
        now=now,
        members=views,
        archiving_healthy=primary.archiving_healthy if primary is not None else None,
        archiving_error=primary.archive_error if primary is not None else None,
        backups=backups(objects),
        restores=restores(objects),
        jobs=jobs(objects) + tuple(extra_jobs),
        deleting=bool(meta.get("deletionTimestamp")),
        generation=meta.get("generation"),
        switchover_to=switchover_to,
        rw_member=rw_member(objects),
        rw_routes=rw_routes(objects),
        image=image,
        restart=restart_request(meta),
        **upgrade_requests(meta),
    )


# Waiting reasons the kubelet reports while a container starts normally: not problems.
_STARTING = frozenset({"ContainerCreating", "PodInitializing"})


@dataclass(frozen=True)
class PodProblem:
    pod: str
    reason: str  # the kubelet's waiting reason, or Unschedulable
    message: str

    def describe(self) -> str:
        return f"pod {self.pod}: {self.reason}" + (f": {self.message}" if self.message else "")


def pod_problems(objects: ClusterObjects) -> list[PodProblem]:
    """What the scheduler and the kubelet say of the cluster's pods (members and Jobs) that cannot
    start: unschedulable, or a container waiting for a reason that needs a person (a missing Secret or
    key: CreateContainerConfigError; ErrImagePull, ImagePullBackOff, InvalidImageName; CrashLoopBackOff;
    ...). The normal waits of a starting container are not problems."""
    return [problem for pod in [*objects.pods, *objects.job_pods] for problem in pod_problems_of(pod)]


def pod_problems_of(pod: JSON) -> list[PodProblem]:
    """What the scheduler and the kubelet say of one pod that cannot start (see ``pod_problems``)."""
    found = []
    name = str(pod["metadata"]["name"])
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            found.append(PodProblem(name, "Unschedulable", str(condition.get("message") or "")))
    for container in [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]:
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason and reason not in _STARTING:
            found.append(PodProblem(name, str(reason), str(waiting.get("message") or "")))
    return found
