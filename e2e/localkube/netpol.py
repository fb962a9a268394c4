"""NetworkPolicies enforced on the node: kube-router's network policy controller (built by
scripts/ensure-network-policies.sh), its firewall alone (no routing, no service proxy: kube-proxy stays
the proxy), as a process with its own client certificate, as kube-proxy runs. It programs iptables
(chains KUBE-ROUTER-INPUT/FORWARD/OUTPUT, a KUBE-POD-FW-* chain per pod a policy selects, a
KUBE-NWPLCY-* chain per policy) and ipsets (KUBE-SRC-*, KUBE-DST-*); pods on the bridge are filtered
as bridged traffic reaches iptables (bridge-nf-call-iptables, which `up` sets). A connection refused by
a policy is answered with an ICMP reject. Traffic from the node itself is always allowed (kube-router's
rule, as every implementation's: the kubelet's probes), so the host reaches every pod.

Why not sigs.k8s.io/kube-network-policies: its rules are an nftables `queue` statement, which this
kernel lacks (NOTES.md, "NetworkPolicies")."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

from e2e.localkube import health
from e2e.localkube.binaries import PATH, host_tool
from e2e.localkube.certs import NETWORK_POLICY
from e2e.localkube.kubectl import Kubectl
from e2e.localkube.processes import Process, start, wait_until
from e2e.localkube.settings import NODE_NAME, Layout, Settings

NAME = "kube-router"
CHAIN_PREFIXES = ("KUBE-ROUTER-", "KUBE-POD-FW-", "KUBE-NWPLCY-")
IPSET_PREFIXES = ("KUBE-SRC-", "KUBE-DST-", "inet6:KUBE-SRC-", "inet6:KUBE-DST-")


def rbac() -> list[dict[str, Any]]:
    """What kube-router reads: every informer it starts waits for its first list, even those of the
    controllers that do not run (services, endpoints, endpoint slices)."""
    name = "localkube:kube-router"
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": name},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["pods", "namespaces", "nodes", "services", "endpoints"],
                    "verbs": ["get", "list", "watch"],
                },
                {
                    "apiGroups": ["networking.k8s.io"],
                    "resources": ["networkpolicies"],
                    "verbs": ["get", "list", "watch"],
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
            "subjects": [
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": NETWORK_POLICY.user}
            ],
        },
    ]


def kube_router(layout: Layout, settings: Settings, netpol_bin: Path, kubectl: Kubectl) -> Process:
    """The firewall controller alone; ready once its /healthz answers (its informers synced and its first
    full sync of the policies done)."""
    kubectl.apply(rbac())
    port = settings.ports.network_policy_healthz
    argv = [
        str(netpol_bin / NAME),
        "--kubeconfig", str(layout.component_kubeconfig(NETWORK_POLICY.name)),
        "--hostname-override", NODE_NAME,
        "--run-firewall=true", "--run-router=false", "--run-service-proxy=false", "--run-loadbalancer=false",
        "--enable-cni=false", "--enable-ipv6=false",
        "--service-cluster-ip-range", settings.service_cidr,
        "--health-port", str(port), "--metrics-port", "0",
        "--v", "1",
    ]  # fmt: skip
    # iptables, iptables-save/-restore and ipset from Debian's packages.
    process = start(layout, NAME, argv, env={**os.environ, "PATH": PATH})
    wait_until(
        "kube-router /healthz",
        lambda: health.answers(f"http://127.0.0.1:{port}/healthz"),
        timeout=90,
        process=process,
        log=layout.log(NAME),
    )
    return process


def remove_rules() -> None:
    """kube-router's chains (with the jumps to them) and ipsets, as its own cleanup removes them; not
    `kube-router --cleanup-config`, which also flushes every IPVS service of the machine and deletes
    interfaces of kube-router's routing, which never ran here."""
    iptables = host_tool("iptables")
    listing = _run(iptables, "-t", "filter", "-S").stdout.splitlines()
    ours = [
        line.split()[1]
        for line in listing
        if line.startswith("-N ") and line.split()[1].startswith(CHAIN_PREFIXES)
    ]
    for rule in listing:
        parts = shlex.split(rule)  # comments are quoted
        if (
            parts[:1] == ["-A"]
            and parts[1] not in ours
            and re.search(r"-j (KUBE-ROUTER-|KUBE-POD-FW-|KUBE-NWPLCY-)", rule)
        ):
            _run(iptables, "-t", "filter", "-D", *parts[1:])
    for chain in ours:
        _run(iptables, "-t", "filter", "-F", chain)
    for chain in ours:
        _run(iptables, "-t", "filter", "-X", chain)
    for name in ipsets():
        _run(host_tool("ipset"), "destroy", name)


def ipsets() -> list[str]:
    """kube-router's ipsets on this machine: none once a cluster is gone."""
    if shutil.which("ipset", path=PATH) is None:
        return []
    return [n for n in _run(host_tool("ipset"), "list", "-n").stdout.split() if n.startswith(IPSET_PREFIXES)]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
