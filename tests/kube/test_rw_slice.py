"""The -rw Service follows the primary through the one EndpointSlice the operator writes: a promotion
replaces the old address by the new in one write (kube-proxy applies a first change at once and a
second only after its minimum sync period: a slice emptied at the fence and filled at the promotion cost
a switchover 0.4 s on localkube); a fence the agent takes leaves the address (connections to a stopped
PostgreSQL are refused at once); a fence by deletion empties it. Played on a real API server as the
chart's identity, every request read from its audit log."""

from __future__ import annotations

from typing import Any

from pgherd.engine import actions as act
from pgherd.kube import names

from .realkube import JSON, AuditLog, ChartIdentity, Kube
from .test_fence_by_deletion import apply_as_operator
from .test_operator import cluster_manifest


def _member_pod(kube: Kube, ns: str, name: str, ip: str, role: str | None = None) -> JSON:
    if kube.read("serviceaccounts", ns, "default") is None:  # no controller manager here makes it
        kube.create(
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}}
        )
    labels = {names.LABEL_CLUSTER: "hippo", names.LABEL_COMPONENT: names.COMPONENT_POSTGRES}
    if role:
        labels[names.LABEL_ROLE] = role
    pod = kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {
                "nodeName": "node-a",  # bound: its kubelet (none here) must confirm a deletion
                "containers": [{"name": names.CONTAINER_POSTGRES, "image": "pgherd:test"}],
            },
        }
    )
    pod["status"] = {
        "phase": "Running",
        "podIP": ip,
        "containerStatuses": [{"name": names.CONTAINER_POSTGRES, "state": {"running": {}}, "started": True}],
    }
    return pod


def _routes(kube: Kube, ns: str) -> list[tuple[str, list[str], Any]]:
    found = kube.read("endpointslices", ns, names.rw_slice("hippo"))
    assert found is not None, "no -rw slice"
    return [
        (e["targetRef"]["name"], e["addresses"], e["conditions"].get("ready"))
        for e in found.get("endpoints") or []
    ]


def _role(kube: Kube, ns: str, pod: str) -> str | None:
    found = kube.read("pods", ns, pod)
    assert found is not None
    return (found["metadata"].get("labels") or {}).get(names.LABEL_ROLE)


def _writes(audit: AuditLog, identity: ChartIdentity, since: int) -> list[str]:
    audit.fence()
    return [
        f"{e.verb} {e.resource}/{e.name} -> {e.code}"
        for e in audit.of(identity.user, since)
        if e.verb in ("create", "patch", "update", "delete") and e.resource in ("endpointslices", "pods")
    ]


def test_a_promotion_moves_the_rw_route_in_one_write_before_the_labels(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, audit: AuditLog
) -> None:
    ns = namespace
    cluster = kube.create(cluster_manifest(ns))
    first = _member_pod(kube, ns, "hippo-0", "10.9.0.10")
    second = _member_pod(kube, ns, "hippo-1", "10.9.0.11", role=names.ROLE_REPLICA)
    pods = [first, second]

    apply_as_operator(kube, ns, chart_operator, pods, (act.SetPrimary("hippo-0", reason="first primary"),))
    made = kube.read("endpointslices", ns, names.rw_slice("hippo"))
    assert made is not None
    labels = made["metadata"]["labels"]
    # What kube-proxy needs to route -rw by it, and what keeps Kubernetes' controllers off it.
    assert labels[names.LABEL_SERVICE_NAME] == names.service_rw("hippo")
    assert labels[names.LABEL_SLICE_MANAGED_BY] == names.SLICE_MANAGER
    assert labels[names.LABEL_CLUSTER] == "hippo"
    assert made["addressType"] == "IPv4"
    assert made["ports"] == [{"name": "postgres", "port": names.POSTGRES_PORT, "protocol": "TCP"}]
    assert [o["uid"] for o in made["metadata"]["ownerReferences"]] == [cluster["metadata"]["uid"]]
    assert _routes(kube, ns) == [("hippo-0", ["10.9.0.10"], True)]
    assert _role(kube, ns, "hippo-0") == names.ROLE_PRIMARY

    mark = audit.fence()
    apply_as_operator(kube, ns, chart_operator, pods, (act.SetPrimary("hippo-0", reason="again"),))
    assert _writes(audit, chart_operator, mark) == [], "a SetPrimary already in effect wrote again"

    first["metadata"].setdefault("labels", {})[names.LABEL_ROLE] = names.ROLE_PRIMARY
    mark = audit.fence()
    apply_as_operator(kube, ns, chart_operator, pods, (act.SetPrimary("hippo-1", reason="switchover"),))
    # One write of the slice, the old address replaced (never an empty slice between), then the labels.
    assert _writes(audit, chart_operator, mark) == [
        "patch endpointslices/hippo-rw -> 200",
        "patch pods/hippo-0 -> 200",
        "patch pods/hippo-1 -> 200",
    ]
    assert _routes(kube, ns) == [("hippo-1", ["10.9.0.11"], True)]
    assert (_role(kube, ns, "hippo-0"), _role(kube, ns, "hippo-1")) == (
        names.ROLE_REPLICA,
        names.ROLE_PRIMARY,
    )


def test_a_fence_by_deletion_empties_the_rw_slice_before_the_deletion(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, audit: AuditLog
) -> None:
    ns = namespace
    kube.create(cluster_manifest(ns))
    primary = _member_pod(kube, ns, "hippo-0", "10.9.0.20")
    apply_as_operator(
        kube, ns, chart_operator, [primary], (act.SetPrimary("hippo-0", reason="first primary"),)
    )
    primary["metadata"].setdefault("labels", {})[names.LABEL_ROLE] = names.ROLE_PRIMARY

    mark = audit.fence()
    # Its agent does not answer (nothing listens): its address may not answer either.
    apply_as_operator(kube, ns, chart_operator, [primary], (act.Fence("hippo-0", reason="primary failed"),))
    assert _writes(audit, chart_operator, mark) == [
        "patch endpointslices/hippo-rw -> 200",
        "patch pods/hippo-0 -> 200",
        "delete pods/hippo-0 -> 200",
    ]
    assert _routes(kube, ns) == []


def test_a_demoted_member_leaves_the_rw_slice_before_its_read_only_start(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, audit: AuditLog
) -> None:
    """A fenced primary started read-only (its WAL counted while no primary is chosen) is no place for
    -rw clients: they would meet a read-only server rather than a refusal."""
    ns = namespace
    kube.create(cluster_manifest(ns))
    primary = _member_pod(kube, ns, "hippo-0", "10.9.0.30")
    apply_as_operator(
        kube, ns, chart_operator, [primary], (act.SetPrimary("hippo-0", reason="first primary"),)
    )
    mark = audit.fence()
    apply_as_operator(kube, ns, chart_operator, [primary], (act.Demote("hippo-0", reason="count its WAL"),))
    assert _writes(audit, chart_operator, mark) == ["patch endpointslices/hippo-rw -> 200"]
    assert _routes(kube, ns) == []
