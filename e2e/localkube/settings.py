"""What a localkube cluster is made of before anything starts: its addresses and ports (Settings, saved
in DIR/state.json so that `down` and the e2e driver find them) and where each file lives under DIR
(Layout)."""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# Fixed names a single node needs; one cluster per machine (see lock.py), so they never clash.
NODE_NAME = "localkube"
CLUSTER_DOMAIN = "cluster.local"
# The images made here (images.py): no registry serves them, pods use them with pullPolicy Never.
PAUSE_IMAGE = "localkube.local/pause:1"
BUSYBOX_IMAGE = "localkube.local/busybox:1"
# The project's image as loaded into containerd, and the PostgreSQL major of the examples.
PROJECT_IMAGE = "localkube.local/pgherd:e2e"
POSTGRES_MAJOR = 16
# The other majors the image carries: 17, the upgrade scenarios' new major (e2e/test_major_upgrade.py).
EXTRA_MAJORS = "17"
S3_BUCKET = "pgherd-e2e"
S3_SECRET = "pgherd-e2e-s3"  # in `default`, copied into each scenario's namespace
S3_CA_SECRET = "pgherd-e2e-s3-ca"  # the S3 server's private CA (ca.crt), likewise: the store's endpointCA
S3_REGION = "us-east-1"
STORAGE_CLASS = "standard"  # kind's name for its default class, on the same provisioner
# The chart as the README installs it.
RELEASE = "pgherd"
OPERATOR_NAMESPACE = "pgherd-system"


@dataclass(frozen=True)
class Ports:
    """Every port a component listens on, from `base` upwards (all on 127.0.0.1 or the node address)."""

    base: int = 20200

    @property
    def etcd(self) -> int:
        return self.base

    @property
    def etcd_peer(self) -> int:
        return self.base + 1

    @property
    def apiserver(self) -> int:
        return self.base + 2

    @property
    def controller_manager(self) -> int:
        return self.base + 3

    @property
    def scheduler(self) -> int:
        return self.base + 4

    @property
    def kubelet(self) -> int:
        return self.base + 5

    @property
    def kubelet_healthz(self) -> int:
        return self.base + 6

    @property
    def proxy_metrics(self) -> int:
        return self.base + 7

    @property
    def proxy_healthz(self) -> int:
        return self.base + 8

    @property
    def dns_health(self) -> int:
        return self.base + 9

    @property
    def dns_ready(self) -> int:
        return self.base + 10

    @property
    def network_policy_healthz(self) -> int:
        """kube-router's health endpoint (it binds every address: netpol.py)."""
        return self.base + 11

    def all(self) -> dict[str, int]:
        names = (
            "etcd", "etcd_peer", "apiserver", "controller_manager", "scheduler", "kubelet", "kubelet_healthz",
            "proxy_metrics", "proxy_healthz", "dns_health", "dns_ready", "network_policy_healthz",
        )  # fmt: skip
        return {name: int(getattr(self, name)) for name in names}


@dataclass(frozen=True)
class Settings:
    bridge: str = "lk0"
    pod_cidr: str = "10.244.0.0/24"
    service_cidr: str = "10.96.0.0/24"
    ports: Ports = field(default_factory=Ports)
    # Where the API server listens when not on the node address: 127.0.0.1 for a control plane
    # without a node (apiserver_only.py). None (a cluster of `up`): the node address.
    api_bind: str | None = None

    @property
    def node_ip(self) -> str:
        """The bridge's address: the node's InternalIP, where the API server, the kubelet, DNS and S3
        listen (EndpointSlices refuse loopback addresses)."""
        return str(next(ipaddress.ip_network(self.pod_cidr).hosts()))

    @property
    def prefix_length(self) -> int:
        return ipaddress.ip_network(self.pod_cidr).prefixlen

    @property
    def kubernetes_service_ip(self) -> str:
        """The `kubernetes` Service's ClusterIP: the first address of the service range."""
        return str(next(ipaddress.ip_network(self.service_cidr).hosts()))

    @property
    def cgroup_root(self) -> str:
        """The kubelet's cgroupRoot: every pod of this cluster lives under it, in every hierarchy."""
        return f"/localkube-{self.bridge}"

    @property
    def api_address(self) -> str:
        return self.api_bind or self.node_ip

    @property
    def api_url(self) -> str:
        return f"https://{self.api_address}:{self.ports.apiserver}"

    def to_json(self) -> dict[str, Any]:
        data = {**asdict(self), "ports": {"base": self.ports.base, **self.ports.all()}}
        if self.api_bind is None:
            del data["api_bind"]  # state.json of a cluster of `up` as before
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Settings:
        return cls(
            bridge=str(data["bridge"]),
            pod_cidr=str(data["pod_cidr"]),
            service_cidr=str(data["service_cidr"]),
            ports=Ports(base=int(data["ports"]["base"])),
            api_bind=data.get("api_bind"),
        )


@dataclass(frozen=True)
class Layout:
    """The files of a cluster under DIR."""

    root: Path

    @property
    def kubeconfig(self) -> Path:
        """The administrator's kubeconfig (system:masters)."""
        return self.root / "kubeconfig"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def audit_log(self) -> Path:
        return self.root / "audit.log"

    @property
    def s3_json(self) -> Path:
        return self.root / "s3.json"

    @property
    def values(self) -> Path:
        """The chart's values for this cluster (written by `up`, passed to helm with -f)."""
        return self.root / "values.yaml"

    @property
    def env(self) -> Path:
        """A shell file to source: KUBECONFIG, the CRI endpoint, the binaries on PATH."""
        return self.root / "env"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def config(self) -> Path:
        return self.root / "config"

    @property
    def pids(self) -> Path:
        """One file per started process: {pid, startTime}, written the moment it starts."""
        return self.root / "pids"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, component: str) -> Path:
        return self.logs / f"{component}.log"

    def component_kubeconfig(self, component: str) -> Path:
        return self.config / f"{component}.kubeconfig"

    @property
    def containerd(self) -> Path:
        return self.root / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.containerd / "containerd.sock"

    @property
    def cri_endpoint(self) -> str:
        return f"unix://{self.containerd_socket}"

    @property
    def cni(self) -> Path:
        return self.root / "cni"

    @property
    def kubelet(self) -> Path:
        return self.root / "kubelet"

    @property
    def pod_logs(self) -> Path:
        return self.root / "pod-logs"

    @property
    def volume_plugins(self) -> Path:
        return self.root / "volume-plugins"

    @property
    def volumes(self) -> Path:
        """Where the default StorageClass makes each claim's directory."""
        return self.root / "volumes"

    @property
    def images(self) -> Path:
        return self.root / "images"

    @property
    def s3_data(self) -> Path:
        return self.root / "s3"

    @property
    def s3_tls(self) -> Path:
        """The S3 server's certificate and key, and the private CA that signed them."""
        return self.root / "s3-tls"
