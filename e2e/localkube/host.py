"""What a cluster changes on the host outside DIR, and how `down` undoes it: the bridge (made before the
API server binds its address), the route that keeps service addresses on it, two sysctls, the
kubelet's cgroup root in every hierarchy, the folders some components create at fixed paths, and the
iptables chains kube-proxy and the kubelet add."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from e2e.localkube.settings import Settings

IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
BRIDGE_NF_CALL_IPTABLES = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
CGROUP_MOUNT = Path("/sys/fs/cgroup")
# Created whatever the flags say: the kubelet's device-plugin socket, libcni's result cache inside
# containerd 1.6, the kubelet's links to pod logs, the shims' sockets. `down` removes the ones that were
# not there before `up`.
FIXED_FOLDERS = ("/var/lib/kubelet", "/var/lib/cni", "/var/log/containers", "/run/containerd")
# The kubelet's own chains (kube-proxy --cleanup removes kube-proxy's).
KUBELET_CHAINS = ("KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT", "KUBE-FIREWALL")


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` exited with {result.returncode}: {result.stderr.strip()}")
    return result


def bridge_exists(name: str) -> bool:
    return run("ip", "link", "show", name, check=False).returncode == 0


def read_sysctls() -> dict[str, Any]:
    """The values `up` changes, to put back at `down`."""
    return {
        "ipForward": IP_FORWARD.read_text().strip(),
        "bridgeNfCallIptables": BRIDGE_NF_CALL_IPTABLES.read_text().strip()
        if BRIDGE_NF_CALL_IPTABLES.exists()
        else None,
        "preexisting": [folder for folder in FIXED_FOLDERS if Path(folder).exists()],
    }


def set_up_network(settings: Settings) -> None:
    """The bridge with the node address, the service range routed onto it (a packet to a ClusterIP must
    not leave the machine before kube-proxy's rules are in place), bridged traffic through iptables (a
    pod reaching a Service whose endpoint is on the same bridge) and forwarding."""
    name = settings.bridge
    run("ip", "link", "add", name, "type", "bridge")
    run("ip", "addr", "add", f"{settings.node_ip}/{settings.prefix_length}", "dev", name)
    run("ip", "link", "set", name, "up")
    run("ip", "route", "add", settings.service_cidr, "dev", name, "src", settings.node_ip)
    BRIDGE_NF_CALL_IPTABLES.write_text("1\n")
    IP_FORWARD.write_text("1\n")


def hierarchies() -> list[Path]:
    """The mounted cgroup v1 hierarchies (or the v2 root)."""
    return sorted(path for path in CGROUP_MOUNT.iterdir() if (path / "cgroup.procs").exists()) or (
        [CGROUP_MOUNT] if (CGROUP_MOUNT / "cgroup.procs").exists() else []
    )


def make_cgroup_root(settings: Settings) -> None:
    """The kubelet's cgroupRoot in every hierarchy; a cpuset cgroup takes no task until its cpus and
    mems are filled in."""
    for hierarchy in hierarchies():
        folder = hierarchy / settings.cgroup_root.lstrip("/")
        folder.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (hierarchy / name).exists():
                (folder / name).write_text((hierarchy / name).read_text())


def cgroup_pids(settings: Settings) -> set[int]:
    pids: set[int] = set()
    for hierarchy in hierarchies():
        folder = hierarchy / settings.cgroup_root.lstrip("/")
        if not folder.exists():
            continue
        for procs in folder.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids.update(int(line) for line in procs.read_text().split())
    return pids


def remove_cgroup_root(settings: Settings) -> list[str]:
    """Remove the cgroup folders, deepest first; the ones that would not go (a process still in them)."""
    stuck = []
    for hierarchy in hierarchies():
        folder = hierarchy / settings.cgroup_root.lstrip("/")
        if not folder.exists():
            continue
        for sub in sorted(
            (p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
        ):
            with contextlib.suppress(OSError):
                sub.rmdir()
        try:
            folder.rmdir()
        except OSError:
            stuck.append(str(folder))
    return stuck


def remove_kubelet_chains() -> None:
    """The kubelet's chains, in each table of iptables and ip6tables, with the jumps to them."""
    for command in ("iptables", "ip6tables"):
        for table in ("mangle", "nat", "filter"):
            listing = run(command, "-t", table, "-S", check=False).stdout
            for chain in KUBELET_CHAINS:
                if f"-N {chain}" not in listing:
                    continue
                for rule in listing.splitlines():
                    if re.match(rf"^-A \S+ .*-j {chain}( |$)", rule):
                        run(command, "-t", table, *("-D", *rule.split()[1:]), check=False)
                run(command, "-t", table, "-F", chain, check=False)
                run(command, "-t", table, "-X", chain, check=False)


def kube_rules() -> list[str]:
    """Every iptables/ip6tables line that names a KUBE- chain: empty once a cluster is gone."""
    found = []
    for command in ("iptables-save", "ip6tables-save"):
        if shutil.which(command):
            found += [line for line in run(command, check=False).stdout.splitlines() if "KUBE-" in line]
    return found


def mounts_under(directory: Path) -> list[str]:
    """Mount points under `directory`, deepest first."""
    listing = run("findmnt", "-rn", "-o", "TARGET", check=False).stdout.splitlines()
    prefix = f"{directory}/"
    # findmnt escapes spaces and other characters as \x20; DIR paths have none of them.
    return sorted({m for m in listing if m.startswith(prefix) or m == str(directory)}, reverse=True)


def unmount_under(directory: Path) -> list[str]:
    """Unmount everything under `directory` (the kubelet's bind mount of its root dir, projected tokens'
    tmpfs, overlay root filesystems, network namespaces); what stayed mounted."""
    for target in mounts_under(directory):
        if run("umount", target, check=False).returncode != 0:
            run("umount", "-l", target, check=False)
    return mounts_under(directory)


def remove_bridge(name: str) -> None:
    if not bridge_exists(name):
        return
    for line in run("ip", "-o", "link", "show", "master", name, check=False).stdout.splitlines():
        veth = line.split(": ")[1].split("@")[0]
        run("ip", "link", "del", veth, check=False)
    run("ip", "link", "del", name, check=False)


def remove_log_links(directory: Path) -> None:
    """The kubelet's links in /var/log/containers that point into DIR."""
    folder = Path("/var/log/containers")
    if not folder.is_dir():
        return
    for link in folder.iterdir():
        if link.is_symlink() and str(link.readlink()).startswith(f"{directory}/"):
            link.unlink(missing_ok=True)


def remove_fixed_folders(preexisting: list[str]) -> None:
    for folder in FIXED_FOLDERS:
        if folder not in preexisting:
            shutil.rmtree(folder, ignore_errors=True)


def restore_sysctls(saved: dict[str, Any]) -> None:
    if saved.get("ipForward") is not None:
        IP_FORWARD.write_text(f"{saved['ipForward']}\n")
    if saved.get("bridgeNfCallIptables") is not None and BRIDGE_NF_CALL_IPTABLES.exists():
        BRIDGE_NF_CALL_IPTABLES.write_text(f"{saved['bridgeNfCallIptables']}\n")
