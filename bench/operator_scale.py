"""Operator scale against the real API server: N PostgresClusters without pods.

    nice -n 10 .venv/bin/python bench/operator_scale.py --clusters 500 2000

For each N: a fresh control plane without a node (the real etcd and kube-apiserver on 127.0.0.1,
e2e/localkube/apiserver_only.py, the same as tests/kube's; etcd without fsync, so that the figures are
about the operator and the API server rather than this machine's disk), the chart's RBAC rendered by
helm (watchNamespaces={bench}), and `pgherd operator --leader-elect --namespace bench` as a subprocess,
as the chart's Deployment runs it (with its process settings, e.g. MALLOC_ARENA_MAX), with a token
of the chart's ServiceAccount. Then N clusters are created (8 connections) and measured:

- ready: the time until every cluster's objects exist (its StatefulSet, the last one created) and its
  status is written;
- the p50/p99 from a spec change (instances 3 -> 4, all clusters at once, 8 connections) to
  status.observedGeneration catching up, each seen by a watch of the clusters (no polling list);
- where that time went, from the API server's audit log: the operator's status write after each PATCH
  was answered ("to op": the watch's delivery of the change to the operator, then its tick), and the
  bench's watch seeing it after that write completed ("to bench": the same delivery to a second
  watcher). At 2,000 clusters on 2 cores the deliveries, not the operator, made most of it
  (docs/kube.md, "Where the latency goes");
- watches closed (ref): how many watches the API server closed because their reader fell behind
  (apiserver_terminated_watchers_total) during pgherd's change, and during the reference's. The bench's
  own watches run in processes of their own, so that this process's threads do not slow them;
- the operator's peak RSS (VmHWM) and CPU seconds, beside the CPU seconds of kube-apiserver, etcd and
  this process (its watches and requests) over the whole run, all read from /proc;
- the operator's and the API server's CPU per change (ms/change): what each used from the first PATCH
  until every status caught up, divided by the changes. The two share this machine's cores: when the
  operator's cost per change exceeds what its share of them affords at the bench's pace, it falls behind
  (docs/kube.md, "The operator's share of the CPU");
- again: `--pause` seconds later, every cluster is changed once more (instances 4 -> 5), its p50/p99.
  The first change comes within a minute of the clusters' creation, and its status writes are seen
  later than those of the same change made later, the PATCHes answered as fast (the reference's first
  change too, in the one run where it made it: docs/kube.md, "The first change after creating the
  clusters");
- the reference, in the same run: pgherd's operator is stopped and bench/minimal_status_writer.py (a
  watch and a merge patch of status.observedGeneration per new generation, nothing else) takes its
  place; `--pause` seconds after its start, every cluster is changed again (instances 5 -> 6), as
  pgherd's "again" change followed its first. Its p99 and the API server's ms/change, and pgherd's
  "again" p99 over it (the same place in the run): what the API server and this machine allow any
  operator with pgherd's CRD, beside what pgherd gets (docs/kube.md, "A floor for the p99").

Targets at 500 clusters (issue #12): p99 under 2 s, RSS under 300 MB.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from e2e.localkube import apiserver_only, health  # noqa: E402
from e2e.localkube.binaries import tool  # noqa: E402
from e2e.localkube.kubectl import Kubectl  # noqa: E402
from e2e.localkube.settings import Layout  # noqa: E402

from pgherd.engine.view import parse_time  # noqa: E402

NS = "bench"
RELEASE = "pgherd"
CLUSTERS = f"/apis/pgherd.io/v1alpha1/namespaces/{NS}/postgresclusters"
STATEFULSETS = f"/apis/apps/v1/namespaces/{NS}/statefulsets"
CONNECTIONS = 8
TICKS = os.sysconf("SC_CLK_TCK")


def manifest(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "pgherd.io/v1alpha1",
        "kind": "PostgresCluster",
        "metadata": {"name": f"c{i:04d}", "namespace": NS},
        "spec": {"instances": 3, "postgresVersion": 16, "storage": {"size": "1Gi"}},
    }


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def audit_writes(
    audit_log: Path,
) -> tuple[dict[str, tuple[float, float]], dict[str, list[tuple[float, float]]]]:
    """From the audit log: each cluster's last PATCH by the administrator (the spec change) and every
    status write (by the operator), as (received, completed) wall-clock seconds."""
    changes: dict[str, tuple[float, float]] = {}
    statuses: dict[str, list[tuple[float, float]]] = {}
    with audit_log.open() as lines:
        for line in lines:
            if '"patch"' not in line or "postgresclusters" not in line or '"ResponseComplete"' not in line:
                continue
            entry = json.loads(line)
            ref = entry.get("objectRef") or {}
            received, completed = (
                parse_time(entry["requestReceivedTimestamp"]),
                parse_time(entry["stageTimestamp"]),
            )
            if entry.get("verb") != "patch" or received is None or completed is None:
                continue
            times = (received.timestamp(), completed.timestamp())
            if ref.get("subresource") == "status":
                statuses.setdefault(str(ref.get("name")), []).append(times)
            elif not ref.get("subresource") and "system:serviceaccount:" not in str(
                (entry.get("user") or {}).get("username")
            ):
                changes[str(ref.get("name"))] = times
    return changes, statuses


def where_it_went(audit_log: Path, seen_at: dict[str, float]) -> tuple[list[float], list[float]]:
    """Per cluster: the operator's first status write after its spec change was answered (seconds after
    the answer), and the bench's watch seeing the new generation after that write completed. ``seen_at``:
    each cluster's new generation as the bench's watch saw it, wall clock."""
    changes, statuses = audit_writes(audit_log)
    to_operator, to_bench = [], []
    for name, (received, completed) in changes.items():
        writes = [w for w in statuses.get(name, []) if w[0] >= received]
        if not writes:
            continue
        first = min(writes)
        to_operator.append(max(0.0, first[0] - completed))
        if name in seen_at:
            to_bench.append(max(0.0, seen_at[name] - first[1]))
    return to_operator, to_bench


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Api:
    """The administrator's requests over one kept-alive connection per thread."""

    def __init__(self, plane: apiserver_only.ControlPlane) -> None:
        self.host, self.port = "127.0.0.1", plane.settings.ports.apiserver
        self.tls = plane.tls()
        self.local = threading.local()

    def connection(self) -> http.client.HTTPSConnection:
        conn: http.client.HTTPSConnection | None = getattr(self.local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection(self.host, self.port, context=self.tls, timeout=60)
            self.local.conn = conn
        return conn

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        conn = self.connection()
        headers = {"Accept": "application/json", "Content-Type": content_type}
        conn.request(method, path, None if body is None else json.dumps(body), headers)
        response = conn.getresponse()
        data = response.read()
        if response.status >= 300:
            raise RuntimeError(f"{method} {path}: {response.status} {data[:300]!r}")
        return json.loads(data)

    def text(self, path: str) -> str:
        """A GET of text (the API server's metrics) over a connection of its own: this thread's kept one
        may have been closed by the server while idle."""
        conn = http.client.HTTPSConnection(self.host, self.port, context=self.tls, timeout=60)
        try:
            conn.request("GET", path, headers={"Accept": "text/plain"})
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        if response.status >= 300:
            raise RuntimeError(f"GET {path}: {response.status} {data[:300]!r}")
        return data.decode()

    def in_parallel(self, calls: Iterable[Callable[[], Any]]) -> list[Any]:
        with ThreadPoolExecutor(CONNECTIONS) as pool:
            return list(pool.map(lambda call: call(), calls))


class Watch:
    """A watch of one collection from a resourceVersion, read in a process of its own (`_watch`), which
    notes when it saw each event; `seen(name, phase, observedGeneration, when)` is then called here.

    Its own process: read by a thread of this one, the watch shared the GIL with the 8 threads sending
    PATCHes, fell behind the API server, which held up its dispatch to every watcher of the collection
    (the operator's included) for up to its time budget, then closed this watch as unresponsive
    (apiserver_terminated_watchers_total; docs/kube.md, "The watches the API server closes"). Reopened
    every minute, as the operator's are: a watch's buffer is sized at its opening (docs/kube.md, "A
    watch's buffer is sized when it opens")."""

    def __init__(
        self,
        api: Api,
        plane: apiserver_only.ControlPlane,
        path: str,
        seen: Callable[[str, str | None, int | None, float], None],
    ) -> None:
        version = str(api.request("GET", f"{path}?limit=1")["metadata"]["resourceVersion"])
        spawn = multiprocessing.get_context("spawn")  # not fork: this process has threads
        receiving, sending = spawn.Pipe(duplex=False)
        self.process = spawn.Process(
            target=_watch, args=(plane.layout, api.host, api.port, path, version, sending), daemon=True
        )
        self.receiving, self.seen = receiving, seen
        self.thread = threading.Thread(target=self._receive, daemon=True)

    def start(self) -> None:
        self.process.start()
        self.thread.start()

    def _receive(self) -> None:
        try:
            while True:
                self.seen(*self.receiving.recv())
        except (EOFError, OSError):
            return

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.process.pid) if self.process.pid is not None else 0.0

    def stop(self) -> None:
        self.process.terminate()
        self.process.join(5)


def _watch(layout: Layout, host: str, port: int, path: str, version: str, out: Connection) -> None:
    """The watch's process: each ADDED or MODIFIED object's name, status.phase and
    status.observedGeneration, with the monotonic clock (the machine's, the same in every process)
    read when its line arrived."""
    tls = health.admin_tls(layout)
    while True:
        conn = http.client.HTTPSConnection(host, port, context=tls, timeout=600)
        conn.request(
            "GET", f"{path}?watch=1&resourceVersion={version}&allowWatchBookmarks=true&timeoutSeconds=60"
        )
        response = conn.getresponse()
        while line := response.readline():
            at = time.monotonic()
            event = json.loads(line)
            obj = event["object"]
            if event["type"] == "ERROR":
                raise RuntimeError(f"watch {path}: {obj}")
            version = obj["metadata"]["resourceVersion"]
            if event["type"] in ("ADDED", "MODIFIED"):
                status = obj.get("status") or {}
                generation = status.get("observedGeneration")
                name, phase = obj["metadata"]["name"], status.get("phase")
                out.send((name, phase, None if generation is None else int(generation), at))
        conn.close()


def terminated_watchers(api: Api) -> int:
    """The API server's count of watches it closed because their reader fell behind, every resource."""
    text = api.text("/metrics")
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("apiserver_terminated_watchers_total{")
    )


def install_operator(plane: apiserver_only.ControlPlane, workdir: Path) -> tuple[Path, dict[str, str]]:
    """The chart's ServiceAccount, ClusterRole, Role and bindings for an operator watching NS, a
    kubeconfig with a token of that ServiceAccount, and the process settings the chart's Deployment
    gives the operator (its literal environment but pgherd's own PGHERD_* configuration: e.g. glibc's
    MALLOC_ARENA_MAX)."""
    kubectl = Kubectl(plane.layout)
    kubectl.run("create", "namespace", NS)
    rendered = subprocess.run(
        [tool("helm"), "template", RELEASE, str(REPO / "charts" / "pgherd"), "--namespace", NS,
         "--set", f"watchNamespaces={{{NS}}}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rbac = [
        doc
        for doc in yaml.safe_load_all(rendered)
        if doc
        and doc["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
    ]
    kubectl.apply(rbac)
    (deployment,) = [doc for doc in yaml.safe_load_all(rendered) if doc and doc["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    process_env = {
        entry["name"]: str(entry["value"])
        for entry in container.get("env") or []
        if "value" in entry and not entry["name"].startswith("PGHERD_")
    }
    (account,) = [doc["metadata"]["name"] for doc in rbac if doc["kind"] == "ServiceAccount"]
    token = kubectl.run("create", "token", account, "--namespace", NS, "--duration", "24h").strip()
    kubeconfig = workdir / "operator.kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "bench",
                        "cluster": {"server": plane.api_url, "certificate-authority": str(plane.ca_file)},
                    }
                ],
                "users": [{"name": account, "user": {"token": token}}],
                "contexts": [
                    {"name": "bench", "context": {"cluster": "bench", "user": account, "namespace": NS}}
                ],
                "current-context": "bench",
            }
        )
    )
    kubeconfig.chmod(0o600)
    return kubeconfig, process_env


def run(n: int, timeout: float, settle: float = 3.0, pause: float = 30.0) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="pgherd-scale-"))
    plane = apiserver_only.start(workdir / "control-plane")
    operator: subprocess.Popen[bytes] | None = None
    reference: subprocess.Popen[str] | None = None
    log = (workdir / "operator.log").open("w")
    watches: list[Watch] = []
    try:
        components = {name: plane.process(name).pid for name in ("kube-apiserver", "etcd")}
        cpu_before = {name: cpu_seconds(pid) for name, pid in components.items()}
        bench_before = time.process_time()
        kubeconfig, process_env = install_operator(plane, workdir)
        env = {
            **os.environ,
            **process_env,
            "KUBECONFIG": str(kubeconfig),
            "POD_NAMESPACE": NS,
            "POD_NAME": "pgherd-bench",
            "PGHERD_LEADER_ELECTION_LEASE": f"{RELEASE}-leader",
        }
        operator = subprocess.Popen(
            [str(REPO / ".venv" / "bin" / "pgherd"), "operator", "--leader-elect", "--namespace", NS,
             "--log-level", "warning"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        api = Api(plane)
        phases: dict[str, Any] = {}
        sets: set[str] = set()
        first_seen: dict[tuple[str, int], float] = {}  # (cluster, observedGeneration) -> when the watch said

        def cluster_seen(name: str, phase: str | None, generation: int | None, at: float) -> None:
            phases[name] = phase
            if generation is not None:
                first_seen.setdefault((name, generation), at)

        def ready_count() -> int:
            return sum(1 for name, phase in dict(phases).items() if phase and name in sets)

        watches = [
            Watch(api, plane, CLUSTERS, cluster_seen),
            Watch(api, plane, STATEFULSETS, lambda name, *_: sets.add(name)),
        ]
        for watch in watches:
            watch.start()

        started = time.monotonic()
        api.in_parallel(partial(api.request, "POST", CLUSTERS, manifest(i)) for i in range(n))
        created = time.monotonic()
        while ready_count() < n:
            if time.monotonic() - started > timeout:
                raise SystemExit(
                    f"only {ready_count()} of {n} clusters ready after {timeout:.0f} s; see {log.name}"
                )
            if operator.poll() is not None:
                raise SystemExit(f"the operator exited ({operator.returncode}); see {log.name}")
            time.sleep(0.1)
        ready = time.monotonic() - started
        # Every loop in its steady state; a longer wait lets the operator freeze its heap first (30 s with
        # no cluster added or starting: operator/pgherd/kube/heap.py), as an operator running for a while has.
        time.sleep(settle)

        def change_all(instances: int, writer: int) -> tuple[list[float], dict[str, float], dict[str, float]]:
            """Every cluster's spec.instances set (8 PATCHes in flight); the seconds from each PATCH's
            answer until the watch saw that generation observed, the CPU ms per change of the status
            writer (pid `writer`) and the control plane until the last caught up, and when the watch saw
            each cluster's new generation (wall clock)."""
            changed: dict[str, tuple[int, float]] = {}  # cluster -> (its new generation, PATCH answered)

            def change(name: str) -> None:
                doc = api.request(
                    "PATCH", f"{CLUSTERS}/{name}", {"spec": {"instances": instances}},
                    "application/merge-patch+json",
                )  # fmt: skip
                changed[name] = (int(doc["metadata"]["generation"]), time.monotonic())

            def caught_up() -> list[float]:
                return [
                    max(0.0, first_seen[(name, generation)] - at)  # seen before the PATCH returned: 0
                    for name, (generation, at) in list(changed.items())
                    if (name, generation) in first_seen
                ]

            pids = {"operator": writer, **components}
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            api.in_parallel(partial(change, f"c{i:04d}") for i in range(n))
            deadline = time.monotonic() + timeout
            while len(caught_up()) < n and time.monotonic() < deadline:
                time.sleep(0.05)
            latency = caught_up()
            # CPU from the first PATCH until every cluster's status caught up, per change (the settled
            # clusters' ticks of that time included).
            per_change = {
                name: (cpu_seconds(pid) - before[name]) * 1000 / max(len(latency), 1)
                for name, pid in pids.items()
            }
            wall = time.time() - time.monotonic()
            seen_at = {
                name: first_seen[(name, generation)] + wall
                for name, (generation, _) in changed.items()
                if (name, generation) in first_seen
            }
            return latency, per_change, seen_at

        terminated_before = terminated_watchers(api)
        latency, per_change, seen_at = change_all(4, operator.pid)
        terminated = terminated_watchers(api) - terminated_before
        to_operator, to_bench = where_it_went(plane.audit_log, seen_at)
        result: dict[str, Any] = {
            "clusters": n,
            "create_s": created - started,
            "ready_s": ready,
            "caught_up": len(latency),
            "p50_s": percentile(latency, 0.5) if latency else float("nan"),
            "p99_s": percentile(latency, 0.99) if latency else float("nan"),
            "to_op_s": _p50_p99(to_operator),
            "to_bench_s": _p50_p99(to_bench),
            "op_ms_per_change": per_change["operator"],
            "apiserver_ms_per_change": per_change["kube-apiserver"],
            "operator_rss_mb": peak_rss_mb(operator.pid),
            "operator_cpu_s": cpu_seconds(operator.pid),
            "apiserver_cpu_s": cpu_seconds(components["kube-apiserver"]) - cpu_before["kube-apiserver"],
            "apiserver_rss_mb": peak_rss_mb(components["kube-apiserver"]),
            "etcd_cpu_s": cpu_seconds(components["etcd"]) - cpu_before["etcd"],
            "bench_cpu_s": time.process_time() - bench_before + sum(w.cpu_seconds() for w in watches),
            "wall_s": time.monotonic() - started,
            "workdir": str(workdir),
        }
        time.sleep(pause)
        again, _, _ = change_all(5, operator.pid)
        # The peak RSS and the CPU of pgherd's whole run, the second change included.
        result.update(
            again_s=_p50_p99(again) if len(again) == n else "-",
            operator_rss_mb=peak_rss_mb(operator.pid),
            operator_cpu_s=cpu_seconds(operator.pid),
        )
        again_p99 = percentile(again, 0.99) if len(again) == n else float("nan")
        # The reference, in the same run: pgherd stopped, the least status writer in its place, every
        # cluster changed again (instances 5 -> 6) as long after its start as pgherd's "again" change.
        operator.terminate()
        operator.wait(20)
        reference = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "minimal_status_writer.py"), str(kubeconfig), NS],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )  # fmt: skip
        assert reference.stdout is not None
        if reference.stdout.readline().strip() != "watching":
            raise SystemExit(f"the reference status writer did not start; see {log.name}")
        time.sleep(pause)
        terminated_before = terminated_watchers(api)
        ref_latency, ref_per_change, _ = change_all(6, reference.pid)
        ref_terminated = terminated_watchers(api) - terminated_before
        # A p99 of the clusters that caught up alone would flatter the reference: none unless all did.
        ref_p99 = percentile(ref_latency, 0.99) if len(ref_latency) == n else float("nan")
        result.update(
            ref_p99_s=ref_p99,
            ref_apiserver_ms_per_change=ref_per_change["kube-apiserver"],
            p99_ratio=again_p99 / (ref_p99 or float("nan")),
            watches_closed=f"{terminated} ({ref_terminated})",
        )
        return result

    finally:
        for watch in watches:
            watch.stop()
        if operator is not None:
            operator.terminate()
            try:
                operator.wait(20)
            except subprocess.TimeoutExpired:
                operator.kill()
        if reference is not None:
            reference.kill()
            reference.wait()
        plane.stop()
        log.close()


def _p50_p99(values: list[float]) -> str:
    return f"{percentile(values, 0.5):.2f}/{percentile(values, 0.99):.2f}" if values else "-"


COLUMNS = (
    ("clusters", "clusters", "d"),
    ("create s", "create_s", ".1f"),
    ("ready s", "ready_s", ".1f"),
    ("p50 s", "p50_s", ".2f"),
    ("p99 s", "p99_s", ".2f"),
    ("caught up", "caught_up", "d"),
    ("to op p50/p99", "to_op_s", "s"),
    ("to bench p50/p99", "to_bench_s", "s"),
    ("again p50/p99", "again_s", "s"),
    ("op ms/change", "op_ms_per_change", ".2f"),
    ("apiserver ms/change", "apiserver_ms_per_change", ".2f"),
    ("ref p99 s", "ref_p99_s", ".2f"),
    ("ref apiserver ms/change", "ref_apiserver_ms_per_change", ".2f"),
    ("p99 / ref", "p99_ratio", ".2f"),
    ("op RSS MB", "operator_rss_mb", ".0f"),
    ("op CPU s", "operator_cpu_s", ".1f"),
    ("apiserver CPU s", "apiserver_cpu_s", ".1f"),
    ("apiserver RSS MB", "apiserver_rss_mb", ".0f"),
    ("etcd CPU s", "etcd_cpu_s", ".1f"),
    ("bench CPU s", "bench_cpu_s", ".1f"),
    ("watches closed (ref)", "watches_closed", "s"),
    ("wall s", "wall_s", ".0f"),
)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clusters", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--settle",
        type=float,
        default=3.0,
        help="seconds from every cluster ready to the spec change (default 3; 45: after the heap's freeze)",
    )
    parser.add_argument(
        "--pause",
        type=float,
        default=30.0,
        help="seconds from pgherd's first change to its next, and from the reference's start to its change",
    )
    args = parser.parse_args()
    reason = apiserver_only.unavailable()
    if reason is not None:
        print(f"cannot start a control plane: {reason}", file=sys.stderr)
        return 2
    print("  ".join(f"{title:>{max(len(title), 8)}}" for title, _, _ in COLUMNS), flush=True)
    for n in args.clusters:
        r = run(n, args.timeout, args.settle, args.pause)
        cells = []
        for title, key, fmt in COLUMNS:
            value = int(r[key]) if fmt == "d" else r[key]
            cells.append(f"{value:>{max(len(title), 8)}{fmt}}")
        print("  ".join(cells), flush=True)
        print(
            f"  ({n}: the operator's log and the API server's audit log are in {r['workdir']})",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
