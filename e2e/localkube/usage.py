"""`python -m e2e.localkube status --dir DIR`: what the cluster costs, per process: CPU over a sample
(percent of one core) and resident memory. Pods' processes (found in the cluster's cgroups) and
containerd's shims are summed in their own rows."""

from __future__ import annotations

import os
import time
from pathlib import Path

from e2e.localkube import host
from e2e.localkube.processes import processes_matching
from e2e.localkube.settings import Layout
from e2e.localkube.state import State

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def groups(layout: Layout, state: State) -> dict[str, list[int]]:
    rows = {process.name: [process.pid] for process in state.running()}
    socket = str(layout.containerd_socket)
    rows["containerd shims"] = processes_matching(
        lambda argv: bool(argv) and "containerd-shim" in argv[0] and socket in argv
    )
    settings = state.settings
    rows["pods (cgroups)"] = sorted(host.cgroup_pids(settings)) if settings else []
    return rows


def status(directory: Path, *, sample: float) -> int:
    layout = Layout(directory)
    state = State.load(layout)
    if not state.running():
        print(f"no localkube cluster runs in {directory}")
        return 1
    rows = groups(layout, state)
    before = {name: sum(cpu_ticks(pid) for pid in pids) for name, pids in rows.items()}
    time.sleep(sample)
    total_cpu, total_rss = 0.0, 0
    print(f"{'component':<26}{'pids':>6}{'CPU %':>9}{'RSS MiB':>10}")
    for name, pids in rows.items():
        cpu = (sum(cpu_ticks(pid) for pid in pids) - before[name]) / TICKS / sample * 100
        rss = sum(rss_kib(pid) for pid in pids)
        total_cpu, total_rss = total_cpu + cpu, total_rss + rss
        print(f"{name:<26}{len(pids):>6}{cpu:>9.1f}{rss / 1024:>10.0f}")
    print(
        f"{'total':<26}{'':>6}{total_cpu:>9.1f}{total_rss / 1024:>10.0f}   (CPU over {sample:.0f} s, % of one core)"
    )
    return 0
