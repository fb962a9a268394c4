"""Scaling 3 -> 5 -> 2 when the primary is the highest member: new members are seeded with the data,
scaling down never removes the primary (it switches over first), no acknowledged commit is lost, and
the removed members leave no replication slot behind."""

from __future__ import annotations

from typing import Any

import pytest

from e2e import manifests
from e2e.checks import assert_no_acknowledged_write_lost, in_recovery, insert_ids, query, wait_ids_on_member
from e2e.driver import Driver, NewCluster, healthy, unless_failed
from e2e.workload import WriteLoad

pytestmark = pytest.mark.e2e

NAME = "e2e-scale"
SCALE_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def manifest(pg_version: int) -> dict[str, Any]:
    # No explicit mode: quorum from 3 members, async at 2 (quorum with 2 members is refused at admission).
    return manifests.cluster(NAME, postgres_version=pg_version, instances=3, mode=None)


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, manifest: dict[str, Any]) -> Driver:
    return new_cluster(manifest)


def test_scale_up_from_3_to_5_seeds_the_new_members(cluster: Driver, manifest: dict[str, Any]) -> None:
    ids = insert_ids(cluster.rw_dsn(), range(1, 501))
    cluster.apply(manifests.with_changes(manifest, instances=5))
    status = cluster.wait_for(unless_failed(healthy(5)), SCALE_TIMEOUT, "5 ready members")
    names = sorted(m["name"] for m in status["members"])
    assert names == [f"{NAME}-{i}" for i in range(5)]
    for name in (f"{NAME}-3", f"{NAME}-4"):
        assert in_recovery(cluster, name)
        wait_ids_on_member(cluster, name, ids, timeout=30)


def test_scale_down_to_2_when_the_primary_is_the_highest_member(
    cluster: Driver, manifest: dict[str, Any]
) -> None:
    highest = f"{NAME}-4"
    cluster.switchover(to=highest)
    cluster.wait_for(lambda s: s.get("primary") == highest and healthy(5)(s), 90, f"{highest} to be primary")

    load = WriteLoad(cluster.rw_dsn).start()
    try:
        load.wait_for_acks(200)
        cluster.apply(manifests.with_changes(manifest, instances=2))
        status = cluster.wait_for(
            unless_failed(healthy(2)), SCALE_TIMEOUT, "2 ready members after scaling down"
        )
        load.wait_for_acks(200)
    finally:
        report = load.stop()

    print(
        f"\nscaled down to {[m['name'] for m in status['members']]}, primary {status['primary']}; {report.summary()}"
    )
    kept = sorted(m["name"] for m in status["members"])
    assert kept == [f"{NAME}-0", f"{NAME}-1"], f"scaling down kept {kept}"
    assert status["primary"] in kept
    assert_no_acknowledged_write_lost(cluster, report)
    for name in kept:
        wait_ids_on_member(cluster, name, report.acked_ids(), timeout=30)
    # A slot left for a removed member would hold WAL on the primary forever.
    cluster.wait_for(
        lambda s: not query(cluster.rw_dsn(), "SELECT slot_name FROM pg_replication_slots WHERE NOT active"),
        30,
        "the removed members' replication slots to be dropped",
    )
