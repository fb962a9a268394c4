"""A cluster's status document read from the API server: the PostgresCluster, its pods, Backups,
Restores, Events, certificates and the operator. Only the cluster itself must be readable: anything
else the person may not read (or that is missing) becomes a note, and the rest is still shown."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pgherd.kube import names
from pgherd.plugin import certificates
from pgherd.plugin.document import (
    CertificateRecord,
    EventRecord,
    Placement,
    StatusDocument,
    now_text,
    of_cluster,
)
from pgherd.plugin.errors import PluginError
from pgherd.plugin.kube import Kube
from pgherd.plugin.version import operator_record

JSON = dict[str, Any]
T = TypeVar("T")
AGENT_CERTIFICATES = {
    names.KEY_TLS_CERT: "the members' server certificate",
    names.KEY_CA_CERT: "the cluster's CA",
}


def member_selector(cluster: str) -> str:
    return ",".join(f"{k}={v}" for k, v in names.selector_labels(cluster).items())


def gather(kube: Kube, name: str) -> StatusDocument:
    cluster = kube.cluster(name)  # the one request that must pass
    notes: list[str] = []

    def optional(what: str, read: Callable[[], T], default: T) -> T:
        try:
            return read()
        except PluginError as exc:
            notes.append(f"{what}: {exc}")
            return default

    none: list[JSON] = []
    pods = optional("members' pods", lambda: kube.pods(member_selector(name)), none)
    backups = optional("Backups", lambda: of_cluster(kube.list_custom(names.PLURAL_BACKUPS), name), none)
    restores = optional("Restores", lambda: of_cluster(kube.list_custom(names.PLURAL_RESTORES), name), none)
    no_events: list[EventRecord] = []
    events = optional("Events", lambda: cluster_events(kube, name), no_events)
    certs = optional("certificates", lambda: cluster_certificates(kube, cluster), None)
    operator = optional("the operator", lambda: operator_record(kube), None)
    return StatusDocument(
        platform="kubernetes",
        namespace=kube.namespace,
        now=now_text(),
        cluster=cluster,
        placements={p["metadata"]["name"]: placement(p) for p in pods},
        backups=backups,
        restores=restores,
        events=events,
        certificates=certs,
        operator=operator,
        notes=notes,
    )


def _container(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return next((c for c in statuses if c.get("name") == names.CONTAINER_POSTGRES), {})


def placement(pod: Mapping[str, Any]) -> Placement:
    status = pod.get("status") or {}
    container = _container(pod)
    waiting = ((container.get("state") or {}).get("waiting") or {}).get("reason")
    if waiting is None:
        unscheduled = next(
            (
                c
                for c in status.get("conditions") or []
                if c.get("type") == "PodScheduled" and c.get("status") == "False"
            ),
            None,
        )
        waiting = (unscheduled or {}).get("reason")
    if pod["metadata"].get("deletionTimestamp"):
        waiting = "Terminating"
    return Placement(
        node=(pod.get("spec") or {}).get("nodeName"),
        restarts=container.get("restartCount"),
        pod_phase=status.get("phase"),
        started_at=status.get("startTime"),
        revision=(pod["metadata"].get("labels") or {}).get(names.LABEL_REVISION),
        waiting=waiting,
    )


def event_record(event: Mapping[str, Any]) -> EventRecord:
    """A core/v1 Event (events.k8s.io ones read through core/v1 too) as the status shows it."""
    meta, series = event.get("metadata") or {}, event.get("series") or {}
    regarding = event.get("involvedObject") or event.get("regarding") or {}
    time = (
        series.get("lastObservedTime")
        or event.get("lastTimestamp")
        or event.get("eventTime")
        or event.get("firstTimestamp")
        or meta.get("creationTimestamp")
    )
    return EventRecord(
        type=str(event.get("type") or "Normal"),
        reason=str(event.get("reason") or ""),
        message=str(event.get("message") or event.get("note") or "").strip(),
        time=None if time is None else str(time),
        count=int(series.get("count") or event.get("count") or 1),
        regarding=f"{regarding.get('kind')}/{regarding.get('name')}",
    )


def _event_time(record: EventRecord) -> str:
    # RFC 3339 texts of one server sort in time order once their fractions are dropped.
    return (record["time"] or "")[:19]


def cluster_events(kube: Kube, name: str) -> list[EventRecord]:
    items = kube.events(f"involvedObject.name={name}")
    records = [
        event_record(e) for e in items if (e.get("involvedObject") or {}).get("kind") == "PostgresCluster"
    ]
    return sorted(records, key=_event_time)


def cluster_certificates(kube: Kube, cluster: Mapping[str, Any]) -> list[CertificateRecord]:
    """status.certificates when the operator reports them, else the members' certificate and the CA from
    the agent Secret: only those two keys are read from its data, never its private key."""
    reported = (cluster.get("status") or {}).get("certificates")
    if reported:
        return certificates.from_status(reported)
    secret = names.secret_agent(str(cluster["metadata"]["name"]))
    parts = kube.certificate_parts(secret, tuple(AGENT_CERTIFICATES))
    out: list[CertificateRecord] = []
    for key, what in AGENT_CERTIFICATES.items():
        if key in parts:
            out += certificates.records(parts[key], f"{secret} {key} ({what})", f"Secret {secret}")
    return out
