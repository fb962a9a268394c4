"""The NetworkPolicy of a cluster's members (`spec.networkPolicy`, on by default): ingress only, per port.

- 8008, the agent (`/status`, `/actions/*`): from the operator's pods alone. Its bearer token and TLS
  already keep others out; the policy keeps them from even connecting.
- 5432, PostgreSQL: from the members (replication, pg_rewind, seeding) and the cluster's snapshot Jobs
  (which stream from a member), plus `clients`: unset, anyone; a list, only those peers. The prune Job
  only talks to S3, and a restore runs inside the members (their agents), so neither needs a rule.
- 9187, the agent's Prometheus metrics: from anywhere, as any scraper (Prometheus runs in a namespace
  of its own, or outside the cluster) must reach it; the metrics hold no secret and need no token.
- Nothing else.

Traffic from the member's own node (the kubelet's probes) is always allowed by NetworkPolicy
implementations, so the probes on 8008 need no rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pgherd.kube import names
from pgherd.kube.builders.common import ClusterRef, Manifest, metadata

# The label the API server sets on every namespace (Kubernetes 1.21 on): selects one by its name.
LABEL_NAMESPACE_NAME = "kubernetes.io/metadata.name"
# The pods of a cluster that connect to its PostgreSQL: the members and the snapshot Jobs.
CLUSTER_COMPONENTS = (names.COMPONENT_POSTGRES, names.COMPONENT_SNAPSHOT)


@dataclass(frozen=True)
class OperatorPods:
    """Where the operator runs: its namespace and its pods' labels (the chart passes both)."""

    namespace: str
    labels: Mapping[str, str] = field(default_factory=dict)


def _port(number: int) -> Manifest:
    return {"protocol": "TCP", "port": number}


def operator_peer(operator: OperatorPods) -> Manifest:
    return {
        "namespaceSelector": {"matchLabels": {LABEL_NAMESPACE_NAME: operator.namespace}},
        "podSelector": {"matchLabels": dict(operator.labels)},
    }


def cluster_pods_peer(cluster: str) -> Manifest:
    """The cluster's members and snapshot Jobs, in its namespace."""
    return {
        "podSelector": {
            "matchLabels": {names.LABEL_CLUSTER: cluster},
            "matchExpressions": [
                {"key": names.LABEL_COMPONENT, "operator": "In", "values": list(CLUSTER_COMPONENTS)}
            ],
        }
    }


def network_policy(ref: ClusterRef, operator: OperatorPods | None) -> Manifest | None:
    """The members' policy; None when `spec.networkPolicy.enabled` is false (the adapter deletes an owned
    one then). `operator` None (an operator that does not know its own pods, run outside the chart):
    the agent's port is left open to every source rather than closed to the operator itself."""
    spec = ref.spec.network_policy
    if not spec.enabled:
        return None
    agent: Manifest = {"ports": [_port(names.AGENT_PORT)]}
    if operator is not None and operator.labels:
        agent["from"] = [operator_peer(operator)]
    postgres: Manifest = {"ports": [_port(names.POSTGRES_PORT)]}
    if spec.clients is not None:
        clients = [client.model_dump(by_alias=True, exclude_none=True) for client in spec.clients]
        postgres["from"] = [cluster_pods_peer(ref.name), *clients]
    metrics: Manifest = {"ports": [_port(names.METRICS_PORT)]}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(ref, names.network_policy(ref.name), names.COMPONENT_POSTGRES),
        "spec": {
            "podSelector": {"matchLabels": names.selector_labels(ref.name)},
            "policyTypes": ["Ingress"],
            "ingress": [agent, postgres, metrics],
        },
    }
