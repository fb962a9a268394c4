"""Majority failure: the primary and one replica of three killed with their data wiped. The cluster
reports QuorumLost and promotes nothing (the survivor alone could be missing acknowledged commits);
a Restore from the chosen Backup then brings the same cluster back, with the Backup's data on every
member, and writable."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from e2e import manifests
from e2e.checks import insert_ids, wait_ids_on_member
from e2e.driver import Driver, NewCluster, backup_phase, healthy, replicas, restore_phase, unless_failed
from e2e.workload import present_ids

pytestmark = pytest.mark.e2e

NAME = "e2e-majority"
CHOSEN = "e2e-majority-chosen"
RESTORE = "e2e-majority-recover"
IN_BACKUP = list(range(1, 301))
# Longer than the platform's restart delay: the wiped members come back empty during the watch.
NOTHING_PROMOTED_WATCH = 10.0
RESTORE_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, pg_version: int) -> Driver:
    return new_cluster(manifests.cluster(NAME, postgres_version=pg_version, instances=3, mode="quorum"))


def test_majority_loss_then_recovery_from_the_chosen_backup(cluster: Driver) -> None:
    insert_ids(cluster.rw_dsn(), IN_BACKUP)
    cluster.apply(manifests.backup(CHOSEN, NAME))
    status = cluster.wait_for(
        lambda s: backup_phase(s, CHOSEN) in ("Completed", "Failed"), 180, f"Backup {CHOSEN}"
    )
    assert backup_phase(status, CHOSEN) == "Completed", status.get("backups")
    insert_ids(cluster.rw_dsn(), range(1001, 1101))  # after the backup: may or may not come back

    status = cluster.wait_for(healthy(3), 60, "a healthy cluster before the majority failure")
    primary = str(status["primary"])
    survivor, lost_replica = sorted(replicas(status))
    # Both at once: one after the other, the first loss would be failed over before the second.
    with ThreadPoolExecutor(max_workers=2) as pool:
        for done in [pool.submit(cluster.kill, name, True) for name in (primary, lost_replica)]:
            done.result()

    cluster.wait_for(lambda s: s.get("phase") == "QuorumLost", 60, "phase QuorumLost")
    # Nothing is promoted while the majority is gone, even once the wiped members are restarted empty.
    deadline = time.monotonic() + NOTHING_PROMOTED_WATCH
    while time.monotonic() < deadline:
        status = cluster.status()
        promoted = [m["name"] for m in status["members"] if m.get("role") == "primary"]
        assert not promoted, f"{promoted} promoted without a majority: {status}"
        assert status.get("phase") == "QuorumLost", f"left QuorumLost on its own: {status}"
        time.sleep(1.0)
    with pytest.raises(psycopg.Error):
        insert_ids(cluster.rw_dsn(), [5000])

    cluster.apply(manifests.restore(RESTORE, NAME, backup_name=CHOSEN))
    status = cluster.wait_for(
        lambda s: restore_phase(s, RESTORE) in ("Completed", "Failed"),
        RESTORE_TIMEOUT,
        f"Restore {RESTORE} to finish",
    )
    assert restore_phase(status, RESTORE) == "Completed", status.get("restores")
    status = cluster.wait_for(
        unless_failed(healthy(3)), RESTORE_TIMEOUT, "a healthy 3-member cluster after the recovery"
    )

    assert set(IN_BACKUP) <= present_ids(cluster.rw_dsn()), "the chosen Backup's rows are missing"
    for m in status["members"]:
        wait_ids_on_member(cluster, m["name"], IN_BACKUP, timeout=60)
    restore = next(r for r in status["restores"] if r["name"] == RESTORE)
    if "keptData" in restore:  # the survivors' data is kept aside, never deleted without a request
        assert restore["keptData"], f"the survivor {survivor}'s data was not kept aside: {restore}"
    insert_ids(cluster.rw_dsn(), [6000])
