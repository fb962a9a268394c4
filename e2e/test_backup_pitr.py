"""A Backup, then an in-place point-in-time Restore to an instant between two writes: the rows written
before that instant are back on every member, the rows written after it are not, and the restored
cluster takes writes again.

The store is reached over HTTPS and verified by a private CA (spec.backup.store.s3.endpointCA), on every
driver the suite runs by default: the snapshot Job, the archiver and the restore all verify it."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta

import pytest

from e2e import manifests
from e2e.checks import execute, insert_ids, missing_on, scalar, wait_ids_on_member
from e2e.driver import Driver, NewCluster, backup_phase, healthy, restore_phase, unless_failed
from e2e.workload import present_ids

pytestmark = pytest.mark.e2e

NAME = "e2e-pitr"
BACKUP = "e2e-pitr-base"
RESTORE = "e2e-pitr-undo"
BEFORE_BACKUP = list(range(1, 101))
BATCH_A = list(range(1001, 1101))  # written before the recovery target
BATCH_B = list(range(2001, 2101))  # written after it: must not come back
BACKUP_TIMEOUT = 180.0
RESTORE_TIMEOUT = 300.0
ARCHIVE_TIMEOUT = 90.0


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, pg_version: int) -> Driver:
    return new_cluster(manifests.cluster(NAME, postgres_version=pg_version, instances=3))


def server_time(dsn: str) -> datetime:
    value = scalar(dsn, "SELECT clock_timestamp()")
    assert isinstance(value, datetime)
    return value.astimezone(UTC)


def wait_archived_through(dsn: str, lsn: str) -> None:
    """Wait until the WAL segment holding `lsn` is in the archive (pg_stat_archiver is readable by all)."""
    # Fill the current segment (16 MB of WAL) so that PostgreSQL switches and archives it now rather than
    # at archive_timeout; the application role may not call pg_switch_wal().
    execute(
        dsn,
        "CREATE TABLE e2e_filler AS SELECT g AS id, repeat('x', 1000) AS pad FROM generate_series(1, 18000) AS g",
    )
    segment = str(scalar(dsn, "SELECT pg_walfile_name(%s::pg_lsn)", (lsn,)))
    deadline = time.monotonic() + ARCHIVE_TIMEOUT
    archived = ""
    while archived[-16:] < segment[-16:] or archived[:8] != segment[:8]:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"WAL segment {segment} not archived after {ARCHIVE_TIMEOUT:.0f} s (last: {archived})"
            )
        time.sleep(0.5)
        archived = str(scalar(dsn, "SELECT coalesce(last_archived_wal, '') FROM pg_stat_archiver"))


def test_the_store_is_https_verified_by_its_private_ca(cluster: Driver) -> None:
    if cluster.name == "kind" and not os.environ.get("PGHERD_E2E_S3_CA_SECRET"):
        pytest.skip("the kind driver's store is the user's: PGHERD_E2E_S3_CA_SECRET names its private CA")
    store = cluster.backup_store()
    assert str(store["endpoint"]).startswith("https://"), store
    assert store.get("endpointCA", {}).get("secretName"), store


def test_backup_completes(cluster: Driver) -> None:
    insert_ids(cluster.rw_dsn(), BEFORE_BACKUP)
    cluster.apply(manifests.backup(BACKUP, NAME))
    status = cluster.wait_for(
        lambda s: backup_phase(s, BACKUP) in ("Completed", "Failed"), BACKUP_TIMEOUT, f"Backup {BACKUP}"
    )
    assert backup_phase(status, BACKUP) == "Completed", status.get("backups")
    found = next(b for b in status["backups"] if b["name"] == BACKUP)
    assert found.get("backupId"), found


def test_pitr_restore_to_a_point_between_two_writes(cluster: Driver) -> None:
    rw = cluster.rw_dsn()
    insert_ids(rw, BATCH_A)
    # The target: a whole second strictly after batch A committed and before batch B begins.
    target = server_time(rw).replace(microsecond=0) + timedelta(seconds=1)
    while server_time(rw) < target + timedelta(seconds=1):
        time.sleep(0.1)
    insert_ids(rw, BATCH_B)
    after_b = str(scalar(rw, "SELECT pg_current_wal_lsn()"))
    wait_archived_through(rw, after_b)

    cluster.apply(
        manifests.restore(RESTORE, NAME, backup_name=BACKUP, time=target.strftime("%Y-%m-%dT%H:%M:%SZ"))
    )
    status = cluster.wait_for(
        lambda s: restore_phase(s, RESTORE) in ("Completed", "Failed"),
        RESTORE_TIMEOUT,
        f"Restore {RESTORE} to finish",
    )
    assert restore_phase(status, RESTORE) == "Completed", status.get("restores")
    status = cluster.wait_for(
        unless_failed(healthy(3)), RESTORE_TIMEOUT, "a healthy cluster after the restore"
    )

    present = present_ids(cluster.rw_dsn())
    assert set(BEFORE_BACKUP) <= present, "rows from before the backup are missing after the restore"
    assert set(BATCH_A) <= present, (
        f"rows written before the target {target} are missing: {missing_on(cluster.rw_dsn(), BATCH_A)[:10]}"
    )
    assert not set(BATCH_B) & present, f"rows written after the target {target} came back"
    for m in status["members"]:
        wait_ids_on_member(cluster, m["name"], BEFORE_BACKUP + BATCH_A, timeout=60)
        assert not set(BATCH_B) & present_ids(cluster.member_dsn(m["name"])), (
            f"{m['name']} holds rows from after the target"
        )
    # The restored cluster is writable again (on a new timeline).
    insert_ids(cluster.rw_dsn(), [3001])
