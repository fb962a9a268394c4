"""`python -m e2e.localkube down --dir DIR`: stop and remove everything `up` started or changed, in
the reverse order of its dependencies, from DIR/state.json alone (so that it works after a failed or
killed `up`, and a second time). Nothing is signalled but the processes `up` recorded (by pid and
start time), the containerd shims that name this cluster's socket, and the processes in this
cluster's cgroups."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from e2e.localkube import host, lock, netpol, partition
from e2e.localkube.processes import kill, processes_matching, stop
from e2e.localkube.settings import Layout
from e2e.localkube.state import State

# Add-ons and the node first (nothing may recreate pods), then the pods, containerd, the control plane.
ORDER = (
    "local-path-provisioner", "coredns", "s3", "kube-router", "kube-proxy", "kubelet", "containerd",
    "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd",
)  # fmt: skip
GRACE = {"kubelet": 30.0, "containerd": 20.0}


def say(message: str) -> None:
    print(f"localkube down: {message}", flush=True)


def remove_pods(layout: Layout, state: State) -> None:
    """Every pod sandbox through the CRI: stopping one runs the CNI DEL (its address and veth released)."""
    containerd = state.process("containerd")
    bin_dir = state.bin_dir
    if containerd is None or not containerd.alive or bin_dir is None or not layout.containerd_socket.exists():
        return
    result = subprocess.run(
        [str(bin_dir / "crictl"), "--runtime-endpoint", layout.cri_endpoint, "--timeout", "30s", "rmp", "--all", "--force"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        say(f"crictl rmp --all failed: {result.stderr.strip()}")


def kill_shims(layout: Layout) -> None:
    """containerd's shims outlive containerd: those started for this cluster name its socket."""
    socket = str(layout.containerd_socket)
    for pid in processes_matching(
        lambda argv: bool(argv) and "containerd-shim" in argv[0] and socket in argv
    ):
        kill(pid)


def teardown(layout: Layout, state: State) -> list[str]:
    """Undo everything; the leftovers found afterwards (empty when all is gone)."""
    settings = state.settings
    for name in ORDER:
        process = state.process(name)
        if process is None:
            continue
        if name == "containerd":
            remove_pods(layout, state)
        if stop(process, GRACE.get(name, 15.0)):
            say(f"stopped {name} ({process.pid})")
        if name == "containerd":
            kill_shims(layout)
    for process in state.processes():  # anything else recorded
        stop(process, 10.0)
    if settings is not None:
        # Container processes whose shim was killed: whatever is still in the pods' cgroups.
        for pid in host.cgroup_pids(settings):
            kill(pid)
        time.sleep(0.2)
        host.remove_cgroup_root(settings)
    bin_dir = state.bin_dir
    if bin_dir is not None and (bin_dir / "kube-proxy").exists() and state.data.get("bridge"):
        subprocess.run(
            [str(bin_dir / "kube-proxy"), "--cleanup"], capture_output=True, timeout=60, check=False
        )
        host.remove_kubelet_chains()
    if state.data.get("bridge"):
        netpol.remove_rules()
        partition.heal()
    host.unmount_under(layout.root)
    if settings is not None and state.data.get("bridge"):
        host.remove_bridge(settings.bridge)
    host.remove_log_links(layout.root)
    saved = state.data.get("host")
    if saved:
        host.remove_fixed_folders(list(saved.get("preexisting") or []))
        host.restore_sysctls(saved)
    for process in state.processes():
        if not process.alive:
            state.forget_process(process.name)
    state.update(ready=False, bridge=None)
    return leftovers(layout, state)


def leftovers(layout: Layout, state: State) -> list[str]:
    found = [f"process {p.name} ({p.pid})" for p in state.running()]
    found += [f"mount {m}" for m in host.mounts_under(layout.root)]
    settings = state.settings
    if settings is not None:
        if host.bridge_exists(settings.bridge):
            found.append(f"bridge {settings.bridge}")
        found += [f"cgroup process {pid}" for pid in host.cgroup_pids(settings)]
    found += [f"iptables: {rule}" for rule in host.kube_rules()]
    found += [f"ipset {name}" for name in netpol.ipsets()]
    found += [f"iptables raw: {rule}" for rule in partition.rules()]
    return found


def down(directory: Path, *, keep: bool) -> int:
    layout = Layout(directory)
    with lock.held(timeout=600) as fd:
        if layout.state.exists():
            state = State.load(layout)
            started = time.monotonic()
            left = teardown(layout, state)
            say(f"done in {time.monotonic() - started:.1f} s")
            if left:
                say("left behind:\n  " + "\n  ".join(left))
        else:
            left = []
        if lock.owner(fd) == directory:
            lock.set_owner(fd, None)
    if left:
        return 1
    if not keep and layout.state.exists():
        shutil.rmtree(directory, ignore_errors=True)
    return 0
