"""A Kubernetes control plane without a node: the real etcd and kube-apiserver, and when asked
kube-controller-manager with only some of its controllers (the garbage collector, say), on 127.0.0.1,
in a folder of their own. For the adapter's tests of API behaviour (tests/kube) and
bench/operator_scale.py.

The components start exactly as in a cluster of `up` (control_plane.py: the same flags, the PKI and
kubeconfigs of certs.py, RBAC and Node authorization, ServiceAccount tokens, the default admission
plugins, the audit log of every request at Metadata level in DIR/audit.log), except that the API
server listens on 127.0.0.1 (see control_plane.apiserver) and etcd skips fsync unless asked. No root,
no bridge, no lock: it runs beside a localkube cluster, on free ports below the ephemeral range and
outside the localkube range (20200 and up). The CRDs of crds/ are installed and Established before
`start` returns, and the controller-manager starts after them (its garbage collector then knows the
pgherd kinds from its first discovery).

    plane = start(directory, controllers=GC_CONTROLLERS)
    ... plane.kubeconfig (admin), plane.api_url, plane.audit_log, plane.tls() ...
    plane.stop()
"""

from __future__ import annotations

import shutil
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from e2e.localkube import binaries, certs, control_plane, health
from e2e.localkube.kubectl import Kubectl
from e2e.localkube.processes import Process, stop
from e2e.localkube.settings import REPO, Layout, Ports, Settings
from pgherd.local.ports import free_port_range

CRDS = REPO / "crds"
LOOPBACK = "127.0.0.1"
# What owned objects need to behave as on a cluster: owner references followed (the garbage
# collector) and a deleted claim's kubernetes.io/pvc-protection finalizer removed when no pod uses it.
# Not the StatefulSet or Job controllers: with no node, the pods they made would only sit Pending.
GC_CONTROLLERS = ("garbage-collector-controller", "persistentvolumeclaim-protection-controller")
# etcd, its peer port, the API server, the controller-manager: Ports' first four from its base.
PORTS_USED = 4
# Every PostgresCluster has three ClusterIP Services (rw, ro, r): a cluster of `up`'s /24 holds the
# addresses of 84 clusters ("failed to allocate a serviceIP ...: range is full" at the 85th), the
# benchmark makes thousands. Addresses only: no packet goes there without a node.
SERVICE_CIDR = "10.96.0.0/16"


class Unavailable(RuntimeError):
    """The binaries are not built, or kubectl is missing; the message says how to get them."""


def unavailable() -> str | None:
    """Why a control plane cannot start here, or None."""
    if binaries.built_bin_dir() is None:
        return (
            "the Kubernetes binaries (etcd, kube-apiserver) are not built: run `bash scripts/ensure-kubernetes.sh`"
            " (about 12 minutes cold on 2 cores; nothing when they are built)"
        )
    try:
        binaries.tool("kubectl")
    except binaries.Missing as exc:
        return str(exc)
    return None


@dataclass
class ControlPlane:
    layout: Layout
    settings: Settings
    processes: list[Process] = field(default_factory=list)
    seconds: float = 0.0  # how long start() took, CRDs included

    @property
    def api_url(self) -> str:
        return self.settings.api_url

    @property
    def kubeconfig(self) -> Path:
        """The administrator's (system:masters), certificates embedded."""
        return self.layout.kubeconfig

    @property
    def audit_log(self) -> Path:
        return self.layout.audit_log

    @property
    def ca_file(self) -> Path:
        return self.layout.pki / "ca.crt"

    def tls(self) -> ssl.SSLContext:
        """TLS as the administrator (the cluster's CA, the admin client certificate)."""
        return health.admin_tls(self.layout)

    def kubectl(self) -> Kubectl:
        return Kubectl(self.layout)

    def process(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    def stop(self, *, keep_data: bool = False) -> None:
        """Stop every component, the last started first; etcd's data goes unless `keep_data` (logs,
        the audit log and the PKI stay in the folder)."""
        for process in reversed(self.processes):
            stop(process, grace=5.0)
        self.processes.clear()
        if not keep_data:
            shutil.rmtree(self.layout.root / "etcd", ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def install_crds(kubectl: Kubectl, folder: Path = CRDS, timeout: float = 60) -> None:
    """Server-side apply of every CRD in `folder`, then wait until each is Established (its API
    served)."""
    kubectl.run("apply", "--server-side", "-f", str(folder))
    kubectl.run(
        "wait", "--for", "condition=Established", "--timeout", f"{timeout:.0f}s", "-f", str(folder),
        timeout=timeout + 10,
    )  # fmt: skip


def start(
    directory: Path,
    *,
    controllers: Sequence[str] = (),
    crds: Path | None = CRDS,
    fsync: bool = False,
) -> ControlPlane:
    """etcd and kube-apiserver in `directory` (made if needed), the CRDs of `crds` Established, then
    kube-controller-manager with `controllers` when any are named. Every process is killed with this
    one (PR_SET_PDEATHSIG), even when it is killed without a chance to call stop()."""
    started = time.monotonic()
    bin_dir = binaries.built_bin_dir()
    if bin_dir is None:
        raise Unavailable(unavailable() or "the Kubernetes binaries are not built")
    layout = Layout(directory)
    for folder in (layout.root, layout.pki, layout.config, layout.logs):
        folder.mkdir(parents=True, exist_ok=True)
    settings = Settings(
        service_cidr=SERVICE_CIDR, ports=Ports(base=free_port_range(PORTS_USED, LOOPBACK)), api_bind=LOOPBACK
    )
    certs.make_pki(layout, settings)
    certs.write_kubeconfigs(layout, settings)
    plane = ControlPlane(layout, settings)
    try:
        plane.processes.append(
            control_plane.etcd(layout, settings, bin_dir, fsync=fsync, die_with_parent=True)
        )
        plane.processes.append(control_plane.apiserver(layout, settings, bin_dir, die_with_parent=True))
        if crds is not None:
            install_crds(plane.kubectl(), crds)
        if controllers:
            plane.processes.append(
                control_plane.controller_manager(
                    layout, settings, bin_dir, controllers=controllers, die_with_parent=True
                )
            )
    except BaseException:
        plane.stop(keep_data=True)
        raise
    plane.seconds = time.monotonic() - started
    return plane
