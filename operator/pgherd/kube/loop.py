"""One PostgresCluster's loop: observe, decide, write status, act. Run by a kopf daemon.

- Observation costs no API request in the steady state: Pods, PVCs, Jobs, the StatefulSet, Backups
  and Restores come from kopf's watch-fed indexes; the agents' /status are read in parallel over HTTPS.
- The engine's memory (``status.engine``) is read from the API when the loop starts or regains the
  leadership, and kept in memory while it runs: the watch may lag behind the loop's own writes.
- Status is written (status subresource) before any action, and only when it changed.
- Then the owned objects are created when missing and patched when their desired form changes (an
  action like the others; only the Secrets the agents need come first, and their certificates, renewed
  when due, before the status that reports them); Secrets are created once, and only the agents'
  certificates are ever replaced. A refused write sets phase Failed with a condition and an Event; the
  next tick that passes writes the engine's status again.
- Wakes at once on a change of the cluster or of its pods; else every ``interval`` (shorter while an
  operation is in flight: each step of a failover waits for an observation).
- After acting: a restore's progress onto its Restore, and the Backups whose snapshot a prune Job
  deleted marked Expired (retention.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError

from pgherd.agentview import isolation_order
from pgherd.api.annotations import restart_request, rotate_request
from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import EngineStatus, decide, switchover
from pgherd.engine.actions import RecordEvent
from pgherd.engine.conditions import Condition, ConditionType, false, true
from pgherd.engine.lsn import parse_lsn
from pgherd.engine.plan import Decision
from pgherd.engine.revision import spec_revision
from pgherd.engine.status import OperationKind
from pgherd.engine.view import ClusterView, Role
from pgherd.kube import metrics, names
from pgherd.kube.actions import ActContext, NotLeader, apply_all, label_replicas
from pgherd.kube.agents import Agents
from pgherd.kube.api import ApiError, KubeApi
from pgherd.kube.builders.networkpolicy import OperatorPods
from pgherd.kube.builders.secrets import format_time
from pgherd.kube.crashpoint import CrashPoint
from pgherd.kube.events import Events
from pgherd.kube.objects import CertificateCheck, OwnedObjects, expand_volumes
from pgherd.kube.observe import ClusterObjects, PodProblem, cluster_view, pod_ip, pod_problems
from pgherd.kube.restores import Restores
from pgherd.kube.retention import Retention
from pgherd.kube.status import cluster_status, merge_patch, unchanged
from pgherd.kube.volumes import Volumes
from pgherd_backup.timestamps import now_rfc3339

log = logging.getLogger("pgherd.kube.loop")

STEADY_INTERVAL = 2.0
BUSY_INTERVAL = 0.3
# A cluster without pods and without an operation in flight: nothing to ask, and what it waits for (its
# pods, Jobs, its spec) wakes it. Every 2 s it would decide the same again: at 2,000 such clusters a
# quarter of a core, which the API server needs (bench/operator_scale.py).
IDLE_INTERVAL = 10.0
# A tick due when a failure is confirmed comes this much later: the statuses it reads must show it.
DETECTION_SLACK = 0.02
# At most this much earlier than its end is detection's tick started (a poll slowed by a dead agent).
MAX_POLL_LEAD = 0.5
# The user's certificate Secrets (spec.tls) are read again, by name, this often (seconds): the operator
# may not list or watch Secrets, and cert-manager renews weeks ahead of expiry.
CERTIFICATE_SECRETS_INTERVAL = 10.0
API_POOL = 32
JSON = dict[str, Any]


@dataclass
class OperatorConfig:
    """What `pgherd operator` was started with (see commands/operator.py)."""

    postgres_image: str = ""  # PGHERD_POSTGRES_IMAGE: "{major}" stands for spec.postgresVersion
    default_image: str = "ghcr.io/pgherd/pgherd:latest"
    member_address: str = "dns"  # how members reach each other: dns (headless Service) | ip (pod IP)
    agent_scheme: str = "https"
    # The operator's own pods (POD_NAMESPACE, PGHERD_OPERATOR_POD_LABELS): the only source the members'
    # NetworkPolicy lets reach the agents. None: unknown (run outside the chart), the agent port stays open.
    operator_pods: OperatorPods | None = None
    log_format: str = "text"  # --log-format: the members' agents are given it too (PGHERD_LOG_FORMAT)
    steady_interval: float = STEADY_INTERVAL
    busy_interval: float = BUSY_INTERVAL
    idle_interval: float = IDLE_INTERVAL
    certificate_secrets_interval: float = CERTIFICATE_SECRETS_INTERVAL
    # The connections the clusters' requests share (KubeApi's pool), and how many loops' starting ticks
    # (`ClusterLoop.starting`) run at once.
    api_pool: int = API_POOL


@dataclass
class Wakeups:
    """One asyncio.Event per cluster, set by watch events (the cluster, its pods, its jobs)."""

    events: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    seen: dict[tuple[str, str], object] = field(default_factory=dict)

    def get(self, namespace: str, name: str) -> asyncio.Event:
        return self.events.setdefault((namespace, name), asyncio.Event())

    def wake(self, namespace: str, name: str) -> None:
        event = self.events.get((namespace, name))
        if event is not None:
            event.set()

    def changed(self, namespace: str, name: str, fingerprint: object) -> bool:
        """Whether ``fingerprint`` differs from the last one seen for the cluster."""
        return self.seen.get((namespace, name)) != fingerprint

    def wake_on_change(self, namespace: str, name: str, fingerprint: object) -> None:
        """Wake the cluster's loop only when ``fingerprint`` differs from the last one seen."""
        if self.changed(namespace, name, fingerprint):
            self.seen[(namespace, name)] = fingerprint
            self.wake(namespace, name)


class ClusterLoop:
    def __init__(
        self,
        api: KubeApi,
        config: OperatorConfig,
        *,
        holding: Callable[[], bool],
        gather: Callable[[JSON], ClusterObjects],
        body: Callable[[], JSON],
    ) -> None:
        self.api, self.config, self.holding, self.gather, self.body = api, config, holding, gather, body
        meta = body()["metadata"]
        self.name, self.namespace = str(meta["name"]), str(meta["namespace"])
        self.owned = OwnedObjects(api, config)
        self.events = Events(api)
        self.restores = Restores(api, self.namespace, self.name)
        self.volumes = Volumes(api, self.namespace, self.name)
        self.retention = Retention(api, self.events, self.namespace, self.name)
        self.agents: Agents | None = None
        self.engine: EngineStatus | None = None
        self.status_doc: JSON | None = None
        self.last_phase: str | None = None
        self.last_message: str | None = None
        self.spec_error: str | None = None
        self.expanded_to: str | None = None
        self._any_since: float | None = None  # when a `switchover-to: any` request was first seen
        self._any_target: str | None = None  # and the member chosen for it
        self.polled = False  # the last tick asked at least one agent
        self.had_pods = True  # the last tick saw a pod of the cluster (until a tick says otherwise)
        self._poll_seconds = 0.0  # how long the last tick took to gather its agents' statuses
        self.ticked_at: datetime | None = None  # when the last tick started
        self.objects_refused = False  # the last tick's owned objects were refused: Failed stands
        # The inputs of the status document last compared with (or written as) `status_doc`, and that
        # status: while both stand, the document is the same (`tick`).
        self._settled_status: tuple[JSON, tuple[object, ...]] | None = None
        self._parsed: tuple[tuple[object, object, object], tuple[PostgresClusterSpec, str, str]] | None = None
        self.crash_point = CrashPoint.from_env()  # tests only (crashpoint.py)

    async def close(self) -> None:
        if self.agents is not None:
            await self.agents.close()

    @property
    def starting(self) -> bool:
        """Whether the next tick starts from nothing: the cluster read afresh and, for a new cluster, its
        Secrets (a CA and certificates issued) and objects made, a dozen requests. At startup, or when
        the leadership is won, every loop has such a tick at once."""
        return self.engine is None and self.holding()

    def interval(self) -> float:
        """Fast while something is in flight and agents answer what it waits for (their /status changes
        raise no watch event); otherwise steady: what it waits for then (pods, Jobs, the spec) wakes it.
        Idle without a pod and an operation: the user's certificate Secrets, read again by time, and the
        engine's own clocks (a schedule, a timeout) are the only things a tick may find new then."""
        busy = self.last_phase not in (None, "Running", "Paused") and self.polled
        interval = self.config.busy_interval if busy else self.config.steady_interval
        if not self.had_pods and (self.engine is None or self.engine.operation is None):
            idle = min(self.config.idle_interval, self.config.certificate_secrets_interval)
            interval = max(interval, idle)
        due = self._detection_due()
        return interval if due is None else min(interval, due)

    def _detection_due(self) -> float | None:
        """Seconds until a lost primary has been lost for detectionSeconds, while that is ahead: the
        tick then comes when the failure is confirmed, not up to an interval after (failover.lost_since)."""
        engine, parsed = self.engine, self._parsed
        if (
            engine is None
            or parsed is None
            or engine.operation is not None
            or engine.primary_lost_since is None
        ):
            return None
        detection = parsed[1][0].failover.detection_seconds
        end = engine.primary_lost_since + timedelta(seconds=detection)
        due = (end - datetime.now(UTC)).total_seconds()
        if due <= 0 and self.ticked_at is not None and self.ticked_at >= end:
            return None  # a tick since detection's end has seen it: the pace goes on
        # The engine decides on the statuses the tick gathers, as of when they are in: the tick starts
        # as long before as the last gathering took (0.1-0.2 s of a back-off failover on localkube). One
        # that comes back early decides nothing, and the next tick follows at once (the slack).
        return max(due - self._poll_seconds, 0.0) + DETECTION_SLACK

    async def tick(self) -> None:
        self.ticked_at = datetime.now(UTC)
        if not self.holding():
            self.engine = None  # another operator may write meanwhile: read it again when leading
            return
        body = self.body()
        meta = body["metadata"]
        if meta.get("deletionTimestamp"):
            return
        if self.engine is None:
            fresh = await self.api.get("PostgresCluster", self.namespace, self.name)
            body = fresh
            self.status_doc = dict(fresh.get("status") or {})
            self.engine = EngineStatus.from_dict((self.status_doc or {}).get("engine") or {})
            self.restores.load(fresh)
            self.volumes.load(fresh)
        try:
            spec, image, revision = self._spec(body)
        except ValidationError as exc:
            await self._refuse_spec(body, exc)
            return
        try:
            secrets = await self.owned.agent_secrets(body, spec, image, revision)
        except ApiError as exc:
            await self._report_failure(
                body, "ObjectsFailed", f"cannot create or read the cluster's Secrets: {exc}"
            )
            return
        certificates = await self._certificates(body, spec, image, revision)
        if self.agents is None:
            self.agents = Agents(
                self.name,
                token=secrets.token,
                ca_pem=secrets.ca_pem,
                server_hostname=secrets.server_hostname,
                scheme=self.config.agent_scheme,
            )
        objects = self.gather(body)
        # Every member, busy ones too: an agent answers /status during its actions (its `action` says
        # which), and a member left out would look unreachable (a re-pointed replica: quorum lost).
        addresses = {p["metadata"]["name"]: ip for p in objects.pods if (ip := pod_ip(p)) is not None}
        observed_at = time.monotonic()
        assert self.engine is not None
        order = isolation_order(
            spec.failover.detection_seconds, len(self.engine.voters), steady=self.engine.operation is None
        )
        statuses = self.agents.with_fences(
            await self.agents.statuses(addresses, isolation=order), objects.volume_uids()
        )
        self._poll_seconds = min(time.monotonic() - observed_at, MAX_POLL_LEAD) if addresses else 0.0
        self.polled = bool(addresses)
        self.had_pods = bool(objects.pods)
        switchover_to = self._switchover_target(body, objects, statuses)
        view = cluster_view(
            objects,
            statuses,
            datetime.now(UTC),
            switchover_to=switchover_to,
            image=image,
            extra_jobs=self.restores.job_views(statuses, observed_at),
            lost_volumes=self.volumes.lost(objects),
            busy={name for name, ip in addresses.items() if self.agents.busy(name, ip)},
        )
        assert self.engine is not None
        decision = decide(spec, view, self.engine)
        problems = pod_problems(objects)
        extra = (pods_healthy(problems), certificates_valid(certificates, datetime.now(UTC)))
        records = certificates.records()
        # What the status document is made of: equal to the last tick's, and with the status it was
        # compared with (or written as) still the one stored, the document is that one again, neither
        # built nor compared (a settled loop's tick, at every tick of thousands of clusters).
        inputs = (
            decision.phase,
            decision.message,
            decision.conditions,
            decision.status,
            view.cluster,
            view.generation,
            view.members,
            view.backups,
            image,
            statuses,
            extra,
            records,
        )
        settled = self._settled_status
        same = settled is not None and settled[0] is self.status_doc and settled[1] == inputs
        document: JSON | None = None
        if not same:
            document = cluster_status(
                decision,
                view,
                self.status_doc or {},
                image=image,
                statuses=statuses,
                extra=extra,
                certificates=records,
            )
        reconciled = False
        if self.objects_refused:
            # The Failed status stands until the owned objects pass: writing the engine's status first
            # at every tick, then Failed again, would flap the phase for every reader.
            if not self.holding() or not await self._reconcile_objects(body, spec, image, revision, objects):
                return
            self.objects_refused, reconciled = False, True
        if document is not None and (self.status_doc is None or not unchanged(document, self.status_doc)):
            if not self.holding():
                return
            await self.api.patch(
                "PostgresCluster",
                self.namespace,
                self.name,
                {"status": merge_patch(document, self.status_doc)},
                subresource="status",
                answer=False,  # the cluster as written: parsing it cost more than the write
            )
            self.status_doc = {**(self.status_doc or {}), **document}
        assert self.status_doc is not None
        # Equal inputs: the standing ones are kept, not this tick's copies (objects kept from one tick to
        # the next reach CPython's oldest generation, whose collections then come sooner and last long).
        if not same:
            self._settled_status = (self.status_doc, inputs)
        self.engine = decision.status
        self._log_phase(decision)
        # The status as written or found unchanged: the figures' keys (phase, conditions' status,
        # instances) are the document's.
        self._record_metrics(self.status_doc, view, spec, decision, objects, certificates)
        try:
            if not reconciled and not await self._reconcile_objects(body, spec, image, revision, objects):
                return
            await self._clear_switchover(body, decision, switchover_to, {m.name for m in view.existing()})
            context = ActContext(
                api=self.api,
                objects=objects,
                spec=spec,
                statuses=statuses,
                agents=self.agents,
                current_primary=decision.status.current_primary,
                member_address=lambda member: self._member_address(objects, member),
                may_act=self.holding,
                snapshot_job=lambda backup, member, host: self.owned.snapshot_job(
                    body, spec, image, revision, backup, member, host
                ),
                prune_job=lambda action: self.owned.prune_job(body, spec, image, revision, action),
                event=lambda action: self.events.post(body, action),
                event_on=self.events.record,
                restores=self.restores,
            )
            try:
                await apply_all(context, decision.actions)
                await label_replicas(context)
            except NotLeader:
                log.info("%s/%s: leadership lost: stopped acting", self.namespace, self.name)
                self.engine = None
                return
            operation = decision.status.operation
            if self.crash_point is not None and operation is not None and self.crash_point.reached(operation):
                self.crash_point.freeze(operation)
            if self.holding():
                await self.volumes.remember(objects, statuses)
                await self.restores.follow(objects, statuses)
                await self.retention.expire(objects)
        finally:
            # Told once acted: an Event is a write to the API server each, and a failover's promotion
            # waited for them (up to 0.17 s on localkube, 2026-12-07). The engine's are told once (its
            # memory moved on); a problem's is not posted again for 5 minutes.
            for event in decision.events:
                await self.events.post(body, event)
            for problem in problems:
                await self.events.record(body, RecordEvent(problem.reason, problem.describe(), warning=True))

    async def _reconcile_objects(
        self, body: JSON, spec: PostgresClusterSpec, image: str, revision: str, objects: ClusterObjects
    ) -> bool:
        """The owned objects as the spec describes them (after the status write: they are actions too),
        volumes grown to spec.storage.size, and the StatefulSet fields that cannot change reported.
        False when the API server refused: nothing else is done this tick."""
        try:
            await self.owned.ensure(body, spec, image, revision)
        except ApiError as exc:
            self.objects_refused = True
            await self._report_failure(
                body, "ObjectsFailed", f"cannot create or update the cluster's objects: {exc}"
            )
            return False
        if spec.storage.size != self.expanded_to:
            self.expanded_to = spec.storage.size
            for message in await expand_volumes(self.api, objects.pvcs, spec):
                await self.events.record(body, RecordEvent("VolumeExpansionRefused", message, warning=True))
        for field_name in self.owned.blocked:
            if field_name != "spec.volumeClaimTemplates":
                await self.events.record(
                    body,
                    RecordEvent(
                        "ImmutableField",
                        f"the StatefulSet's {field_name} cannot change in place: the change waits",
                        warning=True,
                    ),
                )
        return True

    def _record_metrics(
        self,
        document: JSON,
        view: ClusterView,
        spec: PostgresClusterSpec,
        decision: Decision,
        objects: ClusterObjects,
        certificates: CertificateCheck,
    ) -> None:
        completed = [b.completed_at for b in view.backups if b.phase == "Completed" and b.completed_at]
        operation = decision.status.operation
        metrics.record(
            self.namespace,
            self.name,
            document,
            last_backup_at=max(completed) if completed else None,
            schedule=spec.backup is not None and spec.backup.schedule is not None,
            operation=None if operation is None else (operation.kind.value, operation.started_at),
            failed_backups=[
                str(b["metadata"].get("uid") or b["metadata"]["name"])
                for b in objects.backups
                if (b.get("status") or {}).get("phase") == "Failed"
            ],
            certificates=certificates.expiry,
        )

    async def _certificates(
        self, body: JSON, spec: PostgresClusterSpec, image: str, revision: str
    ) -> CertificateCheck:
        """The members' certificates, renewed when due and following the user's Secrets (before the
        status that reports them), with an Event for each renewal, each change of the user's
        certificates the members get, and each Secret of the user's that cannot be installed."""
        check = await self.owned.certificates(
            self.owned.ref(body, spec, image, revision),
            rotate_request(body["metadata"]),
            datetime.now(UTC),
            self.holding,
        )
        if check.renewed is not None:
            which = " and ".join(f"{name} (until {format_time(at)})" for name, at in check.expiry.items())
            await self.events.record(
                body,
                RecordEvent(
                    "CertificatesRenewed",
                    f"issued the {which} certificates of Secret {check.secret} again"
                    f" ({check.renewed.reason}): {check.renewed.message}",
                ),
            )
        if check.updated is not None:
            await self.events.record(body, RecordEvent("CertificatesUpdated", check.updated))
        for problem in check.problems:  # posted again only after a while (Events.record)
            await self.events.record(body, RecordEvent(problem.reason, problem.message, warning=True))
        return check

    def _spec(self, body: JSON) -> tuple[PostgresClusterSpec, str, str]:
        """The validated spec, its image and revision; parsed again only when the spec changed (its
        ``metadata.generation``, which the API server moves on every change of the spec) or a restart
        was asked for (the annotation pgherd.io/restart, part of the revision as the engine computes it)."""
        meta = body["metadata"]
        restart = restart_request(meta)
        key = (meta.get("uid"), meta.get("generation"), restart)
        if self._parsed is not None and key[1] is not None and self._parsed[0] == key:
            return self._parsed[1]
        spec = PostgresClusterSpec.model_validate(body.get("spec") or {})
        image = self.owned.image(spec)
        parsed = (spec, image, spec_revision(spec, image, restart))
        self._parsed = (key, parsed)
        return parsed

    def _member_address(self, objects: ClusterObjects, member: str) -> str | None:
        if self.config.member_address == "ip":
            ip = pod_ip(objects.pod(member))
            return None if ip is None else f"{ip}:{names.POSTGRES_PORT}"
        return f"{names.member_host(self.name, member, self.namespace)}:{names.POSTGRES_PORT}"

    def _switchover_target(self, body: JSON, objects: ClusterObjects, statuses: dict[str, Any]) -> str | None:
        request = (body["metadata"].get("annotations") or {}).get(names.ANNOTATION_SWITCHOVER)
        if not request:
            return None
        if request != "any":
            self._any_since = self._any_target = None
            return str(request)
        if self._any_since is None:
            self._any_since = time.monotonic()
        if self._any_target is None:
            # Chosen once per request: chosen again after the switchover, it would name another replica
            # and switch over again. An operator restarted mid-switchover keeps the recorded target.
            operation = self.engine.operation if self.engine is not None else None
            if operation is not None and operation.kind is OperationKind.SWITCHOVER:
                self._any_target = operation.target
            else:
                self._any_target = switchover.any_target(
                    {
                        name: parse_lsn(status.received_lsn) if status.received_lsn else 0
                        for name, status in statuses.items()
                        if status is not None and status.role == Role.REPLICA.value and status.streaming
                    }
                )
        return self._any_target

    async def _clear_switchover(
        self, body: JSON, decision: Decision, target: str | None, members: set[str]
    ) -> None:
        request = (body["metadata"].get("annotations") or {}).get(names.ANNOTATION_SWITCHOVER)
        if not request:
            self._any_since = self._any_target = None
        if not request or not self.holding():
            return
        aborted = decision.status.aborted
        done = (
            target is not None
            and decision.status.current_primary == target
            and decision.status.operation is None
        )
        refused = (
            aborted is not None and aborted.kind is OperationKind.SWITCHOVER and aborted.target == target
        )
        unknown = target is not None and target not in members
        waited = time.monotonic() - self._any_since if self._any_since is not None else 0.0
        if not (done or refused or unknown or (target is None and switchover.refuse_any(waited))):
            return
        if done:
            message, warning = f"switched over to {target}", False
        elif refused:
            message, warning = f"switchover to {target} refused: {aborted.failed if aborted else ''}", True
        elif unknown:
            message, warning = f"switchover to {target} refused: no member of that name", True
        else:
            message = (
                "switchover to any member refused: no replica streamed in "
                f"{switchover.ANY_TARGET_WAIT:.0f}s to promote"
            )
            warning = True
        await self.api.patch(
            "PostgresCluster",
            self.namespace,
            self.name,
            {"metadata": {"annotations": {names.ANNOTATION_SWITCHOVER: None}}},
        )
        await self.events.record(body, RecordEvent("Switchover", message, warning=warning))

    async def _refuse_spec(self, body: JSON, exc: ValidationError) -> None:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
        where = "spec." + ".".join(str(part) for part in first.get("loc", ()))
        message = f"invalid {where}: {first.get('msg')}"
        await self._report_failure(body, "InvalidSpec", message)

    async def _report_failure(self, body: JSON, reason: str, message: str) -> None:
        """A condition and an Event, once per distinct message; no action is taken meanwhile."""
        if message == self.spec_error:
            return
        self.spec_error = message
        log.warning("%s/%s: %s", self.namespace, self.name, message)
        document = {
            "phase": "Failed",
            "message": message,
            "observedGeneration": body["metadata"].get("generation"),
            "conditions": [
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": now_rfc3339(),
                    "observedGeneration": body["metadata"].get("generation"),
                }
            ],
        }
        try:
            await self.api.patch(
                "PostgresCluster",
                self.namespace,
                self.name,
                {"status": merge_patch(document, self.status_doc)},
                subresource="status",
            )
            if self.status_doc is not None:  # once it passes, the engine's status is written again
                self.status_doc = {**self.status_doc, **document}
        except ApiError as exc:
            log.warning("%s/%s: cannot write status: %s", self.namespace, self.name, exc)
        await self.events.record(body, RecordEvent(reason, message, warning=True))

    def _log_phase(self, decision: Decision) -> None:
        self.spec_error = None
        if decision.phase.value != self.last_phase or decision.message != self.last_message:
            log.info("%s/%s: phase %s: %s", self.namespace, self.name, decision.phase.value, decision.message)
            self.last_phase, self.last_message = decision.phase.value, decision.message


def pods_healthy(problems: list[PodProblem]) -> Condition:
    """PodsHealthy: False with the first problem's reason and every problem listed, else True."""
    if not problems:
        return true(ConditionType.PODS_HEALTHY, "NoPodStuck", "no pod waits for a person")
    return false(
        ConditionType.PODS_HEALTHY, problems[0].reason, "; ".join(p.describe() for p in problems)[:1024]
    )


def certificates_valid(check: CertificateCheck, now: datetime) -> Condition:
    """CertificatesValid: False when a renewal failed (RenewalFailed, with the API server's words), a
    Secret of the user's cannot be installed (its check's reason, every problem said), or a certificate
    is missing or expired; else True, with the first expiry and the first renewal."""
    kind = ConditionType.CERTIFICATES_VALID
    if check.error is not None:
        return false(kind, "RenewalFailed", check.error[:1024])
    if check.problems:
        return false(kind, check.problems[0].reason, "; ".join(p.message for p in check.problems)[:1024])
    missing = [name for name in check.names if name not in check.expiry]
    if missing:
        return false(kind, "NotIssued", f"not issued yet: {', '.join(missing)}")
    expired = [name for name, at in check.expiry.items() if at <= now]
    if expired:
        return false(kind, "Expired", f"expired: {', '.join(expired)}")
    return true(kind, "Valid", check.validity())
