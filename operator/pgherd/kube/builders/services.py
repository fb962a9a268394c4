"""The cluster's Services. Clients connect through `-rw` (the primary), `-ro` (the replicas) or `-r`
(any member); the headless Service gives each member its stable DNS name and is the StatefulSet's
serviceName. `-rw` follows the primary through the pod label `pgherd.io/role`, which only the operator
sets: a member never routes writes to itself."""

from __future__ import annotations

from pgherd.kube import names
from pgherd.kube.builders.common import ClusterRef, Manifest, metadata

POSTGRES_PORT_NAME = "postgres"
AGENT_PORT_NAME = "agent"


def _port(name: str, number: int) -> Manifest:
    return {"name": name, "port": number, "targetPort": name, "protocol": "TCP"}


def _service(ref: ClusterRef, name: str, selector: dict[str, str], spec: Manifest) -> Manifest:
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
    """The primary: the one pod the operator labels `pgherd.io/role=primary`."""
    return _service(
        ref,
        names.service_rw(ref.name),
        _members(ref, names.ROLE_PRIMARY),
        {"ports": [_port(POSTGRES_PORT_NAME, names.POSTGRES_PORT)]},
    )


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
