"""kopf's side of `pgherd operator`: a registry of handlers built per operator instance (so that tests
run two operators in one process), kopf's settings under pgherd.io names, and the per-cluster daemon.

- Indexes (fed by kopf's watches): member and Job pods, PVCs, Jobs, StatefulSets of every cluster,
  Backups and Restores by cluster. The daemon reads them: no list request per tick.
- A daemon per PostgresCluster runs ClusterLoop.tick() while this operator holds the Lease; kopf
  cancels it (``cancellation_timeout``) when the cluster is deleted, so deletion is never blocked.
- Watch events on a cluster or its pods wake its loop at once. Every handler is a coroutine: kopf runs
  a plain function in a thread pool, which costs a thread hop per watch event and would set the loops'
  asyncio.Events from another thread (not thread-safe: a woken loop might not notice until later).
- No kopf peering: leader election is pgherd's own Lease (see leader.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from pgherd.api.annotations import RESTART, ROTATE_CERTIFICATES
from pgherd.api.cluster import VolumeDeletePolicy
from pgherd.kube import heap, metrics, names
from pgherd.kube.api import Credentials, KubeApi, RetryPolicy
from pgherd.kube.leader import AlwaysLeader, LeaderElector
from pgherd.kube.loop import ClusterLoop, OperatorConfig, Wakeups
from pgherd.kube.objects import delete_volumes
from pgherd.kube.observe import ClusterObjects, slice_summary
from pgherd_backup.logformat import log_context

log = logging.getLogger("pgherd.kube")

CANCELLATION_TIMEOUT = 10.0
# A Lease renewal retried briefly: the election's own loop tries again every few seconds, and a renewal
# must land within the renew deadline to count.
ELECTION_RETRY = RetryPolicy(attempts=3, max_retry_after=2.0, max_backoff=1.0)
JSON = dict[str, Any]


@dataclass
class Election:
    """--leader-elect: the Lease's namespace and name, and this replica's identity."""

    namespace: str
    name: str
    identity: str
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry: float = 2.0


@dataclass
class Operator:
    config: OperatorConfig = field(default_factory=OperatorConfig)
    election: Election | None = None
    credentials: Credentials | None = None  # None: discovered at startup (in-cluster, else kubeconfig)
    # What kopf logs in with: the same server and CA, and the token (in-cluster: the file's current one).
    login_info: kopf.ConnectionInfo | None = None
    api: KubeApi | None = None
    election_api: KubeApi | None = None
    leader: LeaderElector | AlwaysLeader | None = None
    wakeups: Wakeups = field(default_factory=Wakeups)
    loops: dict[tuple[str, str], ClusterLoop] = field(default_factory=dict)
    _election_task: asyncio.Task[None] | None = None
    # Freeze the heap once the clusters have settled (heap.py): `pgherd operator` does; tests that run
    # operators inside pytest's process do not.
    freeze_heap: bool = False
    _heap_task: asyncio.Task[None] | None = None
    # The loops' starting ticks (ClusterLoop.starting), at most as many at once as the API connections:
    # 2,000 of them at once each waited for a pooled connection holding what it had built, and failed
    # when the wait was longer than the request's timeout.
    starting: asyncio.Semaphore | None = None

    def holding(self) -> bool:
        return self.leader is not None and self.leader.holding()


class ConstantDiffBase(kopf.AnnotationsDiffBaseStorage):
    """pgherd registers no create/update/field handlers: each cluster's loop reads the spec itself. kopf's
    diff-base (what it last handled) would cost a deep copy of the object on every watch event and a
    metadata patch (one more write, one more watch event) after every spec change; here the essence is
    constant, stored once per object. Deletion handlers follow deletionTimestamp, not the diff."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return {}

    def make_keys(self, key: str, *, body: kopf.Body | None = None) -> Iterable[str]:
        """The annotation's names, formed once (kopf forms them, a hash included, to look the stored
        essence up on every watch event of every cluster)."""
        marked = key if body is None else self.mark_key(key, body=body)
        keys = self._keys.get(marked)
        if keys is None:
            keys = self._keys[marked] = tuple(super().make_keys(marked))
        return keys

    _keys: dict[str, tuple[str, ...]]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._keys = {}


def _key(namespace: str | None, cluster: str | None) -> tuple[str, str] | None:
    return None if namespace is None or cluster is None else (namespace, cluster)


def _plain(body: kopf.Body) -> JSON:
    """The object as a dict of its own (its top level copied). kopf's Body is a view of the last watch
    event's dict: that dict is copied at once rather than key by key through the view, at every tick of
    every loop."""
    src = getattr(body, "_src", None)
    if isinstance(src, dict) and not getattr(body, "_path", ()):
        return dict(src)
    return {k: v for k, v in dict(body).items()}


def _indexed(body: kopf.Body) -> JSON:
    """What an index keeps of an object: all but metadata.managedFields, the write history that nothing
    here reads (a few KB an object, held for every object of every cluster)."""
    plain = _plain(body)
    meta = plain.get("metadata") or {}
    if "managedFields" in meta:
        plain["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    return plain


def _indexed_statefulset(body: kopf.Body) -> JSON:
    """Of a StatefulSet, the loop reads its metadata and spec.replicas (ClusterObjects.replicas): its pod
    template, most of the object, is built anew from the spec and need not be kept."""
    plain = _indexed(body)
    plain["spec"] = {"replicas": (body.get("spec") or {}).get("replicas")}
    return plain


def _values(index: kopf.Index[Any, Any], key: tuple[str, str]) -> list[JSON]:
    store = index.get(key)
    return list(store) if store is not None else []


def _user_fingerprint(meta: Mapping[str, Any]) -> object:
    """What a user (or kubectl scale) changes of a cluster: the spec (its generation), a deletion, the
    switchover, restart and certificate rotation requests. Not the loop's own writes (status, its
    restore record), nor kopf's last-handled-configuration annotation."""
    annotations = meta.get("annotations") or {}
    requests = (
        annotations.get(names.ANNOTATION_SWITCHOVER),
        annotations.get(RESTART),
        annotations.get(ROTATE_CERTIFICATES),
    )
    return (meta.get("generation"), meta.get("deletionTimestamp"), requests)


def build(operator: Operator) -> tuple[kopf.OperatorRegistry, kopf.OperatorSettings]:
    registry = kopf.OperatorRegistry()
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = names.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.PROGRESS_PREFIX)
    settings.persistence.diffbase_storage = ConstantDiffBase(
        prefix=names.PROGRESS_PREFIX, key="last-handled-configuration"
    )
    settings.peering.standalone = True
    settings.posting.level = logging.WARNING
    # The API server sizes a watch's buffer once, from its cache's recent event rate (10 to 100 events):
    # a watch opened while the clusters were quiet keeps 10 through a later burst and is closed as
    # unresponsive. Reopened every minute (kopf resumes from its resourceVersion), it follows the rate.
    settings.watching.server_timeout = 60
    settings.networking.request_timeout = 30

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> kopf.ConnectionInfo:
        # Called again by kopf after a 401: in-cluster, the token is then read again from its file.
        if operator.credentials is None:
            operator.credentials, operator.login_info = Credentials.discover(kwargs["settings"])
        creds = operator.credentials
        info = operator.login_info or kopf.ConnectionInfo(
            server=creds.server,
            token=creds.token,
            scheme="Bearer" if creds.token else None,
            insecure=creds.ssl_context is False,
        )
        return creds.kopf_info(info)

    @kopf.on.startup(registry=registry)
    async def startup(**_: Any) -> None:
        if operator.credentials is None:
            # kopf runs startup before its login: kopf must then log in with these same credentials,
            # CA included (a ConnectionInfo without it fails on an in-cluster API server's certificate).
            operator.credentials, operator.login_info = Credentials.discover()
        operator.api = KubeApi(operator.credentials, pool=operator.config.api_pool)
        operator.starting = asyncio.Semaphore(operator.api.pool)
        if operator.election is None:
            operator.leader = AlwaysLeader()
        else:
            e = operator.election
            # Its own connections: a Lease renewal never waits behind the clusters' requests.
            operator.election_api = KubeApi(
                operator.credentials,
                pool=2,
                user_agent="pgherd-leader-election",
                retry=ELECTION_RETRY,
            )
            operator.leader = LeaderElector(
                operator.election_api,
                e.namespace,
                e.name,
                e.identity,
                lease_duration=e.lease_duration,
                renew_deadline=e.renew_deadline,
                retry=e.retry,
            )
        operator._election_task = asyncio.get_running_loop().create_task(operator.leader.run(), name="leader")
        metrics.LEADER.set_function(lambda: 1.0 if operator.holding() else 0.0)
        metrics.CLUSTERS.active = operator.holding
        if operator.freeze_heap:
            operator._heap_task = asyncio.get_running_loop().create_task(
                heap.keep_frozen(
                    lambda: operator.loops, lambda: any(lp.starting for lp in operator.loops.values())
                ),
                name="heap",
            )

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        for task in (operator._election_task, operator._heap_task):
            if task is not None:
                task.cancel()
        for loop in list(operator.loops.values()):
            await loop.close()
        for api in (operator.api, operator.election_api):
            if api is not None:
                await api.close()

    cluster_labels = {names.LABEL_CLUSTER: kopf.PRESENT}

    @kopf.index("pods", labels=cluster_labels, id="pgherd_pods", registry=registry)
    async def pgherd_pods(**kwargs: Any) -> Any:
        key = _key(kwargs["namespace"], kwargs["labels"].get(names.LABEL_CLUSTER))
        if key is None:
            return None
        operator.wakeups.wake(*key)
        return {key: _indexed(kwargs["body"])}

    @kopf.index("persistentvolumeclaims", labels=cluster_labels, id="pgherd_pvcs", registry=registry)
    async def pgherd_pvcs(**kwargs: Any) -> Any:
        key = _key(kwargs["namespace"], kwargs["labels"].get(names.LABEL_CLUSTER))
        return None if key is None else {key: _indexed(kwargs["body"])}

    @kopf.index("batch", "v1", "jobs", labels=cluster_labels, id="pgherd_jobs", registry=registry)
    async def pgherd_jobs(**kwargs: Any) -> Any:
        key = _key(kwargs["namespace"], kwargs["labels"].get(names.LABEL_CLUSTER))
        if key is None:
            return None
        operator.wakeups.wake(*key)
        return {key: _indexed(kwargs["body"])}

    @kopf.index(
        "apps", "v1", "statefulsets", labels=cluster_labels, id="pgherd_statefulsets", registry=registry
    )
    async def pgherd_statefulsets(**kwargs: Any) -> Any:
        key = _key(kwargs["namespace"], kwargs["labels"].get(names.LABEL_CLUSTER))
        return None if key is None else {key: _indexed_statefulset(kwargs["body"])}

    @kopf.index(
        "discovery.k8s.io", "v1", "endpointslices", labels=cluster_labels, id="pgherd_rw_slices",
        registry=registry,
    )  # fmt: skip
    async def pgherd_rw_slices(**kwargs: Any) -> Any:
        # The -rw Service's slices only (the operator's own, and the controller's of a Service made by
        # an earlier version), and of each only what says where it routes (observe.rw_routes, rw_member).
        labels = kwargs["labels"]
        cluster = labels.get(names.LABEL_CLUSTER)
        key = _key(kwargs["namespace"], cluster)
        if key is None or labels.get(names.LABEL_SERVICE_NAME) != names.service_rw(str(cluster)):
            return None
        operator.wakeups.wake(*key)
        return {key: slice_summary(kwargs["body"])}

    @kopf.index(names.GROUP, names.VERSION, names.PLURAL_BACKUPS, id="pgherd_backups", registry=registry)
    async def pgherd_backups(**kwargs: Any) -> Any:
        key = _key(kwargs["namespace"], (kwargs["spec"].get("cluster") or {}).get("name"))
        if key is None:
            return None
        operator.wakeups.wake(*key)
        return {key: _indexed(kwargs["body"])}

    @kopf.index(names.GROUP, names.VERSION, names.PLURAL_RESTORES, id="pgherd_restores", registry=registry)
    async def pgherd_restores(**kwargs: Any) -> Any:
        key = _key(kwargs["namespace"], (kwargs["spec"].get("cluster") or {}).get("name"))
        if key is None:
            return None
        operator.wakeups.wake(*key)
        return {key: _indexed(kwargs["body"])}

    def user_change(**kwargs: Any) -> bool:
        """kopf's filter of the handler below, which kopf calls with less of its machinery than a
        handler (about a tenth of the operator's CPU in a spec change of 2,000 clusters went to running
        the handler for each event): whether the event carries a change a user made."""
        # kopf keeps each cluster's latest body for its daemon, and the body here is that very dict: its
        # managedFields (the write history, the status patches' field by field: half of the object, and
        # nothing here reads it) are dropped, for each of thousands of clusters, at every event.
        meta = kwargs["body"].get("metadata") or {}
        if isinstance(meta, dict):
            meta.pop("managedFields", None)
        # Its status too: the loop reads the status from the API when it starts and keeps what it writes
        # (the watch lags behind its writes), and kopf keeps pgherd's progress in annotations.
        raw = getattr(kwargs["body"], "_src", None)
        if isinstance(raw, dict):
            raw.pop("status", None)
        return operator.wakeups.changed(kwargs["namespace"], kwargs["name"], _user_fingerprint(meta))

    @kopf.on.event(
        names.GROUP, names.VERSION, names.PLURAL_CLUSTERS, id="wake", registry=registry, when=user_change
    )
    async def wake_cluster(**kwargs: Any) -> None:
        meta = kwargs["body"].get("metadata") or {}
        operator.wakeups.wake_on_change(kwargs["namespace"], kwargs["name"], _user_fingerprint(meta))

    @kopf.on.delete(
        names.GROUP, names.VERSION, names.PLURAL_CLUSTERS, id="deleted", registry=registry, optional=False
    )
    async def deleted(**kwargs: Any) -> None:
        """The finalizer: the data volumes are kept, unless ``storage.deletePolicy`` is Delete. Only the
        leader acts; another replica leaves the finalizer to it."""
        namespace, name = kwargs["namespace"], kwargs["name"]
        policy = ((kwargs["spec"].get("storage") or {}).get("deletePolicy")) or VolumeDeletePolicy.RETAIN
        if policy != VolumeDeletePolicy.DELETE:
            log.info("%s/%s deleted: its volumes (PVCs) are kept", namespace, name, extra=_names(kwargs))
            return
        if operator.api is None or not operator.holding():
            raise kopf.TemporaryError("not the leader: the leader deletes the volumes", delay=5)
        volumes = await delete_volumes(operator.api, name, _values(kwargs["pgherd_pvcs"], (namespace, name)))
        log.info(
            "%s/%s deleted with its volumes (deletePolicy Delete): %s",
            namespace,
            name,
            volumes or "none",
            extra=_names(kwargs),
        )

    @kopf.daemon(
        names.GROUP,
        names.VERSION,
        names.PLURAL_CLUSTERS,
        registry=registry,
        id="cluster",
        cancellation_timeout=CANCELLATION_TIMEOUT,
        initial_delay=0,
        backoff=1.0,
    )
    async def cluster_daemon(**kwargs: Any) -> None:
        namespace: str = kwargs["namespace"]
        name: str = kwargs["name"]
        body: kopf.Body = kwargs["body"]
        stopped: kopf.DaemonStopped = kwargs["stopped"]
        key = (namespace, name)
        pods: kopf.Index[Any, Any] = kwargs["pgherd_pods"]
        pvcs: kopf.Index[Any, Any] = kwargs["pgherd_pvcs"]
        job_index: kopf.Index[Any, Any] = kwargs["pgherd_jobs"]
        statefulsets: kopf.Index[Any, Any] = kwargs["pgherd_statefulsets"]
        backups: kopf.Index[Any, Any] = kwargs["pgherd_backups"]
        restores: kopf.Index[Any, Any] = kwargs["pgherd_restores"]
        rw_slices: kopf.Index[Any, Any] = kwargs["pgherd_rw_slices"]

        def gather(cluster: JSON) -> ClusterObjects:
            all_pods = _values(pods, key)
            member_pods = [p for p in all_pods if _component(p) == names.COMPONENT_POSTGRES]
            sets = [s for s in _values(statefulsets, key) if s["metadata"]["name"] == names.statefulset(name)]
            return ClusterObjects(
                cluster=cluster,
                pods=member_pods,
                job_pods=[p for p in all_pods if _component(p) != names.COMPONENT_POSTGRES],
                pvcs=_values(pvcs, key),
                jobs=_values(job_index, key),
                statefulset=sets[0] if sets else None,
                backups=_values(backups, key),
                restores=_values(restores, key),
                rw_slices=_values(rw_slices, key),
            )

        with log_context(namespace=namespace, cluster=name):
            await _run_loop(operator, key, body, stopped, gather)

    return registry, settings


async def _run_loop(
    operator: Operator,
    key: tuple[str, str],
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    gather: Callable[[JSON], ClusterObjects],
) -> None:
    """One cluster's loop until kopf stops its daemon: a tick, then a wait for a wake-up or the interval."""
    namespace, name = key
    while operator.api is None:
        await asyncio.sleep(0.05)
    loop = ClusterLoop(
        operator.api, operator.config, holding=operator.holding, gather=gather, body=lambda: _plain(body)
    )
    operator.loops[key] = loop
    wakeup = operator.wakeups.get(namespace, name)
    try:
        while not stopped:
            wakeup.clear()
            try:
                if loop.starting and operator.starting is not None:
                    async with operator.starting:
                        with metrics.RECONCILE.time():
                            await loop.tick()
                else:
                    with metrics.RECONCILE.time():
                        await loop.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s/%s: tick failed; trying again", namespace, name)
            # The interval's end sets the same Event as a watch event: wait_for would cost a Task, and its
            # cancellation, per wait of each of thousands of loops.
            timer = asyncio.get_running_loop().call_later(loop.interval(), wakeup.set)
            try:
                await wakeup.wait()
            finally:
                timer.cancel()
    finally:
        operator.loops.pop(key, None)
        metrics.CLUSTERS.forget(namespace, name)
        await loop.close()


def _names(kwargs: dict[str, Any]) -> JSON:
    """A cluster handler's record names its cluster in a JSON log line (pgherd_backup.logformat)."""
    return {"namespace": kwargs["namespace"], "cluster": kwargs["name"]}


def _component(obj: JSON) -> str | None:
    return (obj["metadata"].get("labels") or {}).get(names.LABEL_COMPONENT)


def run(
    operator: Operator,
    *,
    namespaces: Iterable[str] = (),
    clusterwide: bool = False,
    liveness: str | None = None,
) -> None:
    """Run kopf until it is stopped (SIGTERM, SIGINT)."""
    registry, settings = build(operator)
    kopf.run(
        registry=registry,
        settings=settings,
        standalone=True,
        clusterwide=clusterwide,
        namespaces=list(namespaces),
        liveness_endpoint=liveness,
    )
