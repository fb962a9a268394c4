"""Failover and switchover benchmark: the pgherd sandbox against Patroni with etcd, in the same run.

    .venv/bin/python bench/failover_bench.py [--runs 5] [--systems pgherd,patroni-default,patroni-tuned]
                                             (also: pgherd-localkube, the operator on a real Kubernetes
                                              on this machine: python -m e2e.localkube, docs/e2e.md;
                                              patroni-localkube-default, patroni-localkube-tuned: Patroni's
                                              Kubernetes DCS on the same cluster, bench/_patroni_kube.py)
                                             [--mode quorum|async] [--detection-seconds 3]
                                             [--scenarios failover,crash,switchover,backoff,delete]

For each system: a 3-member cluster on this machine's PostgreSQL, one write loop (e2e/workload.py, the
loop the e2e scenarios use) through a libpq multi-host read-write DSN, then
  * failover time: kill -9 of the primary's whole member (Patroni and PostgreSQL, or the sandbox
    member) -> the longest gap between acknowledged writes through the read-write DSN from the kill
    until the cluster is healthy again (at least until the first write after the kill);
  * switchover write unavailability: the longest gap between two acknowledged writes around a
    planned switchover (patronictl switchover --force, pgherd sandbox switchover);
  * crash restart (`--postgres-only` kills): kill -9 of the primary's PostgreSQL alone, under a live
    agent / Patroni -> the longest write gap, measured as for a failover (pgherd's agent restarts it read-only at
    once and the engine promotes it in place; Patroni restarts it at its next loop);
  * on localkube only, two more kills of the primary, measured as a failover: `backoff`, its container
    killed again each time the kubelet restarts it, until another member is primary or 60 s passed
    (then it comes back after its crash back-off); `delete`, its pod deleted as a drain or a person
    does (SIGTERM, the grace period; the StatefulSet makes it again). A system skips the scenarios it
    cannot run (PostgreSQL alone on localkube; back-off and deletion in the sandbox);
  * acknowledged writes lost: acknowledged ids missing from the primary at the end.
Each kill and switchover starts from a steady cluster: every replica streaming, as PostgreSQL itself
reports (Patroni's lag reads 0 before a new replica's slot exists). The "promoted" column counts the
kills after which another member was primary: writes can also come back because the killed member was
restarted in place, which is no failover.
It prints min/median/max per system and the ratios to pgherd. Run by hand (root or any user with a
`postgres` account); it is not a test and asserts nothing about time.

A killed Patroni member is started again once the failover is over (as kubelet restarts a pod): started
at once, Patroni would find its own leader key and resume as primary, which measures a restart, not a
failover. The sandbox restarts its members itself; its engine decides their roles.

Quorum mode: pgherd's replication.mode quorum; Patroni 3.0's closest setting, synchronous_mode: true
(one synchronous standby, so that two of three members have every acknowledged commit).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import psycopg

if __package__ in (None, ""):  # run as a script: make `e2e` and `bench` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._patroni import DEFAULT, TUNED, PatroniCluster, Timing
from bench._patroni_image import ensure_image
from bench._patroni_kube import PatroniKubeCluster
from e2e import manifests
from e2e.driver import healthy
from e2e.drivers.local import LocalDriver
from e2e.drivers.localkube import LocalKubeDriver
from e2e.workload import Attempt, WriteLoad, present_ids

TABLE = "bench_writes"
FAILOVER_TIMEOUT = 120.0


SANDBOX_SCENARIOS = frozenset({"failover", "crash", "switchover"})
KUBE_SCENARIOS = frozenset({"failover", "switchover", "backoff", "delete"})


class System(Protocol):
    label: str
    scenarios: frozenset[str]  # those of SCENARIOS it can run

    def start(self) -> None: ...
    def rw_dsn(self) -> str: ...
    def primary(self) -> str | None: ...
    def kill(self, member: str) -> None: ...
    def kill_postgres(self, member: str) -> None: ...
    def kill_if_running(self, member: str) -> bool: ...
    def delete(self, member: str) -> None: ...  # a graceful deletion of its pod, returning once it is gone
    def after_failover(self, killed: str) -> None: ...
    def switchover(self) -> None: ...
    def wait_healthy(self) -> None: ...
    def stop(self) -> None: ...


class PatroniSystem:
    scenarios = SANDBOX_SCENARIOS

    def __init__(self, timing: Timing, mode: str) -> None:
        self.label = timing.label
        self.cluster = PatroniCluster(timing, synchronous=mode == "quorum")

    def start(self) -> None:
        self.cluster.start()

    def rw_dsn(self) -> str:
        return self.cluster.rw_dsn()

    def primary(self) -> str | None:
        return self.cluster.leader()

    def kill(self, member: str) -> None:
        self.cluster.kill(member)

    def kill_postgres(self, member: str) -> None:
        self.cluster.kill_postgres(member)

    def kill_if_running(self, member: str) -> bool:
        raise NotImplementedError("no container to keep in back-off in the sandbox")

    def delete(self, member: str) -> None:
        raise NotImplementedError("no pod to delete in the sandbox")

    def after_failover(self, killed: str) -> None:
        self.cluster.restart(killed)

    def switchover(self) -> None:
        self.cluster.switchover()

    def wait_healthy(self) -> None:
        self.cluster.wait_healthy()

    def stop(self) -> None:
        self.cluster.stop()


class PgherdSystem:
    """pgherd through an e2e driver: the sandbox (`local`), or the chart's operator on a real Kubernetes
    on this machine (`localkube`: a kill is SIGKILL of the member's container, a crash the kubelet answers
    by restarting it; the read-write DSN the `-rw` Service's ClusterIP through kube-proxy). The
    localkube cluster is $PGHERD_E2E_LOCALKUBE_DIR's, else one brought up for the run."""

    def __init__(self, mode: str, detection_seconds: int, driver: str = "local") -> None:
        self.label = "pgherd" if driver == "local" else f"pgherd-{driver}"
        self.scenarios = SANDBOX_SCENARIOS if driver == "local" else KUBE_SCENARIOS
        self.workdir = Path(tempfile.mkdtemp(prefix=f"pgherd-bench-{driver}-"))
        self.driver: LocalDriver | LocalKubeDriver = (
            LocalDriver(self.workdir) if driver == "local" else LocalKubeDriver(self.workdir, "bench")
        )
        self._rw_dsn: str | None = None
        self.manifest = manifests.cluster(
            "bench",
            postgres_version=self.driver.postgres_version,
            instances=3,
            mode=mode,
            detection_seconds=detection_seconds,
        )

    def start(self) -> None:
        self.driver.apply(self.manifest)
        self.wait_healthy()

    def rw_dsn(self) -> str:
        if isinstance(self.driver, LocalKubeDriver):
            # A Service's ClusterIP never changes: read once, as an application resolves its name once,
            # and not a kubectl call (0.25 s) at each reconnect of the write loop inside the outage.
            self._rw_dsn = self._rw_dsn or self.driver.rw_dsn()
            return self._rw_dsn
        return self.driver.rw_dsn()

    def primary(self) -> str | None:
        if isinstance(self.driver, LocalKubeDriver):  # one read, not the whole status (polled during kills)
            status = self.driver.get("postgresclusters.pgherd.io", self.driver.cluster).get("status") or {}
            return status.get("currentPrimary")
        return self.driver.status().get("primary")

    def kill(self, member: str) -> None:
        self.driver.kill(member)

    def kill_postgres(self, member: str) -> None:
        if not isinstance(self.driver, LocalDriver):
            raise NotImplementedError(
                f"{self.label}: no kill of PostgreSQL alone (--scenarios failover,switchover)"
            )
        self.driver.kill(member, postgres_only=True)

    def kill_if_running(self, member: str) -> bool:
        if not isinstance(self.driver, LocalKubeDriver):
            raise NotImplementedError(f"{self.label}: no container to keep in back-off")
        return self.driver.kill_if_running(member)

    def delete(self, member: str) -> None:
        if not isinstance(self.driver, LocalKubeDriver):
            raise NotImplementedError(f"{self.label}: no pod to delete")
        self.driver.kube.run("-n", self.driver.namespace, "delete", "pod", member, timeout=300)

    def after_failover(self, killed: str) -> None:
        pass  # the sandbox restarts the member by itself, like kubelet

    def switchover(self) -> None:
        self.driver.switchover()

    def wait_healthy(self) -> None:
        # As for Patroni: every replica streaming, not only reported ready.
        self.driver.wait_for(
            lambda s: (
                healthy(3)(s)
                and all(m.get("streaming", True) for m in s["members"] if m.get("role") == "replica")
            ),
            # A container the kubelet restarted after a crash before waits out its back-off (10 s, 20 s,
            # 40 s, ... up to 5 minutes) when it crashes again: on localkube the member is back later.
            180 if isinstance(self.driver, LocalDriver) else 600,
            "a healthy 3-member cluster with streaming replicas",
        )

    def stop(self) -> None:
        self.driver.down()
        shutil.rmtree(self.workdir, ignore_errors=True)


class PatroniKubeSystem:
    """Patroni with its Kubernetes DCS on the same localkube as pgherd-localkube (bench/_patroni_kube.py):
    the write loop through the leader Service's ClusterIP, a kill the SIGKILL of the member's container
    (Patroni is its init), a switchover Patroni's REST API on the leader."""

    scenarios = KUBE_SCENARIOS

    def __init__(self, timing: Timing, mode: str) -> None:
        self.label = timing.label.replace("patroni-", "patroni-localkube-")
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.label}-"))
        localkube = LocalKubeDriver.shared_cluster()
        state = localkube.state
        base = f"{state.get('image') or 'localkube.local/pgherd:e2e'}-pg{state.get('postgresMajor') or 16}"
        image = ensure_image(localkube.dir, base, lambda m: print(f"[{self.label}] {m}", flush=True))
        self.cluster = PatroniKubeCluster(
            localkube,
            f"patroni-bench-{timing.label.removeprefix('patroni-')}",
            image,
            timing,
            synchronous=mode == "quorum",
            workdir=self.workdir,
        )
        self._rw_dsn: str | None = None

    def start(self) -> None:
        self.cluster.start()

    def rw_dsn(self) -> str:
        # Read once, as pgherd-localkube's (PgherdSystem.rw_dsn): the Service's ClusterIP never changes.
        self._rw_dsn = self._rw_dsn or self.cluster.rw_dsn()
        return self._rw_dsn

    def primary(self) -> str | None:
        return self.cluster.leader()

    def kill(self, member: str) -> None:
        if not self.cluster.kill_if_running(member):
            raise RuntimeError(f"no running container of {member} in {self.cluster.namespace}")

    def kill_postgres(self, member: str) -> None:
        raise NotImplementedError(f"{self.label}: no kill of PostgreSQL alone")

    def kill_if_running(self, member: str) -> bool:
        return self.cluster.kill_if_running(member)

    def delete(self, member: str) -> None:
        self.cluster.delete_pod(member)

    def after_failover(self, killed: str) -> None:
        pass  # the kubelet restarts the container, the StatefulSet the pod

    def switchover(self) -> None:
        self.cluster.switchover()

    def wait_healthy(self) -> None:
        self.cluster.wait_healthy()

    def stop(self) -> None:
        self.cluster.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


# The scenarios, measured in this order. The kills (every one but switchover) count as promoted when
# another member is primary once writes come back, else as restarted in place.
SCENARIOS = ("failover", "crash", "switchover", "backoff", "delete")
KILLS = ("failover", "crash", "backoff", "delete")
TITLES = {
    "failover": "failover (member killed)",
    "crash": "PostgreSQL alone killed",
    "switchover": "switchover write gap",
    "backoff": "container kept in back-off",
    "delete": "pod deleted (graceful)",
}
KEEP_DOWN = 60.0  # backoff: the longest the killed container is kept down


@dataclass
class Result:
    label: str
    seconds: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SCENARIOS})
    promoted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KILLS, 0))
    acked: int = 0
    lost: int | None = None  # None: could not be read back
    errors: list[str] = field(default_factory=list)


def _wait_for_write(load: WriteLoad, moment: float, timeout: float, *, begun_after: bool) -> Attempt:
    """The first write acknowledged after `moment` (and begun after it, with begun_after)."""
    deadline = time.monotonic() + timeout
    while True:
        found = load.snapshot().first_ack_after(moment, begun=begun_after)
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"no write acknowledged within {timeout:.0f} s")
        time.sleep(0.05)


def _outage(system: System, load: WriteLoad, killed_at: float) -> float:
    """The write unavailability a kill caused: the longest gap between acknowledgements from the kill
    until the cluster is healthy again. Not the first write after the kill: a member killed with its
    container may acknowledge one more write while its processes die (seen on localkube: "0.00 s"
    for a crash whose restart in place then held writes off for 16.9 s)."""
    system.wait_healthy()
    _wait_for_write(load, time.monotonic(), 60, begun_after=True)
    return load.snapshot().max_gap(since=killed_at, until=time.monotonic())


def _wait_for_new_primary(system: System, old: str | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while system.primary() in (None, old):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the primary is still {old} {timeout:.0f} s after the switchover")
        time.sleep(0.1)


def _keep_down(system: System, old: str) -> int:
    """The killed primary's container killed again each time the kubelet restarts it, until another
    member is primary or KEEP_DOWN s passed; then left to come back. Returns the kills made here."""
    stop = threading.Event()
    kills = 0

    def kill_again() -> None:
        nonlocal kills
        while not stop.wait(0.1):
            try:
                kills += system.kill_if_running(old)
            except Exception:  # a failed crictl call is retried at the next tick
                continue

    thread = threading.Thread(target=kill_again, name="keep-down", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + KEEP_DOWN
        while system.primary() in (None, old) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
        thread.join(timeout=30)
    return kills


class _PrimaryWatch:
    """Every primary the system reports while a kill is measured, polled in a thread: a graceful
    deletion's old primary may acknowledge the first write after it before it hands over, so the
    primary at that write does not tell whether another member was promoted."""

    def __init__(self, system: System) -> None:
        self.system = system
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="primary-watch", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                primary = self.system.primary()
            except Exception:  # a failed read is retried at the next tick
                primary = None
            if primary is not None and (not self.seen or self.seen[-1] != primary):
                self.seen.append(primary)
            self._stop.wait(0.2)

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(timeout=60)
        return self.seen


def _kill_run(system: System, load: WriteLoad, scenario: str, result: Result) -> str:
    """One kill of the primary by `scenario`, measured; returns what to log."""
    system.wait_healthy()
    time.sleep(1.0)
    old = system.primary()
    if old is None:
        raise RuntimeError("no primary before the kill")
    watch = _PrimaryWatch(system)
    try:
        if scenario == "delete":
            # Timed from the request: the pod serves through its grace period, and the deletion
            # returns once it is gone, so that "healthy" below is not read before it went.
            killed_at = time.monotonic()
            system.delete(old)
        else:
            if scenario == "crash":
                system.kill_postgres(old)
            else:
                system.kill(old)
            # Timed from the moment the kill returned, counting only writes begun after it: a commit in
            # flight at the kill may still deliver its acknowledgement from the socket buffer.
            killed_at = time.monotonic()
        again = _keep_down(system, old) if scenario == "backoff" else 0
        _wait_for_write(load, killed_at, FAILOVER_TIMEOUT, begun_after=True)
        if scenario == "failover":
            system.after_failover(old)
        result.seconds[scenario].append(_outage(system, load, killed_at))
    finally:
        seen = watch.stop()
    # Writes may come back because the killed member was restarted in place (still primary), not
    # because a replica was promoted: count the real failovers.
    promoted = [p for p in seen if p != old]
    result.promoted[scenario] += bool(promoted)
    how = {
        "failover": " killed",
        "crash": "'s PostgreSQL killed",
        "backoff": f"'s container killed and kept down ({1 + again} kills)",
        "delete": "'s pod deleted",
    }[scenario]
    return (
        f"{old}{how}, writes unavailable for {result.seconds[scenario][-1]:.2f} s, primaries seen"
        f" {' -> '.join(seen) or 'none'}{'' if promoted else ' (restarted in place: no failover)'}"
    )


def measure(
    system: System,
    runs: int,
    log: Callable[[str], None],
    result: Result,
    scenarios: tuple[str, ...] = SCENARIOS,
) -> None:
    """Fill `result` as the runs go, so that a failure keeps the figures measured before it."""
    skipped = [s for s in scenarios if s not in system.scenarios]
    if skipped:
        log(f"[{system.label}] not measured here: {', '.join(skipped)}")
    wanted = [s for s in SCENARIOS if s in scenarios and s in system.scenarios]
    log(f"[{system.label}] starting a 3-member cluster")
    system.start()
    load = WriteLoad(system.rw_dsn, table=TABLE, pause=0.002).start()
    try:
        load.wait_for_acks(100)
        for scenario in wanted:
            for run in range(1, runs + 1):
                if scenario in KILLS:
                    log(
                        f"[{system.label}] {scenario} {run}/{runs}: {_kill_run(system, load, scenario, result)}"
                    )
                    continue
                system.wait_healthy()
                time.sleep(1.0)
                old = system.primary()
                requested_at = time.monotonic()
                system.switchover()
                _wait_for_new_primary(system, old, 60)
                _wait_for_write(load, time.monotonic(), 60, begun_after=False)
                time.sleep(0.5)
                gap = load.snapshot().max_gap(since=requested_at, until=time.monotonic())
                result.seconds["switchover"].append(gap)
                log(f"[{system.label}] switchover {run}/{runs}: from {old}, longest write gap {gap:.2f} s")
        system.wait_healthy()
    finally:
        report = load.stop()
        result.acked = len(report.acked)
        try:  # counted even after a failure: a lost acknowledged write matters most then
            try:
                present = present_ids(system.rw_dsn(), TABLE)
            except psycopg.errors.UndefinedTable:
                present = set()  # the primary promoted never received the table: every write is lost
            lost = report.lost(present)
        except Exception as exc:
            log(f"[{system.label}] could not read the writes back: {exc}")
        else:
            result.lost = len(lost)
            log(f"[{system.label}] {report.summary()}; acknowledged writes lost: {len(lost)} {lost[:10]}")


def _stats(values: list[float]) -> str:
    if not values:
        return "        -"
    return f"{min(values):6.2f} / {statistics.median(values):6.2f} / {max(values):6.2f}"


def _baseline(label: str) -> str:
    """The pgherd row a system is compared with: the one on the same platform."""
    return "pgherd-localkube" if "localkube" in label else "pgherd"


def print_table(results: list[Result], mode: str, detection_seconds: int) -> None:
    print()
    print(f"replication mode: {mode}; pgherd failover.detectionSeconds: {detection_seconds}")
    print(f"{'system':<26} {'scenario':<28} {'s (min / median / max)':>26} {'promoted':>9}")
    for r in results:
        for scenario in SCENARIOS:
            values = r.seconds[scenario]
            if not values:
                continue
            promoted = f"{r.promoted[scenario]}/{len(values)}" if scenario in KILLS else ""
            print(f"{r.label:<26} {TITLES[scenario]:<28} {_stats(values):>26} {promoted:>9}")
        lost = "?" if r.lost is None else str(r.lost)
        print(f"{r.label:<26} {'acknowledged writes lost':<28} {f'{lost} of {r.acked}':>26}")
        for error in r.errors:
            print(f"  error: {error}")
    by_label = {r.label: r for r in results}
    for r in results:
        base = by_label.get(_baseline(r.label))
        if base is None or base is r:
            continue
        ratios = [
            f"{scenario} median x{statistics.median(r.seconds[scenario]) / statistics.median(base.seconds[scenario]):.1f}"
            for scenario in SCENARIOS
            if r.seconds[scenario]
            and base.seconds[scenario]
            and statistics.median(base.seconds[scenario]) > 0
        ]
        if ratios:
            print(f"{r.label} / {base.label}: {', '.join(ratios)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--runs", type=int, default=5, help="failovers and switchovers per system (default 5)"
    )
    parser.add_argument("--systems", default="pgherd,patroni-default,patroni-tuned")
    parser.add_argument("--mode", choices=("quorum", "async"), default="quorum")
    parser.add_argument("--detection-seconds", type=int, default=3, help="pgherd's failover.detectionSeconds")
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="which to measure, in this order: failover (kill the primary's member), crash (kill its"
        " PostgreSQL alone), switchover, backoff (localkube: the primary's container kept in back-off),"
        " delete (localkube: its pod deleted); a system skips those it cannot run (default: all)",
    )
    args = parser.parse_args(argv)
    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    if not scenarios or set(scenarios) - set(SCENARIOS):
        parser.error(f"--scenarios: choose among {', '.join(SCENARIOS)}")

    factories: dict[str, Callable[[], System]] = {
        "pgherd": lambda: PgherdSystem(args.mode, args.detection_seconds),
        "pgherd-localkube": lambda: PgherdSystem(args.mode, args.detection_seconds, "localkube"),
        "patroni-default": lambda: PatroniSystem(DEFAULT, args.mode),
        "patroni-tuned": lambda: PatroniSystem(TUNED, args.mode),
        "patroni-localkube-default": lambda: PatroniKubeSystem(DEFAULT, args.mode),
        "patroni-localkube-tuned": lambda: PatroniKubeSystem(TUNED, args.mode),
    }
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in factories]
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(factories)}")

    def log(message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)

    results: list[Result] = []
    for label in wanted:
        result = Result(label)
        results.append(result)
        system: System | None = None
        try:
            system = factories[label]()
            measure(system, args.runs, log, result, scenarios)
        except Exception as exc:  # one system failing must not hide the others' figures
            log(f"[{label}] failed: {type(exc).__name__}: {exc}")
            result.errors.append(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
        finally:
            try:
                if system is not None:
                    system.stop()
            except Exception as exc:
                log(f"[{label}] could not stop cleanly: {exc}")
    print_table(results, args.mode, args.detection_seconds)
    return 0 if all(not r.errors for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
