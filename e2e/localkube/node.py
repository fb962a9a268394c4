"""The node: containerd (Debian's, with its root, state, socket and the runc root under DIR), the CNI
configuration that puts pods on the bridge, the kubelet and kube-proxy. NOTES.md explains the settings
(cgroup v1, the clamped oom_score_adj, the absent RuntimeConfig call of containerd 1.6)."""

from __future__ import annotations

import json
from pathlib import Path

from e2e.localkube import health
from e2e.localkube.binaries import host_tool
from e2e.localkube.certs import KUBE_PROXY, KUBELET
from e2e.localkube.processes import Process, start, wait_until
from e2e.localkube.settings import CLUSTER_DOMAIN, NODE_NAME, PAUSE_IMAGE, Layout, Settings


def containerd_config(layout: Layout) -> str:
    """restrict_oom_score_adj: the kubelet asks -998 for sandboxes and -997 for Guaranteed pods, which
    this machine refuses (no CAP_SYS_RESOURCE); containerd clamps them to its own score instead.
    netns_mounts_under_state_dir keeps the pods' network namespaces under DIR."""
    c = layout.containerd
    return f"""\
version = 2
root = "{c / "root"}"
state = "{c / "state"}"
oom_score = 0
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]

[grpc]
  address = "{layout.containerd_socket}"

[ttrpc]
  address = "{layout.containerd_socket}.ttrpc"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  disable_apparmor = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{host_tool("runc")}"
        Root = "{c / "runc"}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{layout.cni / "net.d"}"
    max_conf_num = 1
"""


def cni_config(layout: Layout, settings: Settings) -> dict[str, object]:
    """The bridge plugin with host-local addresses. No default route in pods and no masquerading: a pod
    reaches its subnet (other pods, the node: API server, DNS, S3) and the service range, nothing else."""
    return {
        "cniVersion": "1.0.0",
        "name": "localkube",
        "plugins": [
            {
                "type": "bridge",
                "bridge": settings.bridge,
                "isGateway": True,
                "isDefaultGateway": False,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": settings.pod_cidr, "gateway": settings.node_ip}]],
                    "routes": [{"dst": settings.service_cidr}],
                    "dataDir": str(layout.cni / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def containerd(layout: Layout, settings: Settings) -> Process:
    config = layout.config / "containerd.toml"
    config.write_text(containerd_config(layout))
    (layout.cni / "net.d").mkdir(parents=True, exist_ok=True)
    (layout.cni / "net.d" / "10-localkube.conflist").write_text(
        json.dumps(cni_config(layout, settings), indent=2)
    )
    layout.containerd.mkdir(parents=True, exist_ok=True)
    process = start(layout, "containerd", [host_tool("containerd"), "--config", str(config)])
    wait_until(
        "containerd's socket",
        layout.containerd_socket.exists,
        timeout=30,
        process=process,
        log=layout.log("containerd"),
    )
    return process


def kubelet_config(layout: Layout, settings: Settings) -> str:
    """cgroupfs (containerd 1.6 has no RuntimeConfig call, so the kubelet takes this setting), cgroup
    v1 allowed, oomScoreAdj 0 (a negative one is refused here), cluster DNS at the node address, no
    host resolv.conf, no image garbage collection (no registry could give an image back)."""
    pki = layout.pki
    return f"""\
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {settings.node_ip}
port: {settings.ports.kubelet}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {settings.ports.kubelet_healthz}
tlsCertFile: {pki / "kubelet-serving.crt"}
tlsPrivateKeyFile: {pki / "kubelet-serving.key"}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {pki / "ca.crt"}}}
authorization:
  mode: Webhook
containerRuntimeEndpoint: {layout.cri_endpoint}
cgroupDriver: cgroupfs
cgroupRoot: {settings.cgroup_root}
failCgroupV1: false
failSwapOn: true
oomScoreAdj: 0
podLogsDir: {layout.pod_logs}
volumePluginDir: {layout.volume_plugins}
clusterDomain: {CLUSTER_DOMAIN}
clusterDNS: ["{settings.node_ip}"]
resolvConf: ""
rotateCertificates: false
serverTLSBootstrap: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  imagefs.available: 1%
"""


def kubelet(layout: Layout, settings: Settings, bin_dir: Path) -> Process:
    config = layout.config / "kubelet.yaml"
    config.write_text(kubelet_config(layout, settings))
    layout.kubelet.mkdir(parents=True, exist_ok=True)
    layout.pod_logs.mkdir(parents=True, exist_ok=True)
    argv = [
        str(bin_dir / "kubelet"), "--config", str(config),
        "--kubeconfig", str(layout.component_kubeconfig(KUBELET.name)),
        "--root-dir", str(layout.kubelet), "--cert-dir", str(layout.kubelet / "pki"),
        "--hostname-override", NODE_NAME, "--node-ip", settings.node_ip,
    ]  # fmt: skip
    process = start(layout, "kubelet", argv)
    wait_until(
        "kubelet /healthz",
        lambda: health.answers(f"http://127.0.0.1:{settings.ports.kubelet_healthz}/healthz"),
        timeout=60,
        process=process,
        log=layout.log("kubelet"),
    )
    return process


def kube_proxy(layout: Layout, settings: Settings, bin_dir: Path) -> Process:
    """iptables mode; the conntrack sysctls left alone (0 = do not set); NodePorts on the node address
    only (localhostNodePorts would need route_localnet)."""
    ports = settings.ports
    config = layout.config / "kube-proxy.yaml"
    config.write_text(
        f"""\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: {layout.component_kubeconfig(KUBE_PROXY.name)}
hostnameOverride: {NODE_NAME}
mode: iptables
clusterCIDR: {settings.pod_cidr}
healthzBindAddress: 127.0.0.1:{ports.proxy_healthz}
metricsBindAddress: 127.0.0.1:{ports.proxy_metrics}
nodePortAddresses: ["{settings.node_ip}/32"]
oomScoreAdj: 0
conntrack:
  maxPerCore: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
iptables:
  localhostNodePorts: false
"""
    )
    process = start(layout, "kube-proxy", [str(bin_dir / "kube-proxy"), "--config", str(config)])
    wait_until(
        "kube-proxy /healthz",
        lambda: health.answers(f"http://127.0.0.1:{ports.proxy_healthz}/healthz"),
        timeout=60,
        process=process,
        log=layout.log("kube-proxy"),
    )
    return process
