"""The control plane, one function per component: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler, each started with its flags and configuration and waited for until it is healthy.
NOTES.md explains the flags."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from e2e.localkube import health
from e2e.localkube.certs import CONTROLLER_MANAGER, SCHEDULER
from e2e.localkube.processes import Process, start, wait_until
from e2e.localkube.settings import NODE_NAME, Layout, Settings

# Every request, at Metadata level (who, verb, resource, response code; no bodies), once it completed:
# the operator's RBAC and its request counts are read from this log.
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
"""

# On top of the defaults (PodSecurity among them): NodeRestriction, as every kubeadm cluster, and
# OwnerReferencesPermissionEnforcement, as OpenShift: an owner reference with blockOwnerDeletion needs
# `update` of the owner's finalizers, the one right of the operator's that no request of its own uses.
ADMISSION_PLUGINS = ("NodeRestriction", "OwnerReferencesPermissionEnforcement")


def etcd(
    layout: Layout, settings: Settings, bin_dir: Path, *, fsync: bool = True, die_with_parent: bool = False
) -> Process:
    """One member on loopback. ``fsync=False``: etcd's --unsafe-no-fsync, for a throw-away control plane
    whose numbers must be about its clients, not this machine's disk (apiserver_only.py)."""
    ports = settings.ports
    client = f"http://127.0.0.1:{ports.etcd}"
    peer = f"http://127.0.0.1:{ports.etcd_peer}"
    argv = [
        str(bin_dir / "etcd"), "--name", NODE_NAME, "--data-dir", str(layout.root / "etcd"),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"{NODE_NAME}={peer}", "--initial-cluster-state", "new",
        "--log-level", "warn",
    ]  # fmt: skip
    if not fsync:
        argv.append("--unsafe-no-fsync")
    process = start(layout, "etcd", argv, die_with_parent=die_with_parent)
    wait_until(
        "etcd healthy",
        lambda: health.answers(f"{client}/health"),
        timeout=30,
        process=process,
        log=layout.log("etcd"),
    )
    return process


def apiserver(layout: Layout, settings: Settings, bin_dir: Path, *, die_with_parent: bool = False) -> Process:
    """Bound to the node address only: pods reach it through the `kubernetes` Service, whose endpoint
    cannot be a loopback address. RBAC and Node authorization, ServiceAccount tokens, the default
    admission plugins plus ADMISSION_PLUGINS, the audit log of every request.

    With ``settings.api_bind`` (a control plane without a node, apiserver_only.py): bound there
    (127.0.0.1) and advertising it, with no endpoint reconciler. A loopback advertise address alone is
    refused every 10 s (`Endpoints "kubernetes" is invalid: ... may not be in the loopback range`);
    without one it advertises the host's default interface, an address not ours. With the reconciler
    off the `kubernetes` Service has no endpoints: nothing runs in a pod there to use them."""
    pki = layout.pki
    bind = settings.api_address
    node_less = ["--endpoint-reconciler-type", "none"] if settings.api_bind else []
    policy = layout.config / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY)
    argv = [
        str(bin_dir / "kube-apiserver"),
        "--etcd-servers", f"http://127.0.0.1:{settings.ports.etcd}",
        "--bind-address", bind, "--advertise-address", bind, *node_less,
        "--secure-port", str(settings.ports.apiserver),
        "--tls-cert-file", str(pki / "apiserver.crt"), "--tls-private-key-file", str(pki / "apiserver.key"),
        "--client-ca-file", str(pki / "ca.crt"),
        "--authorization-mode", "Node,RBAC",
        "--enable-admission-plugins", ",".join(ADMISSION_PLUGINS),
        "--allow-privileged=true",
        "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
        "--service-account-key-file", str(pki / "sa.pub"),
        "--service-account-signing-key-file", str(pki / "sa.key"),
        "--service-cluster-ip-range", settings.service_cidr,
        "--kubelet-client-certificate", str(pki / "apiserver-kubelet-client.crt"),
        "--kubelet-client-key", str(pki / "apiserver-kubelet-client.key"),
        "--kubelet-preferred-address-types", "InternalIP",
        "--audit-policy-file", str(policy), "--audit-log-path", str(layout.audit_log),
        "--audit-log-format", "json", "--audit-log-maxsize", "0",
        "--requestheader-client-ca-file", str(pki / "front-proxy-ca.crt"),
        "--requestheader-allowed-names", "front-proxy-client",
        "--requestheader-username-headers", "X-Remote-User",
        "--requestheader-group-headers", "X-Remote-Group",
        "--requestheader-extra-headers-prefix", "X-Remote-Extra-",
        "--proxy-client-cert-file", str(pki / "front-proxy-client.crt"),
        "--proxy-client-key-file", str(pki / "front-proxy-client.key"),
        "--profiling=false",
    ]  # fmt: skip
    process = start(layout, "kube-apiserver", argv, die_with_parent=die_with_parent)
    tls = health.admin_tls(layout)
    wait_until(
        "kube-apiserver /readyz",
        lambda: health.answers(f"{settings.api_url}/readyz", tls),
        timeout=90,
        process=process,
        log=layout.log("kube-apiserver"),
    )
    return process


def controller_manager(
    layout: Layout,
    settings: Settings,
    bin_dir: Path,
    *,
    controllers: Sequence[str] = (),
    die_with_parent: bool = False,
) -> Process:
    """No leader election (one of each), ServiceAccount credentials per controller, no node IPAM (the
    CNI plugin's host-local IPAM gives addresses), the flex-volume folder under DIR (it would create
    one under /usr/libexec otherwise). ``controllers``: only those (--controllers), else all the
    default ones."""
    kubeconfig = str(layout.component_kubeconfig(CONTROLLER_MANAGER.name))
    pki = layout.pki
    argv = [
        str(bin_dir / "kube-controller-manager"),
        "--kubeconfig", kubeconfig,
        "--authentication-kubeconfig", kubeconfig, "--authorization-kubeconfig", kubeconfig,
        "--bind-address", "127.0.0.1", "--secure-port", str(settings.ports.controller_manager),
        "--cert-dir", str(layout.root / "controller-manager"),
        "--leader-elect=false", "--use-service-account-credentials",
        "--service-account-private-key-file", str(pki / "sa.key"), "--root-ca-file", str(pki / "ca.crt"),
        "--cluster-signing-cert-file", str(pki / "ca.crt"), "--cluster-signing-key-file", str(pki / "ca.key"),
        "--service-cluster-ip-range", settings.service_cidr, "--cluster-cidr", settings.pod_cidr,
        "--allocate-node-cidrs=false",
        "--flex-volume-plugin-dir", str(layout.volume_plugins),
    ]  # fmt: skip
    if controllers:
        argv += ["--controllers", ",".join(controllers)]
    process = start(layout, "kube-controller-manager", argv, die_with_parent=die_with_parent)
    wait_until(
        "kube-controller-manager /healthz",
        lambda: health.answers(
            f"https://127.0.0.1:{settings.ports.controller_manager}/healthz", health.insecure_tls()
        ),
        timeout=60,
        process=process,
        log=layout.log("kube-controller-manager"),
    )
    return process


def scheduler(layout: Layout, settings: Settings, bin_dir: Path) -> Process:
    kubeconfig = layout.component_kubeconfig(SCHEDULER.name)
    config = layout.config / "scheduler.yaml"
    config.write_text(
        "apiVersion: kubescheduler.config.k8s.io/v1\n"
        "kind: KubeSchedulerConfiguration\n"
        f"clientConnection:\n  kubeconfig: {kubeconfig}\n"
        "leaderElection:\n  leaderElect: false\n"
    )
    argv = [
        str(bin_dir / "kube-scheduler"), "--config", str(config),
        "--authentication-kubeconfig", str(kubeconfig), "--authorization-kubeconfig", str(kubeconfig),
        "--bind-address", "127.0.0.1", "--secure-port", str(settings.ports.scheduler),
        "--cert-dir", str(layout.root / "scheduler"),
    ]  # fmt: skip
    process = start(layout, "kube-scheduler", argv)
    wait_until(
        "kube-scheduler /healthz",
        lambda: health.answers(
            f"https://127.0.0.1:{settings.ports.scheduler}/healthz", health.insecure_tls()
        ),
        timeout=60,
        process=process,
        log=layout.log("kube-scheduler"),
    )
    return process
