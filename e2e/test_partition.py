"""Network partitions on real addresses (localkube: packets dropped both ways between pod addresses, the
node's and the operator's pod, e2e/localkube/partition.py), under a write load through the -rw Service
and a prober asking every member every 100 ms whether it is in recovery and accepts a write
(e2e/prober.py). One 3-member cluster for the module, the scenarios in order, each in quorum mode then
in async mode (the cluster's mode changed in place), each healed before the next (and at the module's
end whatever happens):

- the operator cut off from the primary alone for 20 s: no failover (losing a primary needs the
  replicas' agreement, and they still stream from it); no write fails;
- a replica cut off from everyone (the other members, the operator, the node) for 20 s: writes go on
  (in quorum mode with 3 members the other replica acknowledges), no failover; healed, it catches up;
- the primary cut off from the operator and both replicas, clients (this host) still reaching it: a
  replica is promoted within REPLACED_WITHIN of the cut (the replicas report the primary's silence: pgherd.engine.failover), the old
  primary's pod deleted by the fence (its kubelet still reaches it) so that it stops taking writes before
  the new one starts; in quorum mode it acknowledges nothing once cut off, and nothing acknowledged is
  lost; in async mode what it acknowledged between the cut and its stop is all that is lost (counted and
  printed); healed, it rejoins as a replica;
- the primary cut off from its replicas while the operator is away (async mode): it fences itself within
  the isolation bound of the operator's last word; the operator back, it is unfenced, nothing lost;
- the operator, with a second replica beside it, cut off from the API server (the node's address): it
  stops acting (says it lost the leadership) within its renew deadline, before the other replica takes
  the Lease, and the other one carries out a switchover meanwhile.

Every scenario's verdict from the prober's record: never two members accepting writes at the same
moment, and no acknowledged write lost (but for the async cut-off primary's, counted). The sandbox's members share 127.0.0.1 with the supervisor, so
that a partition there would cut more than the scenario names: these run on localkube only."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from e2e import manifests
from e2e.checks import StatusRecorder, assert_no_acknowledged_write_lost, wait_ids_on_member
from e2e.driver import NewCluster, healthy, replicas, unless_failed
from e2e.drivers.localkube import LocalKubeDriver
from e2e.prober import Prober, ensure_probe_table
from e2e.workload import WriteLoad, present_ids
from pgherd.agentview import ISOLATION_SECONDS

DRIVER = os.environ.get("PGHERD_E2E_DRIVER", "local")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        DRIVER != "localkube",
        reason=(
            "partitions need members on addresses of their own: localkube (PGHERD_E2E_DRIVER=localkube);"
            " the sandbox's members and supervisor share 127.0.0.1"
        ),
    ),
]

NAME = "e2e-partition"
INSTANCES = 3
CUT = 20.0  # seconds each partition lasts: several detection periods (detectionSeconds 3)
# From the cut to the first write the new primary accepts: detectionSeconds 3 gives wal_receiver_timeout
# 6 s, so silence counts after 3 s + 1 s, dated back to the cut; then two observations, the fence (its
# agent call fails within 2 s, the pod is deleted with a 1 s grace), the promotion, the first write.
REPLACED_WITHIN = 15.0
# Async replication lag at the cut: writes acknowledged this long before it may not have been streamed.
ASYNC_LAG = 1.0


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, pg_version: int) -> Iterator[LocalKubeDriver]:
    driver = new_cluster(
        manifests.cluster(NAME, postgres_version=pg_version, instances=INSTANCES, mode="quorum")
    )
    assert isinstance(driver, LocalKubeDriver)
    ensure_probe_table(driver.rw_dsn())
    try:
        yield driver
    finally:
        driver.heal()


def prober(cluster: LocalKubeDriver) -> Prober:
    names = [f"{NAME}-{i}" for i in range(INSTANCES)]
    return Prober({name: (lambda name=name: cluster.member_dsn(name)) for name in names})  # type: ignore[misc]


def cut_off(cluster: LocalKubeDriver, groups: list[list[str]], seconds: float = CUT) -> None:
    cluster.partition(groups)
    try:
        time.sleep(seconds)
    finally:
        cluster.heal()


def use_mode(cluster: LocalKubeDriver, pg_version: int, mode: str) -> dict[str, object]:
    """The cluster in replication mode `mode` (changed in place when it is in the other), healthy."""
    if cluster.get("postgresclusters.pgherd.io", NAME)["spec"].get("replication", {}).get("mode") != mode:
        cluster.apply(manifests.cluster(NAME, postgres_version=pg_version, instances=INSTANCES, mode=mode))

    def in_mode(status: dict[str, object]) -> bool:
        if not healthy(INSTANCES)(status):
            return False
        # The synchronous standbys in force: the engine's record in the resource's own status.
        raw = cluster.get("postgresclusters.pgherd.io", NAME).get("status") or {}
        k = ((raw.get("engine") or {}).get("sync") or {}).get("k")
        return k is not None and (k == 0) == (mode == "async")

    return cluster.wait_for(unless_failed(in_mode), 180, f"a healthy cluster in {mode} mode")


@pytest.mark.parametrize("mode", ["quorum", "async"])
def test_the_operator_cut_off_from_the_primary_alone_fails_nothing_over(
    cluster: LocalKubeDriver, pg_version: int, mode: str
) -> None:
    status = use_mode(cluster, pg_version, mode)
    primary = str(status["primary"])
    load = WriteLoad(cluster.rw_dsn).start()
    try:
        with prober(cluster) as probes, StatusRecorder(cluster, interval=0.5) as recorder:
            load.wait_for_acks(20)
            cut_off(cluster, [["operator"], [primary]])
            cluster.wait_for(unless_failed(healthy(INSTANCES)), 120, "a healthy cluster after the heal")
            load.wait_for_acks(20)
    finally:
        report = load.stop()
    changes = recorder.primary_changes()
    assert not [c for c in changes if c[2] not in (None, primary)], f"a failover: {changes}"
    # The cut was real: the operator lost sight of the primary (it said so) and waited for the replicas.
    assert "Degraded" in recorder.phases(), recorder.phases()
    assert not report.failed, f"writes failed: {report.failure_windows()}; {report.summary()}"
    assert probes.two_writers() == []
    assert_no_acknowledged_write_lost(cluster, report)


@pytest.mark.parametrize("mode", ["quorum", "async"])
def test_a_replica_cut_off_from_everyone_stops_no_write_and_catches_up(
    cluster: LocalKubeDriver, pg_version: int, mode: str
) -> None:
    status = use_mode(cluster, pg_version, mode)
    primary = str(status["primary"])
    isolated = sorted(replicas(status))[0]
    others = [m["name"] for m in status["members"] if m["name"] != isolated]
    load = WriteLoad(cluster.rw_dsn).start()
    try:
        with prober(cluster) as probes, StatusRecorder(cluster, interval=0.5) as recorder:
            load.wait_for_acks(20)
            cut_off(cluster, [[isolated], [*others, "operator", "node"]])
            load.wait_for_acks(20)
            cluster.wait_for(unless_failed(healthy(INSTANCES)), 180, f"{isolated} back and caught up")
    finally:
        report = load.stop()
    changes = recorder.primary_changes()
    assert not [c for c in changes if c[2] not in (None, primary)], f"a failover: {changes}"
    # Quorum mode with 3 members: the other replica acknowledges every commit while one is cut off.
    assert not report.failed, f"writes failed: {report.failure_windows()}; {report.summary()}"
    assert probes.two_writers() == []
    # The cut was real: this host (the prober) had no answer from the replica for most of it.
    silent = [p for p in probes.probes if p.member == isolated and p.in_recovery is None]
    assert sum(p.ended - p.started for p in silent) > CUT / 2, f"{len(silent)} unanswered probes"
    present = assert_no_acknowledged_write_lost(cluster, report)
    wait_ids_on_member(cluster, isolated, sorted(set(report.acked_ids()) & present)[-50:], timeout=60)


@pytest.mark.parametrize("mode", ["quorum", "async"])
def test_a_primary_cut_off_from_the_operator_and_the_replicas_is_replaced(
    cluster: LocalKubeDriver, pg_version: int, mode: str
) -> None:
    status = use_mode(cluster, pg_version, mode)
    old = str(status["primary"])
    others = sorted(replicas(status))
    load = WriteLoad(cluster.rw_dsn).start()
    try:
        with prober(cluster) as probes, StatusRecorder(cluster, interval=0.5) as recorder:
            load.wait_for_acks(20)
            cutting = time.monotonic()
            cluster.partition([[old], [*others, "operator"]])
            cut = time.monotonic()
            try:
                status = cluster.wait_for(
                    lambda s: s.get("primary") not in (None, old), 60, f"a replica promoted in place of {old}"
                )
                new = str(status["primary"])
                cluster.wait_for(
                    lambda s: probes.first_write(new, cut) is not None, 30, f"{new} taking writes"
                )
            finally:
                cluster.heal()
            cluster.wait_for(unless_failed(healthy(INSTANCES)), 240, f"{old} back as a replica")
            load.wait_for_acks(20)
    finally:
        report = load.stop()
    first_new = probes.first_write(new, cut)
    last_old = probes.last_write(old)
    assert first_new is not None
    stopped = None if last_old is None else max(0.0, last_old - cut)
    print(
        f"\n[{mode}] cut at 0: the old primary {old} took its last write at "
        f"{'-' if stopped is None else f'{stopped:.2f} s'}; the new primary {new} its first at"
        f" {first_new - cut:.2f} s; phases {recorder.phases()}"
    )
    assert first_new - cut <= REPLACED_WITHIN, f"replaced after {first_new - cut:.2f} s"
    assert probes.two_writers() == [], probes.two_writers()
    final = cluster.status()
    assert {m["name"]: m.get("role") for m in final["members"]}[old] == "replica", final["members"]
    if mode == "quorum":
        # Cut off from both replicas it can acknowledge nothing: its last accepted write predates the cut.
        assert stopped is None or stopped < 1.0, (
            f"the cut-off primary acknowledged writes until {stopped:.2f} s"
        )
        assert_no_acknowledged_write_lost(cluster, report)
        return
    assert stopped is not None and stopped < first_new - cut
    lost = report.lost(present_ids(cluster.rw_dsn(), report.table))
    # What async mode may lose: what the old primary acknowledged after the cut, and just before it what
    # it had not streamed yet (its replication lag), nothing older.
    exposed = {a.id for a in report.attempts if a.ok and a.ended >= cutting - ASYNC_LAG}
    early = [a.ended - cutting for a in report.attempts if a.ok and a.id in set(lost) and a.ended < cutting]
    print(
        f"[async] acknowledged by the cut-off primary and lost: {len(lost)} writes"
        f" ({len(early)} acknowledged before the cut, the earliest {min(early, default=0.0):.2f} s before)"
    )
    assert set(lost) <= exposed, lost[:20]


def test_an_async_primary_cut_off_while_the_operator_is_away_fences_itself(
    cluster: LocalKubeDriver, pg_version: int
) -> None:
    """No operator to fence it (stopped: as where a partition cuts the primary's node off, kubelet and
    all), and no replica replying: the agent's own isolation check stops it within ISOLATION_SECONDS of
    the operator's last word. The operator back, nothing was promoted: it is unfenced, nothing lost."""
    status = use_mode(cluster, pg_version, "async")
    primary = str(status["primary"])
    others = sorted(replicas(status))
    load = WriteLoad(cluster.rw_dsn).start()
    try:
        with prober(cluster) as probes:
            load.wait_for_acks(20)
            cluster.stop_operator()
            silent = time.monotonic()  # the operator's last word to the agent came before this
            cluster.partition([[primary], others])
            cut = time.monotonic()
            try:
                time.sleep(ISOLATION_SECONDS + 8)
            finally:
                cluster.heal()
            healed = time.monotonic()
            cluster.resume_operator()
            cluster.wait_for(unless_failed(healthy(INSTANCES)), 240, f"{primary} unfenced by the operator")
            load.wait_for_acks(20)
    finally:
        report = load.stop()
    during = [
        p.ended for p in probes.probes if p.member == primary and p.accepted and cut <= p.started <= healed
    ]
    last = max(during, default=cut) - silent
    print(
        f"\n[isolation] the operator gone at 0, the replicas cut at {cut - silent:.1f} s: {primary} took its last write at {last:.1f} s"
    )
    assert during, "the primary took no write after the cut: the cut, not the isolation check, stopped it"
    # The check runs every second, then a checkpoint and a fast shutdown.
    assert last <= ISOLATION_SECONDS + 5, last
    assert cluster.status()["primary"] == primary  # nothing promoted without an operator
    assert probes.two_writers() == []
    assert_no_acknowledged_write_lost(cluster, report)


LEASE = "pgherd-leader"  # the chart's Lease: <fullname>-leader
RENEW_DEADLINE = 10.0  # pgherd.kube.leader: a holder that could not renew this long stops acting
LEASE_DURATION = 15.0  # and another replica may take the Lease only after this without a renewal


def _operator_log_time(cluster: LocalKubeDriver, pod: str, text: str, after: float) -> float | None:
    """When the operator pod `pod` first logged `text` after `after` (epoch seconds), in its current
    container's log or, restarted meanwhile (its liveness probe comes from the node), its previous one."""
    found = []
    for previous in ((), ("--previous",)):
        out = cluster.kube.run(
            "-n", cluster.operator_namespace, "logs", pod, "--timestamps=false", *previous, check=False
        ).stdout  # fmt: skip
        for line in out.splitlines():
            if text not in line:
                continue
            try:
                at = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=UTC).timestamp()
            except ValueError:
                continue
            if at > after:
                found.append(at)
    return min(found) if found else None


def test_the_operator_cut_off_from_the_api_server_stops_and_another_replica_takes_over(
    cluster: LocalKubeDriver,
) -> None:
    status = cluster.wait_for(unless_failed(healthy(INSTANCES)), 180, "a healthy cluster")
    old_primary = str(status["primary"])
    ns = ("-n", cluster.operator_namespace)
    kube = cluster.kube
    kube.run(*ns, "scale", "deployment", cluster.release, "--replicas=2")
    try:
        kube.run(*ns, "rollout", "status", f"deployment/{cluster.release}", "--timeout=180s", timeout=200)
        leader = kube.json(*ns, "get", "lease", LEASE)["spec"]["holderIdentity"]
        pods = kube.json(*ns, "get", "pods", "-l", "app.kubernetes.io/component=operator")["items"]
        (other,) = [p["metadata"]["name"] for p in pods if p["metadata"]["name"] != leader]
        cluster.partition([[f"operator/{leader}"], ["node"]])
        cut = time.time()
        try:
            deadline = time.monotonic() + LEASE_DURATION + RENEW_DEADLINE + 20
            while kube.json(*ns, "get", "lease", LEASE)["spec"]["holderIdentity"] != other:
                assert time.monotonic() < deadline, f"{other} never took the Lease from {leader}"
                time.sleep(0.5)
            # The cluster is managed meanwhile: by the new leader, the old one still cut off.
            cluster.switchover()
            new_primary = cluster.wait_for(
                lambda s: s.get("primary") not in (None, old_primary) and s.get("phase") == "Running",
                120,
                "the switchover done by the new leader",
            )["primary"]
        finally:
            cluster.heal()
        lost = _operator_log_time(cluster, leader, "lost the leadership", cut)
        acquired = _operator_log_time(cluster, other, "acquired the leadership", cut)
        print(
            f"\n[operator cut from the API server at 0] {leader} stopped acting at"
            f" {'-' if lost is None else f'{lost - cut:.1f} s'}, {other} took over at"
            f" {'-' if acquired is None else f'{acquired - cut:.1f} s'}; switchover to {new_primary}"
        )
        assert lost is not None and acquired is not None
        # Its last renewal was before the cut: it stops within the renew deadline (and a second of
        # logging), before the Lease can pass to anyone else.
        assert lost - cut <= RENEW_DEADLINE + 1.5, lost - cut
        assert lost < acquired
    finally:
        kube.run(*ns, "scale", "deployment", cluster.release, "--replicas=1")
        kube.run(*ns, "rollout", "status", f"deployment/{cluster.release}", "--timeout=180s", timeout=200)
    cluster.wait_for(unless_failed(healthy(INSTANCES)), 180, "a healthy cluster with one operator")
