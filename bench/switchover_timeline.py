"""The timeline of one switchover on localkube, under a write loop through the `-rw` Service's ClusterIP:
the request, the operator's steps (its log), the role labels and the `-rw` EndpointSlice as watches
deliver them, kube-proxy's rule syncs (its metric kubeproxy_sync_proxy_rules_last_timestamp_seconds)
and the writes (the last acknowledged before, each window of failed writes).

    PGHERD_E2E_LOCALKUBE_DIR=/tmp/lk .venv/bin/python bench/switchover_timeline.py [--switchovers 3] [--delete]

With --delete, each switchover is caused by a graceful deletion of the primary's pod instead of the
annotation; with --backoff, by a SIGKILL of the primary's container, killed again whenever the kubelet
restarts it until another member is primary (a failover, as bench/failover_bench.py's `backoff`).

It needs a localkube brought up with the operator (python -m e2e.localkube up --dir DIR). Every time is
this machine's clock, relative to the request. Run by hand: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `e2e` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from e2e import manifests
from e2e.driver import healthy
from e2e.drivers.localkube import LocalKubeDriver
from e2e.workload import WriteLoad

from pgherd.kube.names import DATA_MOUNT, LABEL_CLUSTER, LABEL_SERVICE_NAME

JSON = dict[str, Any]
NAME = "timeline"
OPERATOR_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ (\S+): (.*)$")


@dataclass
class Timeline:
    events: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, at: float, what: str) -> None:
        with self.lock:
            self.events.append((at, what))


def _watch(
    process: subprocess.Popen[str], timeline: Timeline, describe: Callable[[JSON], tuple[str, str]]
) -> None:
    """A `kubectl get ... -w -o json` process's objects as they arrive, each described when its
    description changes; until the process is killed."""
    decoder = json.JSONDecoder()
    buffer = ""
    seen: dict[str, str] = {}
    assert process.stdout is not None
    for chunk in process.stdout:
        buffer += chunk
        while buffer.strip():
            try:
                obj, end = decoder.raw_decode(buffer.lstrip())
            except json.JSONDecodeError:
                break
            buffer = buffer.lstrip()[end:]
            key, text = describe(obj)
            if seen.get(key) != text:
                seen[key] = text
                timeline.add(time.time(), text)


def _slice(obj: JSON) -> tuple[str, str]:
    ready = sorted(
        str((e.get("targetRef") or {}).get("name"))
        for e in obj.get("endpoints") or []
        if (e.get("conditions") or {}).get("ready") is not False
    )
    return "slice", f"-rw EndpointSlice routes to {', '.join(ready) or 'nothing'}"


def _pod(obj: JSON) -> tuple[str, str]:
    name = obj["metadata"]["name"]
    role = (obj["metadata"].get("labels") or {}).get("pgherd.io/role") or "none"
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (obj.get("status") or {}).get("conditions") or []
    )
    return name, f"pod {name}: role label {role}, {'Ready' if ready else 'not Ready'}"


def _proxy_syncs(port: int, timeline: Timeline, stop: threading.Event) -> None:
    last = None
    while not stop.is_set():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as answer:
                text = answer.read().decode()
            for line in text.splitlines():
                if line.startswith('kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv4"}'):
                    value = float(line.split()[-1])
                    if value != last:
                        if last is not None:
                            timeline.add(value, "kube-proxy synced its rules")
                        last = value
        except OSError:
            pass
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--switchovers", type=int, default=3)
    parser.add_argument(
        "--logs", type=Path, help="keep each member's PostgreSQL and agent logs in this folder"
    )
    parser.add_argument(
        "--delete", action="store_true", help="delete the primary's pod instead of asking for a switchover"
    )
    parser.add_argument(
        "--backoff", action="store_true", help="kill the primary's container and keep it down instead"
    )
    parser.add_argument(
        "--parameter",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a PostgreSQL parameter of the cluster (spec.parameters), such as log_min_duration_statement=0",
    )
    args = parser.parse_args()
    parameters = dict(item.split("=", 1) for item in args.parameter)
    lk_dir = Path(os.environ["PGHERD_E2E_LOCALKUBE_DIR"])
    ports = json.loads((lk_dir / "state.json").read_text())["settings"]["ports"]
    driver = LocalKubeDriver(Path(tempfile.mkdtemp(prefix="pgherd-timeline-")), NAME)
    driver.apply(
        manifests.cluster(
            NAME,
            postgres_version=driver.postgres_version,
            instances=3,
            mode="quorum",
            parameters=parameters or None,
        )
    )
    try:
        driver.wait_for(healthy(3), 300, "a healthy cluster")
        # The Service's ClusterIP, read once (as an application resolves its name once), not a kubectl
        # call at each reconnect.
        load = WriteLoad(driver.rw_dsn(), pause=0.002).start()
        load.wait_for_acks(200)
        for run in range(1, args.switchovers + 1):
            driver.wait_for(healthy(3), 120, "a healthy cluster")
            time.sleep(2)
            _one(
                driver,
                load,
                ports["proxy_metrics"],
                run,
                how="delete" if args.delete else "backoff" if args.backoff else "switchover",
            )
        load.stop()
        if args.logs is not None:
            _keep_logs(driver, args.logs)
    finally:
        driver.down()


def _keep_logs(driver: LocalKubeDriver, folder: Path) -> None:
    """Each member's PostgreSQL log (on its volume) and its agent's log, before the cluster goes."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(3):
        pod = f"{NAME}-{i}"
        exec_ = ["-n", driver.namespace, "exec", pod, "--", "sh", "-c", f"cat {DATA_MOUNT}/*.log"]
        for name, argv in (
            (f"{pod}-postgres.log", exec_),
            (f"{pod}-agent.log", ["-n", driver.namespace, "logs", pod]),
        ):
            result = subprocess.run(
                [*driver.kube.kubectl, *argv], capture_output=True, text=True, check=False
            )
            (folder / name).write_text(result.stdout + result.stderr)
    print(f"logs kept in {folder}")


def _one(driver: LocalKubeDriver, load: WriteLoad, proxy_port: int, run: int, *, how: str) -> None:
    timeline = Timeline()
    stop = threading.Event()
    kubectl = [*driver.kube.kubectl, "-n", driver.namespace, "get", "-w", "-o", "json"]

    def watch(*what: str) -> subprocess.Popen[str]:
        return subprocess.Popen([*kubectl, *what], stdout=subprocess.PIPE, text=True)

    watches = [
        (watch("endpointslices", "-l", f"{LABEL_SERVICE_NAME}={NAME}-rw"), _slice),
        (watch("pods", "-l", f"{LABEL_CLUSTER}={NAME}"), _pod),
    ]
    threads = [
        threading.Thread(target=_watch, args=(process, timeline, describe)) for process, describe in watches
    ]
    threads.append(threading.Thread(target=_proxy_syncs, args=(proxy_port, timeline, stop)))
    for thread in threads:
        thread.daemon = True
        thread.start()
    time.sleep(2)  # the watches' initial lists
    with timeline.lock:
        timeline.events.clear()
    old = driver.status().get("primary")
    requested = time.time()
    mono_requested = time.monotonic()
    if how == "delete":
        timeline.add(requested, f"the primary's pod {old} deleted (graceful)")
        driver.kube.run("-n", driver.namespace, "delete", "pod", str(old), "--wait=false")
    elif how == "backoff":
        timeline.add(requested, f"the primary's container {old} killed (and again at each restart)")
        driver.kill_if_running(str(old))
    else:
        timeline.add(requested, f"switchover requested (annotation), primary {old}")
        driver.switchover()
    deadline = time.monotonic() + 60
    while driver.status().get("primary") in (None, old) and time.monotonic() < deadline:
        if how == "backoff" and driver.kill_if_running(str(old)):
            timeline.add(time.time(), f"{old}'s container killed again")
        time.sleep(0.1)
    load.wait_for_acks(100)
    time.sleep(1)
    stop.set()
    for process, _ in watches:
        process.kill()
    offset = requested - mono_requested  # monotonic -> wall clock
    report = load.snapshot()
    before = report.last_ack_before(mono_requested)
    if before is not None:
        timeline.add(before.ended + offset, "last write acknowledged before the request")
    for window in report.failure_windows():
        if window.end >= mono_requested:
            timeline.add(
                window.start + offset, f"writes fail ({window.failures}x: {window.first_error[:90]})"
            )
            timeline.add(window.end + offset, "writes acknowledged again")
    # The outage's end in detail: the last failed writes and the first acknowledged, each from its start.
    attempts = [a for a in report.attempts if a.started >= mono_requested]
    for i, attempt in enumerate(attempts):
        if attempt.ok and i > 0 and not attempts[i - 1].ok:
            for failed in attempts[max(0, i - 3) : i]:
                timeline.add(
                    failed.started + offset,
                    f"a write begun, failed after {failed.ended - failed.started:.3f} s: {(failed.error or '')[:70]}",
                )
            timeline.add(
                attempt.started + offset,
                f"a write begun, acknowledged after {attempt.ended - attempt.started:.3f} s",
            )
    gap = report.max_gap(since=mono_requested, until=time.monotonic())
    logs = driver.kube.run(
        "-n", "pgherd-system", "logs", "deployment/pgherd", "--since=2m", check=False
    ).stdout.splitlines()
    for line in logs:
        match = OPERATOR_LINE.match(line)
        if not match or NAME not in line:
            continue
        at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if at >= requested - 0.5:
            timeline.add(at, f"operator: {match.group(3).split(': ', 1)[-1][:110]}")
    print(f"\nswitchover {run} from {old}: longest write gap {gap:.2f} s")
    for at, what in sorted(timeline.events):
        if at >= requested - 0.5:
            print(f"  {at - requested:+7.3f} s  {what}")


if __name__ == "__main__":
    main()
