"""The automatic recovery (`recovery.onQuorumLoss: RestoreFromBackup`) finishes whatever the lost members
do meanwhile (e2e/test_automatic_recovery.py: they restart empty during the grace).

1. They never come back (wiped, their pods cannot be scheduled): the cluster recovers on the member it can
   have and serves writes; once they can start again they are rebuilt from it.
2. They are down through the grace and come back the moment the recovery starts (while it fences and
   restores): they stay fenced, and are rebuilt from the restored primary.
"""

from __future__ import annotations

import pytest

from e2e import manifests
from e2e.checks import StatusRecorder, insert_ids
from e2e.driver import Driver, NewCluster, backup_phase, healthy, unless_failed
from e2e.recovery_faults import RECOVERY_TIMEOUT, check_rows, lose_majority, restored_with_members

pytestmark = pytest.mark.e2e

NAME = "e2e-autorecover-faults"
BACKUP = "e2e-autorecover-faults-b1"
IN_BACKUP = list(range(1, 201))


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, pg_version: int) -> Driver:
    driver = new_cluster(
        manifests.cluster(
            NAME, postgres_version=pg_version, instances=3, mode="quorum", on_quorum_loss="RestoreFromBackup"
        )
    )
    insert_ids(driver.rw_dsn(), IN_BACKUP)
    driver.apply(manifests.backup(BACKUP, NAME))
    status = driver.wait_for(
        lambda s: backup_phase(s, BACKUP) in ("Completed", "Failed"), 180, f"Backup {BACKUP}"
    )
    assert backup_phase(status, BACKUP) == "Completed", status.get("backups")
    return driver


def test_recovers_on_its_own_with_members_that_never_return(cluster: Driver) -> None:
    with StatusRecorder(cluster) as recorder:
        primary, lost_replica, _ = lose_majority(cluster, wipe_primary=True, wipe_replica=True)
        status = cluster.wait_for(
            restored_with_members(1, {primary, lost_replica}),
            RECOVERY_TIMEOUT,
            "the cluster recovered on its own, on the member it can have",
        )
    phases = recorder.phases()
    assert "Recovering" in phases and "Failed" not in phases, f"phases seen: {phases}"
    check_rows(cluster, status, IN_BACKUP, 8001)
    cluster.bring_back(primary)
    cluster.bring_back(lost_replica)
    status = cluster.wait_for(
        unless_failed(healthy(3)), RECOVERY_TIMEOUT, "a healthy 3-member cluster once they return"
    )
    check_rows(cluster, status, [*IN_BACKUP, 8001], 8002)


def test_members_returning_while_it_recovers(cluster: Driver) -> None:
    with StatusRecorder(cluster) as recorder:
        primary, lost_replica, _ = lose_majority(cluster, wipe_primary=True, wipe_replica=True)
        cluster.wait_for(lambda s: s.get("phase") == "Recovering", 120, "phase Recovering")
        cluster.bring_back(primary)
        cluster.bring_back(lost_replica)
        status = cluster.wait_for(
            unless_failed(healthy(3)), RECOVERY_TIMEOUT, "a healthy 3-member cluster, recovered on its own"
        )
    phases = recorder.phases()
    assert "Recovering" in phases and "Failed" not in phases, f"phases seen: {phases}"
    check_rows(cluster, status, IN_BACKUP, 8003)
