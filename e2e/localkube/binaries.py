"""Where the programs come from: Kubernetes, CoreDNS and local-path-provisioner from
scripts/ensure-kubernetes.sh (built from their Go modules into a cache, reused while the pins are
unchanged), kube-router (the node's NetworkPolicy controller) from scripts/ensure-network-policies.sh,
containerd, runc, the CNI plugins and the host tools from Debian's packages, kubectl and helm from
`make setup` (.tools/bin)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from e2e.localkube.settings import REPO

ENSURE_KUBERNETES = REPO / "scripts" / "ensure-kubernetes.sh"
ENSURE_NETWORK_POLICIES = REPO / "scripts" / "ensure-network-policies.sh"
BUILT = (
    "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy", "crictl",
    "coredns", "local-path-provisioner",
)  # fmt: skip
CNI_DIR = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")
# Host commands and the Debian package of each.
HOST_TOOLS = {
    "containerd": "containerd",
    "containerd-shim-runc-v2": "containerd",
    "ctr": "containerd",
    "runc": "runc",
    "iptables": "iptables",
    "ip6tables": "iptables",
    "ip": "iproute2",
    "conntrack": "conntrack",
    "catatonit": "catatonit",
    "busybox": "busybox-static",
    "findmnt": "util-linux",
    "ipset": "ipset",
}
APT_INSTALL = (
    "apt-get install -y --no-install-recommends containerd runc containernetworking-plugins iptables "
    "conntrack iproute2 catatonit busybox-static ipset"
)
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Missing(RuntimeError):
    """A program is missing; the message says how to get it."""


def kubernetes_bin() -> Path:
    """The folder of the built binaries; scripts/ensure-kubernetes.sh builds them first when the pins
    changed (a cold build takes 10 to 12 minutes on 2 cores)."""
    result = subprocess.run(
        ["bash", str(ENSURE_KUBERNETES)], cwd=REPO, stdout=subprocess.PIPE, text=True, check=False
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        raise Missing(
            f"scripts/ensure-kubernetes.sh failed (exit {result.returncode}); see its messages above"
        )
    folder = Path(lines[-1])
    absent = [name for name in BUILT if not os.access(folder / name, os.X_OK)]
    if absent:
        raise Missing(f"{folder} lacks {', '.join(absent)}: run scripts/ensure-kubernetes.sh --rebuild")
    return folder


def network_policy_bin() -> Path:
    """The folder of kube-router, built first by scripts/ensure-network-policies.sh when missing (about
    3 minutes cold on 2 cores)."""
    result = subprocess.run(
        ["bash", str(ENSURE_NETWORK_POLICIES)], cwd=REPO, stdout=subprocess.PIPE, text=True, check=False
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines or not os.access(Path(lines[-1]) / "kube-router", os.X_OK):
        raise Missing(
            f"scripts/ensure-network-policies.sh failed (exit {result.returncode}); see its messages above"
        )
    return Path(lines[-1])


def built_network_policy_bin() -> Path | None:
    """kube-router's folder if it is built for the current pin, without building."""
    result = subprocess.run(
        ["bash", str(ENSURE_NETWORK_POLICIES), "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    return (
        Path(result.stdout.strip().splitlines()[-1])
        if result.returncode == 0 and result.stdout.strip()
        else None
    )


def built_bin_dir() -> Path | None:
    """The folder of the built binaries if they are built for the current pins, without building."""
    result = subprocess.run(
        ["bash", str(ENSURE_KUBERNETES), "--check"], cwd=REPO, capture_output=True, text=True, check=False
    )
    return (
        Path(result.stdout.strip().splitlines()[-1])
        if result.returncode == 0 and result.stdout.strip()
        else None
    )


def versions(bin_dir: Path) -> str:
    """The first line of the build's stamp: every component's version."""
    stamp = bin_dir.parent / "stamp"
    return stamp.read_text().splitlines()[0] if stamp.exists() else "unknown"


def check_host() -> None:
    """Root, and the Debian packages the node runs on."""
    if os.geteuid() != 0:
        raise Missing("localkube needs root (containerd, the kubelet, iptables, a bridge)")
    absent = [tool for tool in HOST_TOOLS if shutil.which(tool, path=PATH) is None]
    absent += [f"{CNI_DIR}/{plugin}" for plugin in CNI_PLUGINS if not os.access(CNI_DIR / plugin, os.X_OK)]
    if absent:
        raise Missing(f"missing on this machine: {', '.join(absent)}; install them with\n  {APT_INSTALL}")


def tool(name: str) -> str:
    """A repository tool (kubectl, helm): $KUBECTL/$HELM, .tools/bin (make setup), else PATH."""
    override = os.environ.get(name.upper())
    if override:
        return override
    local = REPO / ".tools" / "bin" / name
    if os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise Missing(f"{name} not found in .tools/bin nor on PATH: run `make setup`")
    return found


def host_tool(name: str) -> str:
    found = shutil.which(name, path=PATH)
    if found is None:
        raise Missing(f"{name} not found; install it with\n  {APT_INSTALL}")
    return found
