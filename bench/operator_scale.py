"""Operator scale against the emulated API server: N PostgresClusters without pods.

    .venv/bin/python bench/operator_scale.py --clusters 100 500

For each N: start the emulated API server (tests/kube/emulator.py) in this process and `pgherd operator`
as a subprocess (its own RSS and CPU, read from /proc), create N clusters, and measure

- ready: the time until every cluster's objects exist (its StatefulSet, the last one created) and its
  status is written;
- the p50/p99 from a spec change (instances 3 -> 4, all clusters at once) to status.observedGeneration
  catching up;
- the operator's peak RSS (VmHWM) and CPU seconds, beside this process's CPU (the emulator and the
  polling share it).

Targets at 500 clusters (issue #12): p99 under 2 s, RSS under 300 MB.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from kube.emulator import CRDS_DIR, EmulatedApiServer  # noqa: E402

NS = "bench"
TICKS = os.sysconf("SC_CLK_TCK")


def manifest(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "pgherd.io/v1alpha1",
        "kind": "PostgresCluster",
        "metadata": {"name": f"c{i:04d}", "namespace": NS},
        "spec": {"instances": 3, "postgresVersion": 16, "storage": {"size": "1Gi"}},
    }


def proc_stats(pid: int) -> tuple[float, float]:
    """(peak RSS in MB, CPU seconds) of a process."""
    rss = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            rss = int(line.split()[1]) / 1024
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / TICKS
    return rss, cpu


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def observed_generations(server: EmulatedApiServer) -> dict[str, Any]:
    """name -> status.observedGeneration of every cluster, read in the emulator's loop without copying
    the objects (copying 500 of them every poll would slow the emulator the operator talks to)."""
    return server.call(
        lambda: {
            c["metadata"]["name"]: (c.get("status") or {}).get("observedGeneration")
            for c in server.emulator.items("postgresclusters", NS)
        }
    )


def progress(server: EmulatedApiServer) -> dict[str, tuple[Any, bool]]:
    """name -> (status.phase, whether its StatefulSet exists), read as observed_generations is."""

    def read() -> dict[str, tuple[Any, bool]]:
        sets = {s["metadata"]["name"] for s in server.emulator.items("statefulsets", NS)}
        return {
            c["metadata"]["name"]: ((c.get("status") or {}).get("phase"), c["metadata"]["name"] in sets)
            for c in server.emulator.items("postgresclusters", NS)
        }

    return server.call(read)


def run(n: int, timeout: float) -> dict[str, float]:
    # No validators (cel-python costs ~45 ms a write) and no request log: the emulator must not be the bottleneck.
    server = EmulatedApiServer(
        crds=[CRDS_DIR], namespaces=[NS], tokens={"bench": "bench"}, validators=[], record_requests=False
    )
    server.start()
    workdir = Path(tempfile.mkdtemp(prefix="pgherd-scale-"))
    kubeconfig = server.write_kubeconfig(workdir / "kubeconfig", token="bench", namespace=NS)
    log = (workdir / "operator.log").open("w")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    operator = subprocess.Popen(
        [str(REPO / ".venv" / "bin" / "pgherd"), "operator", "--namespace", NS, "--log-level", "warning"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    cpu_before = time.process_time()
    try:
        started = time.monotonic()
        for i in range(n):
            server.create(manifest(i))
        created = time.monotonic()
        while True:
            done = sum(1 for phase, has_set in progress(server).values() if phase and has_set)
            if done == n:
                break
            if time.monotonic() - started > timeout:
                raise SystemExit(f"only {done} of {n} clusters ready after {timeout:.0f} s; see {log.name}")
            time.sleep(0.2)
        ready = time.monotonic() - started
        time.sleep(3)  # settle: every loop in its steady state
        changed: dict[str, float] = {}
        generation: dict[str, int] = {}
        for i in range(n):
            name = f"c{i:04d}"
            doc = server.merge("postgresclusters", NS, name, {"spec": {"instances": 4}})
            changed[name] = time.monotonic()
            generation[name] = doc["metadata"]["generation"]
        latency: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        while len(latency) < n and time.monotonic() < deadline:
            now = time.monotonic()
            for name, observed in observed_generations(server).items():
                if name not in latency and observed == generation[name]:
                    latency[name] = now - changed[name]
            time.sleep(0.02)
        rss, cpu = proc_stats(operator.pid)
        values = list(latency.values())
        return {
            "clusters": n,
            "create_s": created - started,
            "ready_s": ready,
            "caught_up": len(values),
            "p50_s": percentile(values, 0.5) if values else float("nan"),
            "p99_s": percentile(values, 0.99) if values else float("nan"),
            "operator_rss_mb": rss,
            "operator_cpu_s": cpu,
            "bench_and_emulator_cpu_s": time.process_time() - cpu_before,
        }
    finally:
        operator.terminate()
        try:
            operator.wait(20)
        except subprocess.TimeoutExpired:
            operator.kill()
        server.stop()
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clusters", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    print(
        f"{'clusters':>8} {'create s':>9} {'ready s':>8} {'p50 s':>7} {'p99 s':>7} {'caught up':>9} "
        f"{'op RSS MB':>9} {'op CPU s':>8} {'emu+bench CPU s':>15}"
    )
    for n in args.clusters:
        r = run(n, args.timeout)
        print(
            f"{r['clusters']:>8} {r['create_s']:>9.1f} {r['ready_s']:>8.1f} {r['p50_s']:>7.2f} {r['p99_s']:>7.2f} "
            f"{r['caught_up']:>9} {r['operator_rss_mb']:>9.0f} {r['operator_cpu_s']:>8.1f} "
            f"{r['bench_and_emulator_cpu_s']:>15.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
