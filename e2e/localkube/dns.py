"""Cluster DNS: CoreDNS (built by scripts/ensure-kubernetes.sh) as a process on the node address, port
53, answering for cluster.local from the API server's Services and EndpointSlices. The operator's
default member addressing (`pgherd operator --member-address dns`, which the chart keeps) names members
`<pod>.<headless service>.<namespace>.svc`, and the kubelet points every pod's resolv.conf here
(clusterDNS in the kubelet's configuration). Nothing is forwarded: pods reach nothing outside this
machine anyway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from e2e.localkube import health
from e2e.localkube.certs import COREDNS
from e2e.localkube.kubectl import Kubectl
from e2e.localkube.processes import Process, start, wait_until
from e2e.localkube.settings import CLUSTER_DOMAIN, Layout, Settings


def rbac() -> list[dict[str, Any]]:
    """What CoreDNS's kubernetes plugin reads (the rules of kubeadm's system:coredns role)."""
    name = "localkube:coredns"
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": name},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["list", "watch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": COREDNS.user}],
        },
    ]


def corefile(layout: Layout, settings: Settings) -> str:
    """TTL 1 and no cache: a member's pod made again gets a new address, and the operator and its peers
    must see it at once (a real cluster's CoreDNS caches 30 s; pgherd's failover must not depend on it)."""
    return f"""\
.:53 {{
    bind {settings.node_ip}
    errors
    health 127.0.0.1:{settings.ports.dns_health}
    ready 127.0.0.1:{settings.ports.dns_ready}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {layout.component_kubeconfig(COREDNS.name)} localkube
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 1
    }}
}}
"""


def coredns(layout: Layout, settings: Settings, bin_dir: Path, kubectl: Kubectl) -> Process:
    kubectl.apply(rbac())
    config = layout.config / "Corefile"
    config.write_text(corefile(layout, settings))
    process = start(layout, "coredns", [str(bin_dir / "coredns"), "-conf", str(config)])
    wait_until(
        "CoreDNS ready (its kubernetes plugin synced)",
        lambda: health.answers(f"http://127.0.0.1:{settings.ports.dns_ready}/ready"),
        timeout=60,
        process=process,
        log=layout.log("coredns"),
    )
    return process
