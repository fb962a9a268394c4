"""The status document: everything `status` says about one cluster, gathered before a word is
written. Kubernetes (``gather``) and the sandbox (``Sandbox.status_document``) fill the same shape, and
one renderer (``summary``, ``render``) reads it: a cluster reads alike wherever it runs.

No Secret value ever enters it: certificates come as their public facts (subject, expiry), Backups and
Restores as their objects (which name Secrets, never hold them).
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from pgherd_backup.timestamps import now_rfc3339

JSON = dict[str, Any]


class Placement(TypedDict, total=False):
    """Where a member runs: its pod (Kubernetes) or its port (the sandbox)."""

    node: str | None  # the node's name, or the sandbox's address
    restarts: int | None  # the PostgreSQL container's restarts (its agent's, on Kubernetes)
    pod_phase: str | None
    started_at: str | None
    revision: str | None  # the spec revision its pod carries (label pgherd.io/revision)
    waiting: str | None  # why its container does not run (the kubelet's reason), when it does not


class EventRecord(TypedDict):
    type: str  # Normal | Warning
    reason: str
    message: str
    time: str | None  # RFC 3339, the last time it happened
    count: int
    regarding: str  # kind/name


class CertificateRecord(TypedDict):
    name: str  # what it is: "hippo-agent tls.crt (the members' server certificate)"
    subject: str
    not_after: str | None  # RFC 3339; None when unreadable
    source: str  # "status" or "Secret hippo-agent"


class OperatorRecord(TypedDict):
    name: str  # namespace/name of the Deployment, or "sandbox supervisor"
    image: str | None
    version: str | None
    ready: int
    wanted: int


class StatusDocument(TypedDict):
    platform: Literal["kubernetes", "sandbox"]
    namespace: str | None
    now: str  # RFC 3339: when it was read (relative times count from here)
    cluster: JSON  # the PostgresCluster: metadata, spec, status
    placements: dict[str, Placement]  # member -> where it runs
    backups: list[JSON]  # the cluster's Backup objects
    restores: list[JSON]  # the cluster's Restore objects
    events: list[EventRecord]  # recent Events about the cluster, oldest first
    certificates: list[CertificateRecord] | None  # None: unknown (notes say why)
    operator: OperatorRecord | None  # None: none found (or unknown: notes say why)
    notes: list[str]  # what could not be read, and why


def of_cluster(objects: list[JSON], cluster: str) -> list[JSON]:
    """Backups or Restores whose spec.cluster.name is ``cluster``."""
    return [o for o in objects if ((o.get("spec") or {}).get("cluster") or {}).get("name") == cluster]


def now_text() -> str:
    """Now, as the API server writes a time (RFC 3339, UTC, to the second)."""
    return now_rfc3339()
