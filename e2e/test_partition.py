"""Network partitions on real addresses (localkube: packets dropped both ways between pod addresses, the
node's and the operator's pod, e2e/localkube/partition.py), under a write load through the -rw Service
and a prober asking every member every 100 ms whether it is in recovery and accepts a write
(e2e/prober.py). One 3-member cluster in quorum mode for the module, the scenarios in order, each healed
before the next (and at the module's end whatever happens):

- the operator cut off from the primary alone for 20 s: no failover (losing a primary needs the
  replicas' agreement, and they still stream from it); no write fails;
- a replica cut off from everyone (the other members, the operator, the node) for 20 s: writes go on
  (quorum mode with 3 members: the other replica acknowledges), no failover; healed, it catches up.

Every scenario's verdict from the prober's record: never two members accepting writes at the same
moment, and no acknowledged write lost. The sandbox's members share 127.0.0.1 with the supervisor, so
that a partition there would cut more than the scenario names: these run on localkube only."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from e2e import manifests
from e2e.checks import StatusRecorder, assert_no_acknowledged_write_lost, wait_ids_on_member
from e2e.driver import NewCluster, healthy, replicas, unless_failed
from e2e.drivers.localkube import LocalKubeDriver
from e2e.prober import Prober, ensure_probe_table
from e2e.workload import WriteLoad

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


def test_the_operator_cut_off_from_the_primary_alone_fails_nothing_over(cluster: LocalKubeDriver) -> None:
    status = cluster.wait_for(unless_failed(healthy(INSTANCES)), 120, "a healthy cluster")
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


def test_a_replica_cut_off_from_everyone_stops_no_write_and_catches_up(cluster: LocalKubeDriver) -> None:
    status = cluster.wait_for(unless_failed(healthy(INSTANCES)), 120, "a healthy cluster")
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
