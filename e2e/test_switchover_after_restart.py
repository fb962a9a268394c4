"""A switchover requested seconds after a killed member came back, under a write load, in async mode.

Patroni 3.0.2 lost 73-76 acknowledged writes here in 2 of 3 trials: it promoted the member that had just
restarted and was not streaming yet. pgherd must either wait until the target has caught up with the
old primary (drain writes, then promote) or refuse the switchover; it must never lose an acknowledged
commit. Three trials, each on the replica that was killed (kept down until it is seen down, the writes
going on meanwhile, then let back).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from e2e import manifests
from e2e.checks import assert_no_acknowledged_write_lost, wait_ids_on_member
from e2e.driver import ClusterStatus, Driver, DriverError, NewCluster, healthy, member, replicas
from e2e.workload import WriteLoad

pytestmark = pytest.mark.e2e

NAME = "e2e-race"
TRIALS = 3


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, pg_version: int) -> Driver:
    return new_cluster(manifests.cluster(NAME, postgres_version=pg_version, instances=3, mode="async"))


def _down(name: str) -> Callable[[ClusterStatus], bool]:
    def check(status: ClusterStatus) -> bool:
        m = member(status, name) or {}
        return not m.get("ready") or m.get("role") not in ("replica", "primary")

    return check


def _back(name: str) -> Callable[[ClusterStatus], bool]:
    """Back as far as a client can tell: reachable and reporting replica, whether streaming yet or not."""

    def check(status: ClusterStatus) -> bool:
        m = member(status, name) or {}
        return m.get("role") == "replica" and m.get("reachable", True) is not False

    return check


@pytest.mark.parametrize("trial", range(1, TRIALS + 1))
def test_switchover_to_a_member_that_just_came_back_loses_nothing(cluster: Driver, trial: int) -> None:
    before = cluster.wait_for(healthy(3), 180, "a healthy cluster before the trial")
    old = str(before["primary"])
    target = sorted(replicas(before))[trial % 2]

    load = WriteLoad(cluster.rw_dsn, pause=0.0).start()
    refused: str | None = None
    try:
        load.wait_for_acks(200)
        # Kept down until it is seen down (a crashed container the kubelet restarts at once may come back
        # before any status shows it gone), while the writes go on: it comes back behind.
        cluster.kill(target, keep_down=True)
        cluster.wait_for(_down(target), 60, f"{target} to be seen down after the kill")
        load.wait_for_acks(100)
        cluster.bring_back(target)
        cluster.wait_for(_back(target), 180, f"{target} to come back after the kill")
        try:
            cluster.switchover(to=target)  # at once: the member may not be streaming yet
        except DriverError as exc:
            refused = str(exc)
        after = cluster.wait_for(healthy(3), 120, "a healthy cluster after the switchover")
        if refused is not None:
            # A refusal is safe; the switchover must then go through once the target has caught up.
            cluster.switchover(to=target)
            after = cluster.wait_for(healthy(3), 120, "a healthy cluster after the retried switchover")
        load.wait_for_acks(100)
    finally:
        report = load.stop()

    print(
        f"\ntrial {trial}: switchover {old} -> {after['primary']} right after {target} came back"
        f"{' (first refused: ' + refused.splitlines()[0] + ')' if refused else ''}; {report.summary()}"
    )
    assert after["primary"] == target, f"asked for {target}, primary is {after['primary']}"
    assert_no_acknowledged_write_lost(cluster, report)
    for name in (old, *replicas(after)):
        wait_ids_on_member(cluster, name, report.acked_ids(), timeout=60)


def test_switchover_without_a_target_under_async_load(cluster: Driver) -> None:
    """In async mode too, the operator picks a caught-up replica by itself (drain, then promote)."""
    before = cluster.wait_for(healthy(3), 180, "a healthy cluster before the switchover")
    old = str(before["primary"])
    load = WriteLoad(cluster.rw_dsn, pause=0.0).start()
    try:
        load.wait_for_acks(200)
        cluster.switchover()
        after = cluster.wait_for(
            lambda s: s.get("primary") not in (None, old) and healthy(3)(s), 120, "the switchover to complete"
        )
        load.wait_for_acks(100)
    finally:
        report = load.stop()
    print(f"\nswitchover {old} -> {after['primary']} (operator's choice, async); {report.summary()}")
    assert_no_acknowledged_write_lost(cluster, report)
