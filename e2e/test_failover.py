"""Kill -9 of the primary under a write load, in quorum mode: a replica is promoted, no acknowledged
commit is lost, and the old primary comes back as a replica holding every acknowledged write.

The killed primary is kept down until the new primary shows (`kill(keep_down=True)`, then
`bring_back`): a real kubelet restarts a crashed container at once the first time, and a primary back
read-only within the detection time is promoted again in place, which is no failover."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from e2e import manifests
from e2e.checks import assert_no_acknowledged_write_lost, in_recovery, wait_ids_on_member
from e2e.driver import Driver, NewCluster, healthy, member
from e2e.workload import WriteLoad

pytestmark = pytest.mark.e2e

NAME = "e2e-failover"
NEW_PRIMARY_TIMEOUT = 60.0
REJOIN_TIMEOUT = 180.0


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, pg_version: int) -> Driver:
    return new_cluster(manifests.cluster(NAME, postgres_version=pg_version, instances=3, mode="quorum"))


# Twice: the second failover runs on members that rejoined after the first (rewound, re-pointed), where
# failure detection and votes must work just as well.
@pytest.mark.parametrize("round_", [1, 2], ids=["first", "second"])
def test_kill_primary_under_load_loses_no_acknowledged_commit(
    cluster: Driver, round_: int, record_property: Callable[[str, object], None]
) -> None:
    before = cluster.wait_for(healthy(3), 180, "a healthy cluster before the kill")
    old = str(before["primary"])
    old_timeline = member(before, old)["timeline"]  # type: ignore[index]

    load = WriteLoad(cluster.rw_dsn).start()
    try:
        load.wait_for_acks(200)
        cluster.kill(old, keep_down=True)
        killed_at = time.monotonic()
        after = cluster.wait_for(
            lambda s: (
                s.get("primary") not in (None, old)
                and (member(s, str(s.get("primary"))) or {}).get("role") == "primary"
            ),
            NEW_PRIMARY_TIMEOUT,
            f"a replica to be promoted after {old} was killed",
        )
        load.wait_for_acks(200, timeout=60)
    finally:
        report = load.stop()

    cluster.bring_back(old)
    new = str(after["primary"])
    first = report.first_ack_after(killed_at, begun=True)
    assert first is not None
    record_property("failover_seconds", round(first.ended - killed_at, 2))
    print(
        f"\nfailover {round_}: {old} -> {new}: writes back {first.ended - killed_at:.2f} s after the kill; {report.summary()}"
    )

    present = assert_no_acknowledged_write_lost(cluster, report)
    assert not in_recovery(cluster, new)
    new_timeline = member(after, new)["timeline"]  # type: ignore[index]
    assert new_timeline is None or old_timeline is None or new_timeline > old_timeline, after

    # The old primary is restarted by the platform and rejoins as a replica, never as a second primary.
    cluster.wait_for(
        lambda s: (
            (member(s, old) or {}).get("role") == "replica" and bool((member(s, old) or {}).get("ready"))
        ),
        REJOIN_TIMEOUT,
        f"the old primary {old} to rejoin as a ready replica",
    )
    assert in_recovery(cluster, old), f"{old} came back out of recovery: two primaries"
    acked = report.acked_ids()
    wait_ids_on_member(cluster, old, acked, timeout=60)
    status = cluster.status()
    assert status["primary"] == new, f"the primary moved again after the old one came back: {status}"
    assert set(acked) <= present
