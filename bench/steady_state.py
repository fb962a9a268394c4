"""The operator's steady state with real members on localkube: N settled 3-member clusters, and what
polling them costs the operator, the agents and PostgreSQL.

    PGHERD_E2E_LOCALKUBE_DIR=/tmp/lk .venv/bin/python bench/steady_state.py --clusters 10 --seconds 60

The clusters (the e2e manifests: quorum mode, `detectionSeconds: 3`, 1 Gi volumes), each in its own
namespace, are created together and waited healthy; then, over --seconds with nothing else asked of
them:

- the /status polls the operator made (the delta of its metric
  `pgherd_agent_call_duration_seconds_count{call="status"}`, read in its pod);
- the CPU seconds of the operator's pod and of every member's pod (their cgroups' cpuacct.usage, which
  counts processes that exited too: short-lived backends included), and of each member's agent process
  alone (/proc), the rest of the member's pod being PostgreSQL.

It prints the operator's CPU per poll and per member, the agents' and PostgreSQL's per poll (their own
background work included: the WAL receiver watch, checkpoints, replication), and the polls per member
per second. It needs a localkube brought up with the operator (python -m e2e.localkube up --dir DIR) and
nothing else running on it. Run by hand: it asserts nothing; the clusters are deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `e2e` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from e2e import manifests
from e2e.driver import healthy
from e2e.drivers.localkube import LocalKubeDriver

CGROUP_ROOT = Path("/sys/fs/cgroup/cpuacct")
TICKS = os.sysconf("SC_CLK_TCK")
OPERATOR_NAMESPACE = "pgherd-system"
METRICS = (
    "import urllib.request\n"
    "text = urllib.request.urlopen('http://127.0.0.1:9187/metrics', timeout=5).read().decode()\n"
    "print(sum(float(l.rsplit(' ', 1)[1]) for l in text.splitlines()\n"
    "          if l.startswith('pgherd_agent_call_duration_seconds_count{') and 'call=\"status\"' in l))\n"
)


def pod_cgroups() -> dict[str, Path]:
    """Pod UID -> its cpuacct cgroup (kubepods/<qos>/pod<uid>, under localkube's own parent)."""
    found: dict[str, Path] = {}
    for path in CGROUP_ROOT.glob("*/kubepods/*/pod*"):
        found[path.name.removeprefix("pod").replace("_", "-")] = path
    for path in CGROUP_ROOT.glob("*/kubepods/pod*"):  # Guaranteed pods sit directly under kubepods
        found[path.name.removeprefix("pod").replace("_", "-")] = path
    return found


def cgroup_seconds(path: Path) -> float:
    return int((path / "cpuacct.usage").read_text()) / 1e9


def cgroup_rss_mb(cpuacct: Path) -> float:
    """The resident anonymous memory of the pod whose cpuacct cgroup this is (its memory cgroup's
    total_rss: the processes' heaps, not the page cache)."""
    memory = Path("/sys/fs/cgroup/memory") / cpuacct.relative_to(CGROUP_ROOT)
    stats = dict(line.split() for line in (memory / "memory.stat").read_text().splitlines())
    return int(stats["total_rss"]) / 2**20


def process_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def agent_pids(cgroup: Path) -> list[int]:
    """The member's agent: the pod's `pgherd instance run` process (threads counted in its /proc)."""
    pids = []
    for task in cgroup.rglob("cgroup.procs"):
        for line in task.read_text().split():
            try:
                cmdline = Path(f"/proc/{line}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"instance" in cmdline and b"run" in cmdline and any(b"pgherd" in a for a in cmdline[:2]):
                pids.append(int(line))
    return sorted(set(pids))


class Sample:
    def __init__(self, driver: LocalKubeDriver, members: dict[str, Path], operator: Path) -> None:
        self.polls = polls(driver)
        self.at = time.monotonic()
        self.operator = cgroup_seconds(operator)
        self.members = {uid: cgroup_seconds(path) for uid, path in members.items()}
        self.agents = {
            uid: sum(process_seconds(p) for p in agent_pids(path)) for uid, path in members.items()
        }


def polls(driver: LocalKubeDriver) -> float:
    pod = driver.kube.run("-n", OPERATOR_NAMESPACE, "get", "pods", "-o", "jsonpath={.items[0].metadata.name}")
    out = driver.kube.run(
        "-n", OPERATOR_NAMESPACE, "exec", pod.stdout.strip(), "--", "python3", "-c", METRICS
    )
    return float(out.stdout.strip())


def pods(driver: LocalKubeDriver, namespace: str | None = None) -> list[dict[str, Any]]:
    where = ["-n", namespace] if namespace else ["-A"]
    return list(driver.kube.json(*where, "get", "pods")["items"])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clusters", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument(
        "--settle",
        type=float,
        default=10,
        help="seconds to wait once healthy before measuring (creating 10 clusters leaves work behind)",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pgherd-steady-"))
    drivers = [LocalKubeDriver(work / f"s{i}", f"steady{i}") for i in range(args.clusters)]
    try:
        started = time.monotonic()
        for i, driver in enumerate(drivers):
            driver.apply(
                manifests.cluster(
                    f"steady{i}", postgres_version=driver.postgres_version, instances=3, mode="quorum"
                )
            )
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda d: d.wait_for(healthy(3), 900, "a healthy cluster"), drivers))
        print(f"{args.clusters} clusters healthy after {time.monotonic() - started:.0f} s", flush=True)
        time.sleep(args.settle)  # settled: every loop at its steady pace
        groups = pod_cgroups()
        members = {
            p["metadata"]["uid"]: groups[p["metadata"]["uid"]]
            for d in drivers
            for p in pods(d, d.namespace)
            if p["metadata"]["uid"] in groups
        }
        operator_uid = pods(drivers[0], OPERATOR_NAMESPACE)[0]["metadata"]["uid"]
        before = Sample(drivers[0], members, groups[operator_uid])
        load_before = os.getloadavg()[0]
        time.sleep(args.seconds)
        after = Sample(drivers[0], members, groups[operator_uid])
        load_after = os.getloadavg()[0]
        operator_rss = cgroup_rss_mb(groups[operator_uid])
    finally:
        for driver in drivers:
            driver.down()
    seconds = after.at - before.at
    n_polls = after.polls - before.polls
    operator = after.operator - before.operator
    pods_cpu = sum(after.members[u] - before.members[u] for u in members)
    agents = sum(after.agents[u] - before.agents[u] for u in members)
    postgres = pods_cpu - agents
    n = len(members)
    print(f"members {n}, over {seconds:.0f} s, load {load_before:.1f} -> {load_after:.1f}")
    print(f"status polls {n_polls:.0f} ({n_polls / seconds / n:.2f} per member per s)")
    print(f"operator RSS {operator_rss:.0f} MB (its pod's memory cgroup, at the end)")
    rows = [("operator", operator), ("agents", agents), ("PostgreSQL", postgres)]
    print(f"{'':<12}{'CPU s':>8}{'per poll ms':>13}{'per member, % of a core':>26}")
    for name, cpu in rows:
        print(f"{name:<12}{cpu:>8.2f}{1000 * cpu / max(n_polls, 1):>13.2f}{100 * cpu / seconds / n:>26.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
