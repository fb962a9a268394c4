"""An emulated node for the emulated API server: a test-side "kubelet" plus the StatefulSet and Job
controllers, so that pods created through tests/kube/emulator.py really run, as local processes.

:class:`ClusterSim` talks to any API server over HTTP (the emulator's URL and a bearer token), from
its own thread and event loop: it watches pods, StatefulSets and Jobs in every namespace (a watch
only wakes a level-triggered reconcile, which also runs every ``resync`` seconds)::

    server = EmulatedApiServer(crds=[CRDS_DIR], graceful_pod_deletion=True, tokens={"t": "me"})
    server.start()
    with ClusterSim(server.url, root_dir, token="t") as sim:   # start() ... stop()
        server.create(statefulset_manifest)
        sim.pvc_dir("default", "data-web-0"); sim.pod_log("default", "web-0")

Use the emulator with ``graceful_pod_deletion=True`` (``@pytest.mark.kube_emulator(...)``): pods
are then only marked on delete and go when this kubelet confirms, as with a real kubelet.

What it does
------------
* Scheduling: a pod without ``spec.nodeName`` is bound at once to the node ``emulated`` (a Node
  object of that name is created, Ready), unless that Node is cordoned (``spec.unschedulable``, as
  ``kubectl cordon`` sets it): the pod then stays Pending, with the condition PodScheduled False,
  reason Unschedulable and the scheduler's message, until the node is uncordoned.
* kubelet, for each pod on the node:

  - one loopback address per pod as ``status.podIP`` (127.0.0.2, 127.0.0.3, ... from ``first_ip``),
    never reused while the simulator runs; ``hostIP`` 127.0.0.1;
  - volumes as directories under ``root``: ``secret`` and ``configMap`` (a file per key, ``items``
    and modes honoured, owned by root and the run account's group as ``fsGroup`` would make them),
    ``emptyDir`` (fresh per pod), ``persistentVolumeClaim`` (``root/volumes/<ns>/<claim>``, which
    outlives its pods; the PVC is marked Bound with its requested capacity, the PV controller's
    part; a claim deleted and made again under the same name gets a new, empty directory, as with
    reclaimPolicy Delete), ``downwardAPI`` (name, namespace, uid, labels, annotations; written once);
  - **paths are mapped**: no pod has its own root filesystem, so a container's mount paths do not
    exist here. Every env value and every command argument that starts with a mount path (or an
    argument ``--flag=PATH`` whose PATH does) is rewritten to the materialised directory, as is the
    ``terminationMessagePath`` (``/dev/termination-log``), which becomes a per-container file;
    ``workingDir`` likewise. Paths a program builds itself (e.g. a hard-coded ``/tmp``) are not;
  - the container's command (``command`` + ``args``, ``$(VAR)`` expanded; there are no images, so a
    container without ``command`` fails) run from the project's virtualenv (``PATH`` starts with
    ``.venv/bin``, so ``python``, ``pgherd`` and ``pgherd-backup`` resolve) as the unprivileged
    PostgreSQL account when we are root (``PGHERD_PG_USER``, default ``postgres``; the tests' own
    account), in its own session, output to ``pods/<ns>/<pod>-<uid>/<container>.log``;
  - environment: a clean one (``PATH``, ``HOSTNAME``, ``HOME`` and ``TMPDIR`` inside the pod's
    directory, ``TMPDIR`` the emptyDir mounted at /tmp when there is one), then ``envFrom``
    (secretRef, configMapRef, prefix) and ``env`` (value, secretKeyRef, configMapKeyRef, fieldRef
    metadata.name/namespace/uid/labels/annotations, status.podIP/hostIP, spec.nodeName/
    serviceAccountName). **Emulation necessity**: every pod shares this machine's ports, so the
    process also gets ``PGHERD_LISTEN`` and ``PGHERD_PG_LISTEN`` set to its pod IP (unless the
    container sets them), else two agents would both bind 0.0.0.0:8008 (``pgherd instance run``
    defaults to 0.0.0.0 and ``*``); a kubelet cannot change a pod's spec, this one changes only the
    process's environment;
  - probes (startup, then liveness and readiness; httpGet with HTTPS not verified, as the kubelet
    does not; tcpSocket; exec in the container's environment) on their periods, thresholds and
    initial delays (``max_probe_period`` caps the periods to speed tests up); status written
    through the status subresource: phase Pending -> Running -> Succeeded/Failed, conditions
    PodScheduled, Initialized, ContainersReady, Ready, containerStatuses (ready, started, state
    waiting/running/terminated, lastState, restartCount, a fake containerID);
  - exits: the termination message is the mapped termination-log file (at most 4096 bytes) or, with
    ``FallbackToLogsOnError``, the tail of the output when the file is empty and the exit code is
    not 0; ``restartPolicy`` Always / OnFailure restart after a short exponential backoff
    (``restart_backoff``, CrashLoopBackOff meanwhile), a liveness or startup probe beyond its
    failureThreshold kills the container (then restartPolicy applies);
  - deletion (``deletionTimestamp``): SIGTERM to the container's main process (as a container
    runtime signals PID 1 only), SIGKILL to every process of its tree after the grace period
    (``deletionGracePeriodSeconds``), then a final status and DELETE with gracePeriodSeconds 0.
    A pod that vanishes without the kubelet (no graceful deletion, a forced delete) is killed the
    same way with a 2 s grace. When the main process exits, whatever it left running (PostgreSQL
    started in its own session) is SIGKILLed, as the end of a container's PID namespace would.
* StatefulSet controller: pods ``<sts>-<ordinal>`` for ordinals below ``spec.replicas``
  (``spec.ordinals.start`` honoured) from the template (plus ``statefulset.kubernetes.io/pod-name``,
  ``apps.kubernetes.io/pod-index``, ``controller-revision-hash``, hostname/subdomain, an owning
  controller reference), their PVCs ``<template>-<pod>`` first (the template's labels plus the
  selector's; owned by the StatefulSet only with ``whenDeleted: Delete``, deleted on scale-down only
  with ``whenScaled: Delete``); excess ordinals deleted highest first (podManagementPolicy Parallel:
  all at once; OrderedReady: one at a time, and creation waits for the lower ordinals to be Ready);
  a missing pod is recreated once the old one is gone (and its processes too); Failed pods are
  deleted and recreated; ``updateStrategy`` is treated as OnDelete (a running pod is never replaced
  on a template change); status: observedGeneration, replicas, readyReplicas, availableReplicas,
  currentReplicas, updatedReplicas, currentRevision, updateRevision (a hash of the template).
* Job controller: one pod at a time (``generateName <job>-``, labels job-name,
  batch.kubernetes.io/job-name, controller-uid, batch.kubernetes.io/controller-uid, an owning
  controller reference) until ``completions`` (default 1) succeeded; a failed pod is retried after a
  short backoff up to ``backoffLimit``; status startTime, active, ready, succeeded, failed,
  completionTime and the conditions Complete, or Failed with reason BackoffLimitExceeded or
  DeadlineExceeded (``activeDeadlineSeconds``; the active pods are deleted); ``suspend`` honoured.
* Garbage collection is the emulator's (owner cascade by uid, which covers pods owned by StatefulSets
  and Jobs and PVCs owned by StatefulSets).

What it does not do
-------------------
No images, no root filesystem, no user/PID/network/mount namespaces, no cgroups: resources,
securityContext (beyond the run account), readOnly mounts and read-only root filesystems are not
enforced; every pod sees the whole machine and the others' files. One container per pod: init
containers, sidecars and ephemeral containers are not run (a second container is reported waiting).
No image pulls, no Services' proxying, no DNS (hostname/subdomain names do not resolve), no
Endpoints or EndpointSlices, no NetworkPolicies, no Events, no ``kubectl logs``/``exec`` (read
``pod_log``), no ControllerRevision objects, no RollingUpdate for StatefulSets, no
minReadySeconds, no preemption, node affinity, taints or anti-affinity (one node). Secret and
ConfigMap volumes are written once at start (no refresh on change). Jobs: no parallelism,
indexed completions, pod failure policies, ``ttlSecondsAfterFinished``, or backoff counting of
OnFailure restarts; no FailureTarget/SuccessCriteriaMet conditions.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import hashlib
import ipaddress
import json
import logging
import os
import pwd
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from pgherd_backup.postgres.process import Account, ProcessEntry, grant_traverse, process_table

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv"
NODE_NAME = "emulated"
HOST_IP = "127.0.0.1"
TERMINATION_LOG = "/dev/termination-log"
MAX_MESSAGE = 4096
VANISHED_GRACE = 2.0
# The scheduler's message for a pod when the only node is cordoned (Kubernetes 1.30).
UNSCHEDULABLE_MESSAGE = (
    "0/1 nodes are available: 1 node(s) were unschedulable. preemption: 0/1 nodes are available:"
    " 1 Preemption is not helpful for scheduling."
)
TICK = 0.1

LABEL_POD_NAME = "statefulset.kubernetes.io/pod-name"
LABEL_POD_INDEX = "apps.kubernetes.io/pod-index"
LABEL_REVISION = "controller-revision-hash"
JOB_LABELS = ("job-name", "batch.kubernetes.io/job-name")
JOB_UID_LABELS = ("controller-uid", "batch.kubernetes.io/controller-uid")

log = logging.getLogger("cluster_sim")
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()


def _owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or ())


def _controller_ref(owner: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _condition(obj: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in (obj.get("status") or {}).get("conditions") or ():
        if cond.get("type") == kind:
            return cond
    return None


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    cond = _condition(pod, "Ready")
    return bool(cond and cond.get("status") == "True")


def _run_account(name: str | None) -> Account | None:
    """The account the pods' processes run as: the PostgreSQL account when we are root, else us."""
    if os.geteuid() != 0:
        return None
    entry = pwd.getpwnam(name or os.environ.get("PGHERD_PG_USER", "postgres"))
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def _phase(pod: Mapping[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


# --------------------------------------------------------------------------------------------------
# The API: a thin aiohttp client.


class ApiStatus(Exception):
    def __init__(self, code: int, body: str):
        super().__init__(f"{code}: {body[:300]}")
        self.code = code


class Api:
    def __init__(self, url: str, token: str | None):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30))
        self.probes = aiohttp.ClientSession()  # no API token for the pods' endpoints

    async def close(self) -> None:
        await self.session.close()
        await self.probes.close()

    async def request(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        headers = {
            "Content-Type": "application/merge-patch+json" if method == "PATCH" else "application/json"
        }
        data = None if body is None else json.dumps(body)
        async with self.session.request(
            method, self.url + path, data=data, headers=headers, params=params or None
        ) as response:
            text = await response.text()
            if response.status >= 400:
                raise ApiStatus(response.status, text)
            return json.loads(text) if text else None

    async def list(self, path: str, **params: Any) -> list[dict[str, Any]]:
        return list((await self.request("GET", path, **params)).get("items") or [])

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)  # type: ignore[no-any-return]
        except ApiStatus as exc:
            if exc.code == 404:
                return None
            raise

    async def quiet(
        self, method: str, path: str, body: Any = None, *, ok: tuple[int, ...] = (404, 409)
    ) -> Any:
        """A write whose 404/409 (gone, exists, conflict) means "nothing to do"."""
        try:
            return await self.request(method, path, body)
        except ApiStatus as exc:
            if exc.code in ok:
                return None
            raise

    async def watch(self, path: str, wake: asyncio.Event) -> None:
        """Set ``wake`` on every event of a watch on ``path``; reconnect forever."""
        while True:
            try:
                async with self.session.get(
                    self.url + path,
                    params={"watch": "true", "timeoutSeconds": "300"},
                    timeout=aiohttp.ClientTimeout(total=None, sock_read=None),
                ) as response:
                    async for _line in response.content:
                        wake.set()
            except (TimeoutError, aiohttp.ClientError) as exc:
                log.debug("watch %s: %s", path, exc)
            await asyncio.sleep(0.5)
            wake.set()


def _ns_path(group_version: str, plural: str, namespace: str, name: str = "", sub: str = "") -> str:
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


# --------------------------------------------------------------------------------------------------
# Processes.


def _descendants(root: int, table: dict[int, ProcessEntry]) -> dict[int, str]:
    children: dict[int, list[int]] = {}
    for pid, entry in table.items():
        children.setdefault(entry.ppid, []).append(pid)
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found[child] = table[child].start
                todo.append(child)
    return found


class Container:
    """One run of a container's process, and every process it started (tracked by pid and start
    time, since PostgreSQL's postmaster leaves the agent's session and is reparented if it dies)."""

    def __init__(
        self, argv: list[str], env: dict[str, str], cwd: str, log_path: Path, account: Account | None
    ):
        self.log_path = log_path
        with log_path.open("ab") as out:
            out.write(f"--- {_now()} {' '.join(argv)}\n".encode())
            out.flush()
            extra: dict[str, Any] = {}
            if account is not None:
                extra = {"user": account.uid, "group": account.gid, "extra_groups": []}
            self.proc = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **extra,
            )
        self.tree: dict[int, str] = {}
        self.started_at = _now()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def track(self) -> None:
        table = process_table()
        self.tree.update(_descendants(self.proc.pid, table))

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill_rest(self) -> None:
        """SIGKILL what the process left running (its tree as last seen, and their descendants)."""
        table = process_table()
        alive = {pid: start for pid, start in self.tree.items() if pid in table and table[pid].start == start}
        for pid in list(alive):
            alive.update(_descendants(pid, table))
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.tree.clear()

    async def terminate(self, grace: float) -> None:
        """SIGTERM the main process, SIGKILL everything after ``grace`` seconds; wait for the main."""
        self.track()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while self.proc.poll() is None and time.monotonic() < deadline:
                self.track()
                await asyncio.sleep(TICK)
            if self.proc.poll() is None:
                self.track()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
        self.kill_rest()
        while self.proc.poll() is None:
            await asyncio.sleep(TICK / 2)

    def message(self, path: Path, policy: str, code: int) -> str:
        text = ""
        with contextlib.suppress(OSError):
            text = path.read_bytes()[:MAX_MESSAGE].decode("utf-8", errors="replace")
        if not text and code != 0 and policy == "FallbackToLogsOnError":
            with contextlib.suppress(OSError):
                lines = self.log_path.read_bytes().decode("utf-8", errors="replace").splitlines()
                text = "\n".join(lines[-80:])[-2048:]
        return text


# --------------------------------------------------------------------------------------------------
# The kubelet's part for one pod.


class MissingReference(Exception):
    """A Secret, ConfigMap or PVC the pod needs does not exist (yet)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class PodWorker:
    """Runs one pod (by uid) from its first sight until its object is gone."""

    def __init__(self, sim: ClusterSim, pod: dict[str, Any], ip: str):
        self.sim = sim
        self.pod = pod
        meta = pod["metadata"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.ip = ip
        self.dir = sim.root / "pods" / self.namespace / f"{self.name}-{self.uid[:8]}"
        spec = pod["spec"]
        self.spec_container: dict[str, Any] = (spec.get("containers") or [{}])[0]
        self.cname: str = self.spec_container.get("name", "main")
        self.log_path = self.dir / f"{self.cname}.log"
        self.message_path = self.dir / f"{self.cname}.termination-log"
        self.restart_policy: str = spec.get("restartPolicy") or "Always"
        self.deleted = asyncio.Event()  # deletionTimestamp seen, or the object vanished
        self.vanished = False
        self.grace_override: float | None = None
        self.kill_reason: str | None = None
        self.container: Container | None = None
        self.mounts: list[tuple[str, str]] = []
        self.env: dict[str, str] = {}
        self.restart_count = 0
        self.started = False
        self.ready = False
        self.phase = "Pending"
        self.state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict[str, Any] = {}
        self.start_time = _now()
        self.transitions: dict[str, tuple[str, str]] = {}
        self.published: dict[str, Any] | None = None
        self.task: asyncio.Task[None] | None = None

    # -- the API --------------------------------------------------------------------------------

    def update(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.deleted.set()

    def vanish(self) -> None:
        self.vanished = True
        self.deleted.set()

    def _conditions(self) -> list[dict[str, Any]]:
        values = {
            "PodScheduled": True,
            "Initialized": True,
            "ContainersReady": self.ready,
            "Ready": self.ready,
        }
        out = []
        for kind, value in values.items():
            status = "True" if value else "False"
            if self.transitions.get(kind, ("", ""))[0] != status:
                self.transitions[kind] = (status, _now())
            out.append({"type": kind, "status": status, "lastTransitionTime": self.transitions[kind][1]})
        return out

    def status(self) -> dict[str, Any]:
        container_status: dict[str, Any] = {
            "name": self.cname,
            "image": self.spec_container.get("image", ""),
            "imageID": "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container is not None:
            container_status["containerID"] = f"emulated://{self.container.pid}"
        statuses = [container_status]
        for other in (self.pod["spec"].get("containers") or [])[1:]:
            statuses.append(
                {
                    "name": other.get("name"),
                    "image": other.get("image", ""),
                    "imageID": "",
                    "ready": False,
                    "started": False,
                    "restartCount": 0,
                    "state": {"waiting": {"reason": "NotEmulated", "message": "one container per pod"}},
                    "lastState": {},
                }
            )
        return {
            "phase": self.phase,
            "conditions": self._conditions(),
            "hostIP": HOST_IP,
            "hostIPs": [{"ip": HOST_IP}],
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "qosClass": "BestEffort",
            "containerStatuses": statuses,
        }

    async def publish(self) -> None:
        status = self.status()
        if status == self.published or self.vanished:
            return
        path = _ns_path("v1", "pods", self.namespace, self.name, "status")
        current = await self.sim.api.get(_ns_path("v1", "pods", self.namespace, self.name))
        if current is None or current["metadata"]["uid"] != self.uid:
            return
        await self.sim.api.quiet("PATCH", path, {"status": status})
        self.published = status

    # -- volumes and environment ----------------------------------------------------------------

    async def _object(self, plural: str, name: str, optional: bool) -> dict[str, Any] | None:
        obj = await self.sim.api.get(_ns_path("v1", plural, self.namespace, name))
        if obj is None and not optional:
            kind = "secret" if plural == "secrets" else "configmap"
            raise MissingReference("CreateContainerConfigError", f'{kind} "{name}" not found')
        return obj

    @staticmethod
    def _data(obj: Mapping[str, Any] | None, secret: bool) -> dict[str, bytes]:
        if obj is None:
            return {}
        if secret:
            out = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
            out.update({k: v.encode() for k, v in (obj.get("stringData") or {}).items()})
            return out
        out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return out

    def _write_files(self, target: Path, files: list[tuple[str, bytes, int]]) -> None:
        target.mkdir(parents=True, exist_ok=True)
        os.chmod(target, 0o755)
        gid = self.sim.account.gid if self.sim.account else None
        for rel, content, mode in files:
            path = target / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            os.chmod(path, mode)
            if gid is not None:
                os.chown(path, 0, gid)

    def _give(self, path: Path, mode: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, mode)
        if self.sim.account is not None:
            os.chown(path, self.sim.account.uid, self.sim.account.gid)

    async def _materialise(self, volume: Mapping[str, Any]) -> Path:
        target = self.dir / "volumes" / volume["name"]
        for kind, plural in (("secret", "secrets"), ("configMap", "configmaps")):
            source = volume.get(kind)
            if source is None:
                continue
            name = source.get("secretName") if kind == "secret" else source.get("name")
            obj = await self._object(plural, name, bool(source.get("optional")))
            data = self._data(obj, kind == "secret")
            default_mode = int(source.get("defaultMode", 0o644))
            if source.get("items"):
                files = []
                for item in source["items"]:
                    if item["key"] not in data:
                        if source.get("optional"):
                            continue
                        raise MissingReference("ContainerCreating", f"{kind} {name}: no key {item['key']}")
                    files.append((item["path"], data[item["key"]], int(item.get("mode", default_mode))))
            else:
                files = [(key, value, default_mode) for key, value in data.items()]
            self._write_files(target, files)
            return target
        if "emptyDir" in volume:
            self._give(target, 0o777)
            return target
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            pvc_path = _ns_path("v1", "persistentvolumeclaims", self.namespace, claim)
            pvc = await self.sim.api.get(pvc_path)
            if pvc is None:
                raise MissingReference("ContainerCreating", f'persistentvolumeclaim "{claim}" not found')
            if _phase(pvc) != "Bound":
                size = (
                    ((pvc.get("spec") or {}).get("resources") or {}).get("requests", {}).get("storage", "1Gi")
                )
                bound = {
                    "status": {
                        "phase": "Bound",
                        "accessModes": pvc["spec"].get("accessModes") or [],
                        "capacity": {"storage": size},
                    }
                }
                await self.sim.api.quiet("PATCH", pvc_path + "/status", bound)
            path = self.sim.provision(self.namespace, claim, str(pvc["metadata"]["uid"]))
            if not path.exists():
                self._give(path, 0o775)
            return path
        if "downwardAPI" in volume:
            files = []
            meta = self.pod["metadata"]
            for item in volume["downwardAPI"].get("items") or ():
                field = (item.get("fieldRef") or {}).get("fieldPath", "")
                if field in ("metadata.labels", "metadata.annotations"):
                    values = meta.get(field.split(".")[1]) or {}
                    text = "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
                else:
                    text = self._field(field)
                mode = int(item.get("mode", volume["downwardAPI"].get("defaultMode", 0o644)))
                files.append((item["path"], text.encode(), mode))
            self._write_files(target, files)
            return target
        raise MissingReference("ContainerCreating", f"volume {volume['name']}: a kind this emulation lacks")

    def _field(self, path: str) -> str:
        meta = self.pod["metadata"]
        match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if match:
            return str((meta.get(match[1]) or {}).get(match[2], ""))
        values = {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "metadata.uid": self.uid,
            "status.podIP": self.ip,
            "status.podIPs": self.ip,
            "status.hostIP": HOST_IP,
            "spec.nodeName": self.pod["spec"].get("nodeName") or self.sim.node_name,
            "spec.serviceAccountName": self.pod["spec"].get("serviceAccountName") or "default",
        }
        return values.get(path, "")

    def map_path(self, value: str) -> str:
        """A container path as the local path it was materialised at (see the module docstring)."""
        if value.startswith("-") and "=" in value:
            flag, rest = value.split("=", 1)
            return f"{flag}={self.map_path(rest)}"
        for mount, local in self.mounts:
            if value == mount or value.startswith(mount.rstrip("/") + "/"):
                return local + value[len(mount) :]
        return value

    async def prepare(self) -> None:
        """Volumes, mounts and the environment; raises MissingReference while something is missing."""
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o755)
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes") or ()}
        mounts: list[tuple[str, str]] = []
        for mount in self.spec_container.get("volumeMounts") or ():
            volume = volumes.get(mount["name"])
            if volume is None:
                raise MissingReference("CreateContainerConfigError", f"no volume {mount['name']}")
            local = await self._materialise(volume)
            if mount.get("subPath"):
                local = local / mount["subPath"]
                if not local.exists():
                    self._give(local, 0o775)
            mounts.append((mount["mountPath"].rstrip("/") or "/", str(local)))
        self.message_path.write_bytes(b"")
        if self.sim.account is not None:
            os.chown(self.message_path, self.sim.account.uid, self.sim.account.gid)
        mounts.append(
            (self.spec_container.get("terminationMessagePath") or TERMINATION_LOG, str(self.message_path))
        )
        self.mounts = sorted(mounts, key=lambda m: len(m[0]), reverse=True)
        self.env = await self._environment()

    async def _environment(self) -> dict[str, str]:
        home = self.dir / "home"
        self._give(home, 0o700)
        tmp = next((local for mount, local in self.mounts if mount == "/tmp"), None)
        if tmp is None:
            self._give(self.dir / "tmp", 0o1777)
            tmp = str(self.dir / "tmp")
        # The node's own values: local paths already, never mapped (a clone under /tmp, say, is no
        # container path under a volume mounted at /tmp).
        node: dict[str, str] = {
            "PATH": f"{self.sim.venv / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOSTNAME": self.pod["spec"].get("hostname") or self.name,
            "HOME": str(home),
            "TMPDIR": tmp,
            "LANG": "C.UTF-8",
            "PGHERD_LISTEN": self.ip,
            "PGHERD_PG_LISTEN": self.ip,
        }
        if "PG_BIN" in os.environ:
            node["PG_BIN"] = os.environ["PG_BIN"]
        env = dict(node)
        for source in self.spec_container.get("envFrom") or ():
            prefix = source.get("prefix", "")
            for kind, plural in (("secretRef", "secrets"), ("configMapRef", "configmaps")):
                if kind in source:
                    ref = source[kind]
                    obj = await self._object(plural, ref["name"], bool(ref.get("optional")))
                    for key, value in self._data(obj, plural == "secrets").items():
                        env[prefix + key] = value.decode("utf-8", errors="replace")
        for var in self.spec_container.get("env") or ():
            value = await self._env_value(var, env)
            if value is not None:
                env[var["name"]] = value
        return {key: value if node.get(key) == value else self.map_path(value) for key, value in env.items()}

    async def _env_value(self, var: Mapping[str, Any], env: Mapping[str, str]) -> str | None:
        if "valueFrom" not in var:
            return _VAR.sub(lambda m: env.get(m[1], m[0]), str(var.get("value", "")))
        source = var["valueFrom"]
        for kind, plural in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
            if kind in source:
                ref = source[kind]
                obj = await self._object(plural, ref["name"], bool(ref.get("optional")))
                data = self._data(obj, plural == "secrets")
                if ref["key"] not in data:
                    if ref.get("optional"):
                        return None
                    raise MissingReference(
                        "CreateContainerConfigError", f"couldn't find key {ref['key']} in {ref['name']}"
                    )
                return data[ref["key"]].decode("utf-8", errors="replace")
        if "fieldRef" in source:
            return self._field(source["fieldRef"]["fieldPath"])
        return None

    def argv(self) -> list[str]:
        spec = self.spec_container
        argv = [*(spec.get("command") or ()), *(spec.get("args") or ())]
        if not spec.get("command"):
            raise MissingReference("CreateContainerError", "no command: this emulation runs no images")
        return [self.map_path(_VAR.sub(lambda m: self.env.get(m[1], m[0]), arg)) for arg in argv]

    # -- probes -----------------------------------------------------------------------------------

    def _port(self, port: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for declared in self.spec_container.get("ports") or ():
            if declared.get("name") == port:
                return int(declared["containerPort"])
        raise ValueError(f"no port named {port}")

    async def probe(self, spec: Mapping[str, Any]) -> bool:
        timeout = float(spec.get("timeoutSeconds", 1))
        try:
            if "httpGet" in spec:
                http = spec["httpGet"]
                scheme = str(http.get("scheme", "HTTP")).lower()
                host = http.get("host") or self.ip
                url = f"{scheme}://{host}:{self._port(http['port'])}{http.get('path', '/')}"
                headers = {h["name"]: h["value"] for h in http.get("httpHeaders") or ()}
                async with self.sim.api.probes.get(
                    url,
                    headers={"User-Agent": "kube-probe/emulated", **headers},
                    ssl=False,
                    timeout=aiohttp.ClientTimeout(total=timeout),
                    allow_redirects=False,
                ) as response:
                    return 200 <= response.status < 400
            if "tcpSocket" in spec:
                tcp = spec["tcpSocket"]
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(tcp.get("host") or self.ip, self._port(tcp["port"])), timeout
                )
                writer.close()
                return True
            if "exec" in spec:
                command = [self.map_path(arg) for arg in spec["exec"]["command"]]
                extra: dict[str, Any] = {}
                if self.sim.account is not None:
                    extra = {"user": self.sim.account.uid, "group": self.sim.account.gid, "extra_groups": []}
                proc = await asyncio.create_subprocess_exec(
                    *command,
                    env=self.env,
                    cwd="/",
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                    **extra,
                )
                try:
                    return await asyncio.wait_for(proc.wait(), timeout) == 0
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
                    return False
        except (TimeoutError, OSError, aiohttp.ClientError, ValueError):
            return False
        return False

    async def probe_loop(self, kind: str, spec: Mapping[str, Any], changed: asyncio.Event) -> None:
        period = float(spec.get("periodSeconds", 10))
        if self.sim.max_probe_period is not None:
            period = min(period, self.sim.max_probe_period)
        failures_allowed = int(spec.get("failureThreshold", 3))
        successes_needed = int(spec.get("successThreshold", 1))
        await asyncio.sleep(float(spec.get("initialDelaySeconds", 0)))
        successes = failures = 0
        while True:
            if kind != "startup" and not self.started:
                await asyncio.sleep(TICK)
                continue
            ok = await self.probe(spec)
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            if kind == "startup":
                if ok:
                    self.started = True
                    changed.set()
                    return
                if failures >= failures_allowed:
                    self.kill_reason = "startup probe failed"
                    changed.set()
                    return
            elif kind == "liveness" and failures >= failures_allowed:
                self.kill_reason = "liveness probe failed"
                changed.set()
                return
            elif kind == "readiness":
                if ok and successes >= successes_needed and not self.ready:
                    self.ready = True
                    changed.set()
                elif not ok and failures >= failures_allowed and self.ready:
                    self.ready = False
                    changed.set()
            await asyncio.sleep(period)

    # -- the lifecycle ----------------------------------------------------------------------------

    async def _sleep_unless_deleted(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.deleted.wait(), seconds)

    def _grace(self) -> float:
        if self.grace_override is not None:
            return self.grace_override
        if self.vanished:
            return VANISHED_GRACE
        meta = self.pod["metadata"]
        if meta.get("deletionGracePeriodSeconds") is not None:
            return float(meta["deletionGracePeriodSeconds"])
        return float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

    async def run(self) -> None:
        try:
            await self._run()
        except Exception:
            log.exception("pod %s/%s", self.namespace, self.name)
        if self.container is not None:
            await self.container.terminate(0)
        await self._wait_gone()

    async def _wait_gone(self) -> None:
        """Wait until the object is marked or gone, then confirm its deletion (grace 0)."""
        await self.deleted.wait()
        if not self.vanished:
            await self.publish()
            path = _ns_path("v1", "pods", self.namespace, self.name)
            await self.sim.api.quiet(
                "DELETE", path, {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}}
            )

    async def _run(self) -> None:
        await self.publish()
        while not self.deleted.is_set():
            try:
                await self.prepare()
                argv = self.argv()
                break
            except MissingReference as exc:
                self.state = {"waiting": {"reason": exc.reason, "message": exc.message}}
                await self.publish()
                await self._sleep_unless_deleted(1.0)
        else:
            return
        while not self.deleted.is_set():
            code = await self._run_once(argv)
            if code is None:  # deleted while it ran
                break
            restart = self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and code != 0)
            if not restart:
                self.phase = "Succeeded" if code == 0 else "Failed"
                await self.publish()
                return
            delay = min(self.sim.restart_backoff[1], self.sim.restart_backoff[0] * 2**self.restart_count)
            self.last_state, self.state = self.state, {"waiting": {"reason": "CrashLoopBackOff"}}
            await self.publish()
            await self._sleep_unless_deleted(delay)
            if self.deleted.is_set():
                break
            self.restart_count += 1
        if self.phase != "Pending" and self.phase not in ("Succeeded", "Failed"):
            last = self.state.get("terminated") or self.last_state.get("terminated") or {}
            self.phase = "Succeeded" if last.get("exitCode") == 0 else "Failed"

    async def _run_once(self, argv: list[str]) -> int | None:
        """Run the container once; its exit code, or None when the pod was deleted meanwhile."""
        self.message_path.write_bytes(b"")
        cwd = self.map_path(self.spec_container.get("workingDir") or "/")
        try:
            container = Container(argv, self.env, cwd, self.log_path, self.sim.account)
        except OSError as exc:
            self.state = {
                "terminated": {
                    "exitCode": 128,
                    "reason": "StartError",
                    "message": str(exc),
                    "finishedAt": _now(),
                }
            }
            return 128
        self.container = container
        self.kill_reason = None
        probes = {
            kind: self.spec_container.get(f"{kind}Probe") for kind in ("startup", "liveness", "readiness")
        }
        self.started = probes["startup"] is None
        self.ready = self.started and probes["readiness"] is None
        self.phase = "Running"
        self.state = {"running": {"startedAt": container.started_at}}
        changed = asyncio.Event()
        tasks = [
            asyncio.create_task(self.probe_loop(kind, spec, changed))
            for kind, spec in probes.items()
            if spec is not None
        ]
        await self.publish()
        deleted = False
        try:
            ticks = 0
            while container.poll() is None:
                if self.deleted.is_set():
                    deleted = True
                    await container.terminate(self._grace())
                    break
                if self.kill_reason is not None:
                    grace = float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
                    await container.terminate(grace)
                    break
                if changed.is_set():
                    changed.clear()
                    if self.started and probes["readiness"] is None:
                        self.ready = True
                    await self.publish()
                ticks += 1
                if ticks % 10 == 1:
                    container.track()
                await asyncio.sleep(TICK)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        container.kill_rest()
        code = container.proc.returncode
        exit_code = code if code >= 0 else 128 - code
        policy = self.spec_container.get("terminationMessagePolicy", "File")
        terminated: dict[str, Any] = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": container.started_at,
            "finishedAt": _now(),
            "containerID": f"emulated://{container.pid}",
        }
        if code < 0:
            terminated["signal"] = -code
        message = container.message(self.message_path, policy, exit_code)
        if message:
            terminated["message"] = message
        self.state = {"terminated": terminated}
        self.ready = False
        self.started = False
        if deleted:
            self.phase = "Succeeded" if exit_code == 0 else "Failed"
        await self.publish()
        return None if deleted else exit_code

    async def stop(self) -> None:
        """At the simulator's stop: terminate the container (stop_grace), leave the object alone."""
        self.grace_override = self.sim.stop_grace
        self.vanish()
        if self.task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.task), self.sim.stop_grace + 10)
            except Exception:
                self.task.cancel()
        if self.container is not None:
            await self.container.terminate(0)


# --------------------------------------------------------------------------------------------------
# The simulator: scheduler, kubelet, StatefulSet and Job controllers.


class ClusterSim:
    """An emulated node and the controllers, running against the API server at ``api_url``.

    ``root``: where pods' directories and PVCs' directories go (must be traversable by the run
    account: under the tests' ``work_root``); ``token``: the bearer token to use; ``first_ip``: the
    first pod IP; ``max_probe_period``: cap on probe periods (seconds; None: the pods' own);
    ``restart_backoff``: (first, cap) seconds between container restarts; ``job_backoff``: (first,
    cap) seconds before a failed Job pod is replaced; ``stop_grace``: SIGTERM-to-SIGKILL time at
    ``stop()``; ``run_as``: the account name when root (default: the PostgreSQL account).
    """

    def __init__(
        self,
        api_url: str,
        root: str | Path,
        *,
        token: str | None = "emulator",
        node_name: str = NODE_NAME,
        first_ip: str = "127.0.0.2",
        venv: Path = VENV,
        max_probe_period: float | None = None,
        restart_backoff: tuple[float, float] = (1.0, 10.0),
        job_backoff: tuple[float, float] = (0.5, 5.0),
        stop_grace: float = 10.0,
        resync: float = 1.0,
        run_as: str | None = None,
    ):
        self.api_url = api_url
        self.token = token
        self.root = Path(root)
        self.node_name = node_name
        self.venv = venv
        self.max_probe_period = max_probe_period
        self.restart_backoff = restart_backoff
        self.job_backoff = job_backoff
        self.stop_grace = stop_grace
        self.resync = resync
        self.account = _run_account(run_as)
        self._next_ip = int(ipaddress.IPv4Address(first_ip))
        self.workers: dict[str, PodWorker] = {}
        self._job_retry: dict[str, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.api: Api = None  # type: ignore[assignment]  # made in the simulator's loop
        self.errors: list[str] = []

    # -- the test-facing API ----------------------------------------------------------------------

    def start(self) -> ClusterSim:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        grant_traverse(self.root, self.venv / "bin" / "python")
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main()), name="cluster-sim", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("the cluster simulator did not start")
        return self

    def stop(self, timeout: float = 60) -> None:
        """Stop the controllers and kill every process started (SIGTERM, SIGKILL after stop_grace)."""
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> ClusterSim:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def pvc_dir(self, namespace: str, claim: str) -> Path:
        """The directory that is the PVC's volume."""
        return self.root / "volumes" / namespace / claim

    def provision(self, namespace: str, claim: str, uid: str) -> Path:
        """The claim's volume directory. A claim whose uid is not the one the directory was made for (the
        claim was deleted and made again) gets a new, empty volume: the old directory is removed, as a
        dynamically provisioned volume with reclaimPolicy Delete is. ``.<claim>.uid`` records the uid."""
        path = self.pvc_dir(namespace, claim)
        path.parent.mkdir(parents=True, exist_ok=True)
        marker = path.parent / f".{claim}.uid"
        known = marker.read_text() if marker.exists() else None
        if known == uid:
            return path
        if known is not None and path.exists():
            # Renamed first: the old pod's processes may still run (killed after their grace period).
            doomed = path.parent / f".{claim}.deleted-{known}"
            path.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        marker.write_text(uid)
        return path

    def pod_dir(self, namespace: str, pod: str) -> Path | None:
        """The directory of the running pod of that name (volumes, logs, termination logs)."""
        for worker in list(self.workers.values()):
            if worker.namespace == namespace and worker.name == pod:
                return worker.dir
        return None

    def pod_log(self, namespace: str, pod: str) -> str:
        """The output of the pod's container (every run), of the last pod of that name."""
        runs = sorted(
            (self.root / "pods" / namespace).glob(f"{pod}-{'?' * 8}/*.log"), key=lambda p: p.stat().st_mtime
        )
        return runs[-1].read_text(errors="replace") if runs else ""

    # -- the loop -----------------------------------------------------------------------------------

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self.api = Api(self.api_url, self.token)
        watches = [
            asyncio.create_task(self.api.watch(path, self._wake))
            for path in ("/api/v1/pods", "/apis/apps/v1/statefulsets", "/apis/batch/v1/jobs")
        ]
        try:
            await self._register_node()
            self._ready.set()
            while not self._stop.is_set():
                self._wake.clear()
                try:
                    await self.reconcile()
                except Exception as exc:  # a failure is logged and retried at the next pass
                    log.exception("reconcile")
                    self.errors.append(repr(exc))
                stop = asyncio.create_task(self._stop.wait())
                wake = asyncio.create_task(self._wake.wait())
                await asyncio.wait({stop, wake}, timeout=self.resync, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                wake.cancel()
                await asyncio.sleep(0.05)  # coalesce bursts of events
        finally:
            self._ready.set()
            for task in watches:
                task.cancel()
            await asyncio.gather(*watches, return_exceptions=True)
            await asyncio.gather(*(worker.stop() for worker in list(self.workers.values())))
            await self.api.close()

    async def _register_node(self) -> None:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.node_name, "labels": {"kubernetes.io/hostname": self.node_name}},
        }
        await self.api.quiet("POST", "/api/v1/nodes", node, ok=(404, 409, 403))
        status = {
            "status": {
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": _now()}],
                "addresses": [{"type": "InternalIP", "address": HOST_IP}],
            }
        }
        await self.api.quiet("PATCH", f"/api/v1/nodes/{self.node_name}/status", status, ok=(404, 403))

    async def reconcile(self) -> None:
        pods = await self.api.list("/api/v1/pods")
        await self.sync_pods(pods)
        for sts in await self.api.list("/apis/apps/v1/statefulsets"):
            await self.sync_statefulset(sts, pods)
        for job in await self.api.list("/apis/batch/v1/jobs"):
            await self.sync_job(job, pods)

    def _allocate_ip(self) -> str:
        ip = str(ipaddress.IPv4Address(self._next_ip))
        self._next_ip += 1
        return ip

    # -- scheduler and kubelet ---------------------------------------------------------------------

    async def sync_pods(self, pods: list[dict[str, Any]]) -> None:
        seen = set()
        cordoned: bool | None = None  # read once per pass, only when a pod waits to be scheduled
        for pod in pods:
            meta, spec = pod["metadata"], pod["spec"]
            if not spec.get("nodeName"):
                if not meta.get("deletionTimestamp"):
                    if cordoned is None:
                        cordoned = await self._cordoned()
                    if cordoned:
                        await self._unschedulable(pod)
                        continue
                    path = _ns_path("v1", "pods", meta["namespace"], meta["name"])
                    await self.api.quiet("PATCH", path, {"spec": {"nodeName": self.node_name}})
                continue
            if spec["nodeName"] != self.node_name:
                continue
            seen.add(meta["uid"])
            worker = self.workers.get(meta["uid"])
            if worker is not None:
                worker.update(pod)
                continue
            if meta.get("deletionTimestamp") or _phase(pod) in ("Succeeded", "Failed"):
                # Not ours (a previous simulator's) or done: nothing runs, confirm the deletion.
                if meta.get("deletionTimestamp"):
                    path = _ns_path("v1", "pods", meta["namespace"], meta["name"])
                    await self.api.quiet("DELETE", path, {"gracePeriodSeconds": 0})
                continue
            worker = PodWorker(self, pod, self._allocate_ip())
            self.workers[meta["uid"]] = worker
            worker.task = asyncio.create_task(self._run_worker(worker))
        for uid, worker in list(self.workers.items()):
            if uid not in seen:
                worker.vanish()

    async def _cordoned(self) -> bool:
        try:
            node = await self.api.get(f"/api/v1/nodes/{self.node_name}") or {}
        except ApiStatus:  # not allowed to read it (as when registering it): never cordoned
            return False
        return bool((node.get("spec") or {}).get("unschedulable"))

    async def _unschedulable(self, pod: dict[str, Any]) -> None:
        """What the scheduler reports of a pod no node takes (the only node cordoned)."""
        if _condition(pod, "PodScheduled") is not None:
            return
        meta = pod["metadata"]
        condition = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": UNSCHEDULABLE_MESSAGE,
            "lastProbeTime": None,
            "lastTransitionTime": _now(),
        }
        path = _ns_path("v1", "pods", meta["namespace"], meta["name"], "status")
        await self.api.quiet("PATCH", path, {"status": {"phase": "Pending", "conditions": [condition]}})

    async def _run_worker(self, worker: PodWorker) -> None:
        try:
            await worker.run()
        finally:
            self.workers.pop(worker.uid, None)
            if self._wake is not None:
                self._wake.set()

    def _running(self, namespace: str, name: str) -> bool:
        return any(w.namespace == namespace and w.name == name for w in self.workers.values())

    # -- the StatefulSet controller -----------------------------------------------------------------

    async def sync_statefulset(self, sts: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        meta, spec = sts["metadata"], sts["spec"]
        if meta.get("deletionTimestamp"):
            return
        ns, name = meta["namespace"], meta["name"]
        template = spec["template"]
        revision = f"{name}-{hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]}"
        replicas = int(spec.get("replicas", 1))
        start = int((spec.get("ordinals") or {}).get("start", 0))
        parallel = spec.get("podManagementPolicy") == "Parallel"
        owned: dict[int, dict[str, Any]] = {}
        for pod in pods:
            pod_name = pod["metadata"]["name"]
            if pod["metadata"]["namespace"] == ns and _owned_by(pod, meta["uid"]):
                suffix = pod_name[len(name) + 1 :]
                if pod_name.startswith(name + "-") and suffix.isdigit():
                    owned[int(suffix)] = pod
        wanted = range(start, start + replicas)
        policy = spec.get("persistentVolumeClaimRetentionPolicy") or {}
        # Failed pods are replaced.
        for pod in owned.values():
            if _phase(pod) == "Failed" and not pod["metadata"].get("deletionTimestamp"):
                await self.api.quiet("DELETE", _ns_path("v1", "pods", ns, pod["metadata"]["name"]))
        # Create the missing ordinals.
        for ordinal in wanted:
            pod_name = f"{name}-{ordinal}"
            if ordinal in owned or self._running(ns, pod_name):
                continue
            if not parallel and any(not _pod_ready(owned[o]) for o in range(start, ordinal) if o in owned):
                break
            if not parallel and any(o not in owned for o in range(start, ordinal)):
                break
            await self._create_member(sts, ordinal, revision, policy)
            if not parallel:
                break
        # Delete the excess ordinals, highest first.
        for ordinal in sorted((o for o in owned if o not in wanted), reverse=True):
            pod = owned[ordinal]
            if not pod["metadata"].get("deletionTimestamp"):
                await self.api.quiet("DELETE", _ns_path("v1", "pods", ns, pod["metadata"]["name"]))
                if policy.get("whenScaled") == "Delete":
                    for claim in spec.get("volumeClaimTemplates") or ():
                        pvc = f"{claim['metadata']['name']}-{pod['metadata']['name']}"
                        await self.api.quiet("DELETE", _ns_path("v1", "persistentvolumeclaims", ns, pvc))
            if not parallel:
                break
        await self._statefulset_status(sts, list(owned.values()), revision)

    async def _create_member(
        self, sts: dict[str, Any], ordinal: int, revision: str, policy: Mapping[str, Any]
    ) -> None:
        meta, spec = sts["metadata"], sts["spec"]
        ns, name = meta["namespace"], meta["name"]
        pod_name = f"{name}-{ordinal}"
        template = copy.deepcopy(spec["template"])
        selector = (spec.get("selector") or {}).get("matchLabels") or {}
        pod_spec = template.get("spec") or {}
        volumes = [
            v
            for v in pod_spec.get("volumes") or ()
            if v["name"] not in {c["metadata"]["name"] for c in spec.get("volumeClaimTemplates") or ()}
        ]
        for claim in spec.get("volumeClaimTemplates") or ():
            claim_name = f"{claim['metadata']['name']}-{pod_name}"
            pvc: dict[str, Any] = {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {
                    "name": claim_name,
                    "namespace": ns,
                    "labels": {**(claim["metadata"].get("labels") or {}), **selector},
                },
                "spec": copy.deepcopy(claim.get("spec") or {}),
            }
            if claim["metadata"].get("annotations"):
                pvc["metadata"]["annotations"] = dict(claim["metadata"]["annotations"])
            if policy.get("whenDeleted") == "Delete":
                pvc["metadata"]["ownerReferences"] = [{**_controller_ref(sts), "controller": False}]
            await self.api.quiet("POST", _ns_path("v1", "persistentvolumeclaims", ns), pvc)
            volumes.append(
                {"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim_name}}
            )
        pod_spec["volumes"] = volumes
        pod_spec["hostname"] = pod_name
        if spec.get("serviceName"):
            pod_spec["subdomain"] = spec["serviceName"]
        tmeta = template.get("metadata") or {}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "namespace": ns,
                "labels": {
                    **(tmeta.get("labels") or {}),
                    LABEL_POD_NAME: pod_name,
                    LABEL_POD_INDEX: str(ordinal),
                    LABEL_REVISION: revision,
                },
                "annotations": dict(tmeta.get("annotations") or {}),
                "ownerReferences": [_controller_ref(sts)],
            },
            "spec": pod_spec,
        }
        await self.api.quiet("POST", _ns_path("v1", "pods", ns), pod)

    async def _statefulset_status(
        self, sts: dict[str, Any], pods: list[dict[str, Any]], revision: str
    ) -> None:
        old = sts.get("status") or {}
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        updated = [p for p in live if p["metadata"].get("labels", {}).get(LABEL_REVISION) == revision]
        current_revision = old.get("currentRevision") or revision
        if len(updated) == len(live) == int(sts["spec"].get("replicas", 1)):
            current_revision = revision
        current = [p for p in live if p["metadata"].get("labels", {}).get(LABEL_REVISION) == current_revision]
        ready = sum(1 for p in live if _pod_ready(p))
        status = {
            "observedGeneration": sts["metadata"].get("generation", 1),
            "replicas": len(live),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "currentReplicas": len(current),
            "updatedReplicas": len(updated),
            "currentRevision": current_revision,
            "updateRevision": revision,
            "collisionCount": 0,
        }
        if any(old.get(k) != v for k, v in status.items()):
            path = _ns_path(
                "apps/v1", "statefulsets", sts["metadata"]["namespace"], sts["metadata"]["name"], "status"
            )
            await self.api.quiet("PATCH", path, {"status": status})

    # -- the Job controller ---------------------------------------------------------------------------

    async def sync_job(self, job: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        meta, spec = job["metadata"], job["spec"]
        if meta.get("deletionTimestamp"):
            return
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        old = job.get("status") or {}
        mine = [p for p in pods if p["metadata"]["namespace"] == ns and _owned_by(p, uid)]
        active = [
            p
            for p in mine
            if _phase(p) not in ("Succeeded", "Failed") and not p["metadata"].get("deletionTimestamp")
        ]
        succeeded = sum(1 for p in mine if _phase(p) == "Succeeded")
        failed = sum(1 for p in mine if _phase(p) == "Failed")
        status: dict[str, Any] = {
            "startTime": old.get("startTime") or _now(),
            "active": len(active),
            "ready": sum(1 for p in active if _pod_ready(p)),
            "succeeded": succeeded,
            "failed": failed,
        }
        conditions = list(old.get("conditions") or [])
        finished = any(
            c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in conditions
        )
        if not finished and not spec.get("suspend"):
            completions = int(spec.get("completions") or 1)
            deadline = spec.get("activeDeadlineSeconds")
            outcome: tuple[str, str, str] | None = None
            if succeeded >= completions:
                outcome = ("Complete", "", "")
                status["completionTime"] = _now()
            elif failed > int(spec.get("backoffLimit", 6)):
                outcome = ("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
            elif deadline is not None and time.time() - _parse_time(status["startTime"]) > float(deadline):
                outcome = ("Failed", "DeadlineExceeded", "Job was active longer than specified deadline")
            if outcome is not None:
                cond = {
                    "type": outcome[0],
                    "status": "True",
                    "lastProbeTime": _now(),
                    "lastTransitionTime": _now(),
                }
                if outcome[1]:
                    cond.update(reason=outcome[1], message=outcome[2])
                conditions.append(cond)
                if outcome[0] == "Failed":
                    for pod in active:
                        await self.api.quiet("DELETE", _ns_path("v1", "pods", ns, pod["metadata"]["name"]))
                    status["active"] = 0
            elif not active:
                retry_at = self._job_retry.get(uid, 0.0)
                if failed and retry_at == 0.0:
                    first, cap = self.job_backoff
                    self._job_retry[uid] = time.monotonic() + min(cap, first * 2 ** (failed - 1))
                elif time.monotonic() >= retry_at:
                    self._job_retry.pop(uid, None)
                    await self._create_job_pod(job)
                    status["active"] = 1
        if conditions:
            status["conditions"] = conditions
        if any(old.get(k) != v for k, v in status.items() if k not in ("startTime",)) or not old.get(
            "startTime"
        ):
            path = _ns_path("batch/v1", "jobs", ns, name, "status")
            await self.api.quiet("PATCH", path, {"status": status})

    async def _create_job_pod(self, job: dict[str, Any]) -> None:
        meta = job["metadata"]
        template = copy.deepcopy(job["spec"]["template"])
        tmeta = template.get("metadata") or {}
        labels = dict(tmeta.get("labels") or {})
        labels.update(dict.fromkeys(JOB_LABELS, meta["name"]))
        labels.update(dict.fromkeys(JOB_UID_LABELS, meta["uid"]))
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "generateName": f"{meta['name']}-",
                "namespace": meta["namespace"],
                "labels": labels,
                "annotations": dict(tmeta.get("annotations") or {}),
                "ownerReferences": [_controller_ref(job)],
            },
            "spec": template.get("spec") or {},
        }
        await self.api.request("POST", _ns_path("v1", "pods", meta["namespace"]), pod)
