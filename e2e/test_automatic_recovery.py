"""Automatic recovery: a cluster with scheduled backups and `recovery.onQuorumLoss: RestoreFromBackup`
loses its primary and one replica of three, data wiped, and comes back on its own. The engine reports
QuorumLost, waits out its grace, restores the latest Completed Backup that its schedule made, and
rebuilds the other members from it; the test applies neither a Backup nor a Restore."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest

from e2e import manifests
from e2e.checks import StatusRecorder, insert_ids, wait_ids_on_member
from e2e.driver import ClusterStatus, Driver, NewCluster, ObjectStatus, healthy, replicas, unless_failed
from e2e.workload import present_ids

pytestmark = pytest.mark.e2e

NAME = "e2e-autorecover"
SCHEDULED = re.compile(rf"^{re.escape(NAME)}-(\d{{12}})$")  # <cluster>-<YYYYmmddHHMM>, the due time (UTC)
IN_BACKUP = list(range(1, 301))
# The first run is due at the next minute boundary after the engine first saw the schedule, and the one
# before the rows were written does not count: up to two minutes, plus the snapshot and its read-back.
BACKUP_TIMEOUT = 180.0
# The engine's grace before restoring is max(15 s, 3 x detection); the test sees QuorumLost a poll or
# two after the engine's clock started, so it sees Recovering at least this long after QuorumLost.
GRACE_SEEN = 10.0
RECOVERY_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, pg_version: int) -> Driver:
    return new_cluster(
        manifests.cluster(
            NAME,
            postgres_version=pg_version,
            instances=3,
            mode="quorum",
            backup_schedule="* * * * *",
            keep_last=2,
            on_quorum_loss="RestoreFromBackup",
        )
    )


def due_at(backup: ObjectStatus) -> datetime | None:
    """When a scheduled Backup was due (from its name), None for any other Backup."""
    found = SCHEDULED.match(str(backup.get("name")))
    return datetime.strptime(found.group(1), "%Y%m%d%H%M").replace(tzinfo=UTC) if found else None


def scheduled_after(status: ClusterStatus, moment: datetime) -> list[ObjectStatus]:
    """The Backups the schedule created for a run due after `moment`: their snapshot began after it."""
    return [b for b in status.get("backups") or [] if (due_at(b) or moment) > moment]


def test_majority_loss_recovers_on_its_own_from_a_scheduled_backup(cluster: Driver) -> None:
    insert_ids(cluster.rw_dsn(), IN_BACKUP)
    written = datetime.now(UTC)

    def verified_after_the_rows(status: ClusterStatus) -> bool:
        runs = scheduled_after(status, written)
        broken = [b for b in runs if b.get("phase") == "Failed" or b.get("verified") is False]
        assert not broken, f"a scheduled Backup failed or did not read back: {broken}"
        return any(b.get("phase") == "Completed" and b.get("verified") is True for b in runs)

    status = cluster.wait_for(
        verified_after_the_rows,
        BACKUP_TIMEOUT,
        "a scheduled Backup, run after the rows were written, Completed and verified",
    )
    assert not status.get("restores"), f"a Restore exists before the failure: {status.get('restores')}"
    status = cluster.wait_for(healthy(3), 60, "a healthy cluster before the majority failure")
    primary = str(status["primary"])
    lost_replica = sorted(replicas(status))[1]

    with StatusRecorder(cluster) as recorder:
        # Both at once: one after the other, the first loss would be failed over before the second.
        with ThreadPoolExecutor(max_workers=2) as pool:
            for done in [pool.submit(cluster.kill, name, True) for name in (primary, lost_replica)]:
                done.result()
        cluster.wait_for(lambda s: s.get("phase") == "QuorumLost", 60, "phase QuorumLost")
        status = cluster.wait_for(
            unless_failed(healthy(3)), RECOVERY_TIMEOUT, "a healthy 3-member cluster, recovered on its own"
        )

    # The engine's own recovery: phase Recovering (a Restore object's would be Restoring), after its
    # grace, from a Backup its schedule made after the rows were written; and no Restore object at all.
    assert not status.get("restores"), f"a Restore object exists: {status.get('restores')}"
    phases = recorder.phases()
    waiting = [
        str(s.status.get("message")) for s in recorder.samples if s.status.get("phase") == "QuorumLost"
    ]
    assert any("restoring from backup in" in m for m in waiting), f"QuorumLost said: {sorted(set(waiting))}"
    assert "Recovering" in phases and "Restoring" not in phases, f"phases seen: {phases}"
    lost_at = next(s.at for s in recorder.samples if s.status.get("phase") == "QuorumLost")
    recovering = [s for s in recorder.samples if s.status.get("phase") == "Recovering"]
    assert recovering[0].at - lost_at >= GRACE_SEEN, (
        f"restored {recovering[0].at - lost_at:.1f} s after QuorumLost was seen, within the engine's grace"
    )
    operations = [s.status.get("operation") or {} for s in recovering]
    assert all(op.get("kind") == "Recovery" for op in operations if op), operations
    chosen = {str(op["backup"]) for op in operations if op.get("backup")}
    usable = {
        b.get("name")
        for b in scheduled_after(status, written)
        if b.get("phase") == "Completed" and b.get("verified") is not False  # True, or still being read back
    }
    assert chosen and chosen <= usable, f"recovered from {chosen}, not one of the scheduled Backups {usable}"
    print(
        f"\nrecovered from {', '.join(sorted(chosen))}: Recovering seen {recovering[0].at - lost_at:.1f} s"
        f" after QuorumLost, healthy {recorder.samples[-1].at - lost_at:.1f} s after it; phases {phases}"
    )

    assert set(IN_BACKUP) <= present_ids(cluster.rw_dsn()), "the scheduled Backup's rows are missing"
    for m in status["members"]:
        wait_ids_on_member(cluster, m["name"], IN_BACKUP, timeout=60)
    insert_ids(cluster.rw_dsn(), [6000])
