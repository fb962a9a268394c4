"""The cluster's Services. Clients connect through `-rw` (the primary), `-ro` (the replicas) or `-r`
(any member); the headless Service gives each member its stable DNS name and is the StatefulSet's
serviceName. `-rw` has no selector: the operator writes its one EndpointSlice (`rw_endpoint_slice`),
the primary's address set in one write at a promotion, so that kube-proxy changes the route once instead
of emptying it at the fence and filling it again at the label (its minimum sync period between the two
cost a switchover 0.4 s). `-ro` and `-r` follow the pod label `pgherd.io/role`, which only the operator
sets: a member never routes to itself."""

from __future__ import annotations

from pgherd.kube import names
from pgherd.kube.builders.common import ClusterRef, Manifest, cluster_owner, metadata

POSTGRES_PORT_NAME = "postgres"
AGENT_PORT_NAME = "agent"


def _port(name: str, number: int) -> Manifest:
    return {"name": name, "port": number, "targetPort": name, "protocol": "TCP"}


def _service(ref: ClusterRef, name: str, selector: dict[str, str] | None, spec: Manifest) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ref, name, names.COMPONENT_POSTGRES),
        "spec": {"type": "ClusterIP", "selector": selector, **spec},
    }


def _members(ref: ClusterRef, role: str | None = None) -> dict[str, str]:
    """Member pods (never a Job's pod: it carries the cluster label too, not the postgres component)."""
    selector = names.selector_labels(ref.name)
    return {**selector, names.LABEL_ROLE: role} if role else selector


def service_rw(ref: ClusterRef) -> Manifest:
    """The primary, through the slice the operator writes. The selector is null rather than absent: a
    merge patch of a Service made by an earlier version (which selected the primary's label) removes
    it, and Kubernetes' EndpointSlice controller then deletes its own slices of it."""
    return _service(
        ref,
        names.service_rw(ref.name),
        None,
        {"ports": [_port(POSTGRES_PORT_NAME, names.POSTGRES_PORT)]},
    )


def rw_endpoint(pod: Manifest, ip: str) -> Manifest:
    """The primary's pod as the -rw slice's one endpoint. Ready because its agent reports a writable
    primary (the engine's SetPrimary), not the kubelet's readiness probe, which would add its period."""
    meta = pod["metadata"]
    endpoint: Manifest = {
        "addresses": [ip],
        "conditions": {"ready": True, "serving": True, "terminating": False},
        "targetRef": {
            "kind": "Pod",
            "namespace": meta["namespace"],
            "name": meta["name"],
            "uid": meta["uid"],
        },
    }
    node = (pod.get("spec") or {}).get("nodeName")
    if node:
        endpoint["nodeName"] = node
    return endpoint


def rw_endpoint_slice(cluster: Manifest, endpoints: list[Manifest]) -> Manifest:
    """The -rw Service's slice: the primary's endpoint, or none (then kube-proxy rejects connections at
    once). Owned by the cluster, like the Service. The address family is the endpoints' (IPv4 unless the
    pod's address is IPv6)."""
    meta = cluster["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    family = "IPv6" if any(":" in a for e in endpoints for a in e["addresses"]) else "IPv4"
    labels = {
        **names.common_labels(name, names.COMPONENT_POSTGRES),
        names.LABEL_SERVICE_NAME: names.service_rw(name),
        names.LABEL_SLICE_MANAGED_BY: names.SLICE_MANAGER,
    }
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": names.rw_slice(name),
            "namespace": namespace,
            "labels": labels,
            "ownerReferences": [cluster_owner(name, meta["uid"])],
        },
        "addressType": family,
        "ports": [{"name": POSTGRES_PORT_NAME, "port": names.POSTGRES_PORT, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def service_ro(ref: ClusterRef) -> Manifest:
    """The replicas (read-only), ready ones only: a lagging replica fails /readyz."""
    return _service(
        ref,
        names.service_ro(ref.name),
        _members(ref, names.ROLE_REPLICA),
        {"ports": [_port(POSTGRES_PORT_NAME, names.POSTGRES_PORT)]},
    )


def service_r(ref: ClusterRef) -> Manifest:
    """Every ready member, primary included (reads that tolerate a replica)."""
    return _service(
        ref,
        names.service_r(ref.name),
        _members(ref),
        {"ports": [_port(POSTGRES_PORT_NAME, names.POSTGRES_PORT)]},
    )


def service_headless(ref: ClusterRef) -> Manifest:
    """Every member, ready or not (`publishNotReadyAddresses`): a replica being seeded or a fenced member
    keeps its DNS name, which replication between members relies on. No cluster IP."""
    return _service(
        ref,
        names.service_headless(ref.name),
        _members(ref),
        {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "ports": [
                _port(POSTGRES_PORT_NAME, names.POSTGRES_PORT),
                _port(AGENT_PORT_NAME, names.AGENT_PORT),
            ],
        },
    )


def services(ref: ClusterRef) -> list[Manifest]:
    """All four, in the order the adapter creates them (the headless one first: the StatefulSet's)."""
    return [service_headless(ref), service_rw(ref), service_ro(ref), service_r(ref)]
