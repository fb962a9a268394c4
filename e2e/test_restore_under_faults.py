"""A Restore applied the moment QuorumLost shows completes whatever the lost members do meanwhile.

1. The lost members are down when it is applied and come back in the middle of it: the old primary with
   its data (it stays fenced until it is re-cloned from the restored primary, its data kept aside), the
   replica with an empty volume. (e2e/test_majority_failure.py applies it once they restarted empty.)
2. They never come back (their pods cannot be scheduled): the Restore completes with the member the
   cluster can have, which serves writes; once they can start again they are rebuilt from it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from e2e import manifests
from e2e.checks import StatusRecorder, insert_ids
from e2e.driver import ClusterStatus, Driver, NewCluster, backup_phase, healthy, restore_phase, unless_failed
from e2e.recovery_faults import RECOVERY_TIMEOUT, check_rows, lose_majority, restored_with_members

pytestmark = pytest.mark.e2e

NAME = "e2e-restore-faults"
CHOSEN = "e2e-restore-faults-chosen"
IN_BACKUP = list(range(1, 201))


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, pg_version: int) -> Driver:
    driver = new_cluster(manifests.cluster(NAME, postgres_version=pg_version, instances=3, mode="quorum"))
    insert_ids(driver.rw_dsn(), IN_BACKUP)
    driver.apply(manifests.backup(CHOSEN, NAME))
    status = driver.wait_for(
        lambda s: backup_phase(s, CHOSEN) in ("Completed", "Failed"), 180, f"Backup {CHOSEN}"
    )
    assert backup_phase(status, CHOSEN) == "Completed", status.get("backups")
    return driver


def restore_now(cluster: Driver, name: str) -> None:
    cluster.apply(manifests.restore(name, NAME, backup_name=CHOSEN))


def completed(name: str) -> Callable[[ClusterStatus], bool]:
    def check(status: ClusterStatus) -> bool:
        phase = restore_phase(status, name)
        assert phase != "Failed", f"Restore {name} failed: {status.get('restores')}"
        return phase == "Completed"

    return check


def test_a_restore_applied_while_the_lost_members_are_down(cluster: Driver) -> None:
    restore = "e2e-restore-faults-down"
    with StatusRecorder(cluster) as recorder:
        primary, lost_replica, survivor = lose_majority(cluster, wipe_primary=False, wipe_replica=True)
        restore_now(cluster, restore)
        cluster.bring_back(primary)
        cluster.bring_back(lost_replica)
        cluster.wait_for(completed(restore), RECOVERY_TIMEOUT, f"Restore {restore} Completed")
        status = cluster.wait_for(unless_failed(healthy(3)), RECOVERY_TIMEOUT, "a healthy 3-member cluster")
    phases = recorder.phases()
    assert "Failed" not in phases, f"phases seen: {phases}"
    check_rows(cluster, status, IN_BACKUP, 7001)
    kept = next(r for r in status.get("restores") or [] if r["name"] == restore).get("keptData")
    if kept is not None:  # the replaced data directories are kept aside, never deleted
        assert kept, f"no data kept aside by Restore {restore}"
    print(f"\nlost {primary} (data kept) and {lost_replica} (wiped), survivor {survivor}; phases {phases}")


def test_a_restore_completes_with_members_that_never_return(cluster: Driver) -> None:
    restore = "e2e-restore-faults-never"
    primary, lost_replica, _ = lose_majority(cluster, wipe_primary=True, wipe_replica=True)
    restore_now(cluster, restore)
    cluster.wait_for(completed(restore), RECOVERY_TIMEOUT, f"Restore {restore} Completed")
    status = cluster.wait_for(
        restored_with_members(1, {primary, lost_replica}),
        RECOVERY_TIMEOUT,
        "the restored member serving writes alone",
    )
    check_rows(cluster, status, IN_BACKUP, 7002)
    assert status.get("phase") not in ("Failed", "Restoring"), status
    cluster.bring_back(primary)
    cluster.bring_back(lost_replica)
    status = cluster.wait_for(
        unless_failed(healthy(3)), RECOVERY_TIMEOUT, "a healthy 3-member cluster once they return"
    )
    check_rows(cluster, status, [*IN_BACKUP, 7002], 7003)
