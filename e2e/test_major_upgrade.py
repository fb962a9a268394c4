"""Major-version upgrades in place (docs/upgrades.md), on every driver, under a write load.

One cluster: a preflight that pg_upgrade --check refuses (a reg* column): nothing stops, nothing
changes; then, the column gone and the upgrade retried (pgherd.io/retry-upgrade), the upgrade itself:
no acknowledged write lost, the write downtime printed, every member on the new major once confirmed,
and a Backup taken after it restored in place; then a Backup taken before it restored on the old major,
which the cluster stays on until an upgrade is asked for again.
Another: pg_upgrade failing once writes stopped (its new cluster broken while the operator is frozen
right before the upgrade step): rolled back to the replica kept on the old major, nothing acknowledged
lost, writes back on the old major; then a retry with the operator killed in the middle of it, which a
new operator finishes from the recorded operation.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from e2e import manifests
from e2e.checks import assert_no_acknowledged_write_lost, execute, scalar
from e2e.driver import (
    ClusterStatus,
    Driver,
    NewCluster,
    backup_phase,
    condition,
    healthy,
    restore_phase,
    unless_failed,
)
from e2e.workload import WriteLoad

pytestmark = pytest.mark.e2e

UPGRADE_TIMEOUT = 420  # a Backup, the checks, the upgrade, the rebuilds
ACKS_TIMEOUT = 90  # writes flowing again once the new primary is ready (kube-proxy applies its endpoint)
CONFIRM = "pgherd.io/confirm-upgrade"
RETRY = "pgherd.io/retry-upgrade"
BEFORE = "before-upgrade"  # a Backup of the old major


def _reached(status: ClusterStatus) -> tuple[str | None, str | None]:
    found = condition(status, "PostgresVersionReached") or {}
    return found.get("status"), found.get("reason")


def _versions(status: ClusterStatus) -> dict[str, str | None]:
    return {m["name"]: m.get("version") for m in status.get("members") or []}


def _on(major: int, instances: int = 3):  # type: ignore[no-untyped-def]
    def every_member(status: ClusterStatus) -> bool:
        versions = _versions(status)
        return (
            healthy(instances)(status)
            and len(versions) == instances
            and all(str(v).startswith(f"{major}.") for v in versions.values())
        )

    return every_member


def _upgraded(major: int):  # type: ignore[no-untyped-def]
    """The upgrade's operation is over, the cluster on ``major`` with one replica kept on the old one."""

    def done(status: ClusterStatus) -> bool:
        primary = next((m for m in status.get("members") or [] if m["name"] == status.get("primary")), None)
        return (
            status.get("postgresVersion") == major
            and not status.get("operation")
            and status.get("phase") == "Running"
            and _reached(status) == ("True", "OldMajorKept")
            and primary is not None
            and bool(primary.get("ready"))
        )

    return done


@pytest.fixture(scope="module")
def upgraded_cluster(
    new_cluster: NewCluster, upgrade_majors: tuple[int, int]
) -> tuple[Driver, dict[str, Any]]:
    old, _ = upgrade_majors
    manifest = manifests.cluster("e2e-upgrade", postgres_version=old, instances=3)
    return new_cluster(manifest), manifest


def test_a_refused_preflight_leaves_the_cluster_serving_writes(
    upgraded_cluster: tuple[Driver, dict[str, Any]], upgrade_majors: tuple[int, int]
) -> None:
    cluster, manifest = upgraded_cluster
    old, new = upgrade_majors
    execute(cluster.rw_dsn(), "CREATE TABLE upgrade_blocker (p regproc)")  # pg_upgrade cannot carry reg*
    load = WriteLoad(cluster.rw_dsn).start()
    try:
        load.wait_for_acks(50)
        cluster.apply(manifests.with_changes(manifest, postgresVersion=new))
        status = cluster.wait_for(
            lambda s: _reached(s) == ("False", "UpgradeRefused"), UPGRADE_TIMEOUT, "the upgrade refused"
        )
        message = (condition(status, "PostgresVersionReached") or {}).get("message", "")
        assert "pg_upgrade --check" in message and "reg" in message, message
        load.wait_for_acks(load.acked_count() + 50)
    finally:
        report = load.stop()
    assert status.get("postgresVersion") == old and status.get("phase") == "Running", status
    assert all(str(v).startswith(f"{old}.") for v in _versions(status).values()), status
    assert not report.failure_windows(), f"writes failed during a refused preflight: {report.summary()}"
    print(f"\nrefused preflight: longest write gap {report.max_gap():.2f} s ({report.summary()})")
    assert_no_acknowledged_write_lost(cluster, report)
    execute(cluster.rw_dsn(), "DROP TABLE upgrade_blocker")


def test_upgrade_under_write_load_then_a_backup_restores(
    upgraded_cluster: tuple[Driver, dict[str, Any]], upgrade_majors: tuple[int, int]
) -> None:
    cluster, _ = upgraded_cluster
    old, new = upgrade_majors
    # A Backup of the old major first (restored on it by the next test), with a mark in its data.
    execute(cluster.rw_dsn(), "CREATE TABLE on_the_old_major AS SELECT 1 AS x")
    cluster.apply(manifests.backup(BEFORE, "e2e-upgrade"))
    status = cluster.wait_for(
        lambda s: backup_phase(s, BEFORE) in ("Completed", "Failed"), 300, "the Backup before the upgrade"
    )
    assert backup_phase(status, BEFORE) == "Completed", status.get("backups")
    load = WriteLoad(cluster.rw_dsn).start()
    try:
        load.wait_for_acks(50)
        cluster.annotate(RETRY, "after-dropping-the-reg-column")
        status = cluster.wait_for(unless_failed(_upgraded(new)), UPGRADE_TIMEOUT, f"the upgrade to {new}")
        load.wait_for_acks(load.acked_count() + 100, timeout=ACKS_TIMEOUT)
    finally:
        report = load.stop()
    print(
        f"\nupgrade {old} -> {new} under load: longest write gap {report.max_gap():.2f} s ({report.summary()})"
    )
    assert_no_acknowledged_write_lost(cluster, report)
    versions = _versions(status)
    kept = [name for name, v in versions.items() if not str(v).startswith(f"{new}.")]
    assert len(kept) <= 1, versions  # the one kept on the old major is stopped: no version shown
    cluster.annotate(CONFIRM, str(new))
    status = cluster.wait_for(unless_failed(_on(new)), UPGRADE_TIMEOUT, f"every member on PostgreSQL {new}")
    assert _reached(status) == ("True", "Reached"), status.get("conditions")

    # A Backup of the new major, restored in place: the rows written before and after the upgrade.
    rows = scalar(cluster.rw_dsn(), "SELECT count(*) FROM e2e_writes")
    cluster.apply(manifests.backup("after-upgrade", "e2e-upgrade"))
    status = cluster.wait_for(
        lambda s: backup_phase(s, "after-upgrade") in ("Completed", "Failed"),
        300,
        "the Backup after the upgrade",
    )
    assert backup_phase(status, "after-upgrade") == "Completed", status.get("backups")
    execute(cluster.rw_dsn(), "INSERT INTO e2e_writes (id) VALUES (-1)")  # after the snapshot, archived
    cluster.apply(manifests.restore("back-to-it", "e2e-upgrade", backup_name="after-upgrade"))
    status = cluster.wait_for(
        lambda s: restore_phase(s, "back-to-it") in ("Completed", "Failed"), 420, "the Restore of it"
    )
    assert restore_phase(status, "back-to-it") == "Completed", status.get("restores")
    cluster.wait_for(unless_failed(_on(new)), 300, "the restored cluster healthy on the new major")
    assert scalar(cluster.rw_dsn(), "SELECT count(*) FROM e2e_writes") >= rows + 1


def _backup(status: ClusterStatus, name: str) -> dict[str, Any]:
    return dict(next((b for b in status.get("backups") or [] if b.get("name") == name), {}))


def test_a_backup_of_the_old_major_restores_on_it_and_stays_until_a_retry(
    upgraded_cluster: tuple[Driver, dict[str, Any]], upgrade_majors: tuple[int, int]
) -> None:
    cluster, _ = upgraded_cluster
    old, new = upgrade_majors
    status = cluster.status()
    before, after = _backup(status, BEFORE), _backup(status, "after-upgrade")
    assert str(before.get("postgresVersion")).startswith(f"{old}."), before  # listed, of the old major
    assert str(after.get("postgresVersion")).startswith(f"{new}."), after
    execute(cluster.rw_dsn(), "CREATE TABLE on_the_new_major AS SELECT 1 AS x")
    cluster.apply(manifests.restore("to-the-old-major", "e2e-upgrade", backup_name=BEFORE))
    status = cluster.wait_for(
        lambda s: restore_phase(s, "to-the-old-major") in ("Completed", "Failed"), 420, "the Restore of it"
    )
    assert restore_phase(status, "to-the-old-major") == "Completed", status.get("restores")
    status = cluster.wait_for(unless_failed(_on(old)), 300, f"every member on PostgreSQL {old}")
    # Restored by the old major's programs, and kept on it although the spec says the new major: whoever
    # restores data of the old major may want to stay there.
    assert status.get("postgresVersion") == old and _reached(status) == ("False", "Restored"), status
    dsn = cluster.rw_dsn()
    assert str(scalar(dsn, "SHOW server_version")).startswith(f"{old}.")
    # The old major's data to the end of its archive: what was written before the upgrade, nothing
    # written on the new major.
    assert scalar(dsn, "SELECT count(*) FROM on_the_old_major") == 1
    assert scalar(dsn, "SELECT to_regclass('on_the_new_major') IS NULL") is True
    assert scalar(dsn, "SELECT count(*) FROM e2e_writes WHERE id = -1") == 0  # the new major's row
    time.sleep(5)
    assert cluster.status().get("postgresVersion") == old  # never upgraded again on its own

    # Asked again: upgraded, with its way back although pgherd.io/confirm-upgrade still holds the value
    # that confirmed the first upgrade (it confirms this one once set again).
    cluster.annotate(RETRY, "after-the-restore")
    cluster.wait_for(unless_failed(_upgraded(new)), UPGRADE_TIMEOUT, f"the upgrade to {new} again")
    time.sleep(5)
    assert _reached(cluster.status()) == ("True", "OldMajorKept"), cluster.status().get("conditions")
    cluster.annotate(CONFIRM, None)
    time.sleep(3)
    cluster.annotate(CONFIRM, f"{new}")
    cluster.wait_for(unless_failed(_on(new)), UPGRADE_TIMEOUT, f"every member on PostgreSQL {new} again")
    assert scalar(cluster.rw_dsn(), "SELECT count(*) FROM on_the_old_major") == 1


@pytest.fixture(scope="module")
def rollback_cluster(
    new_cluster: NewCluster, upgrade_majors: tuple[int, int]
) -> tuple[Driver, dict[str, Any]]:
    old, _ = upgrade_majors
    manifest = manifests.cluster("e2e-upgrade-back", postgres_version=old, instances=3)
    return new_cluster(manifest), manifest


def test_a_failure_after_writes_stopped_rolls_back_to_the_kept_replica(
    rollback_cluster: tuple[Driver, dict[str, Any]], upgrade_majors: tuple[int, int]
) -> None:
    cluster, manifest = rollback_cluster
    old, new = upgrade_majors
    primary = str(cluster.status().get("primary"))
    load = WriteLoad(cluster.rw_dsn).start()
    try:
        load.wait_for_acks(50)
        cluster.arm_operator_kill("upgrade")  # frozen once writes stopped, before pg_upgrade is ordered
        cluster.apply(manifests.with_changes(manifest, postgresVersion=new))
        cluster.wait_operator_killed(timeout=UPGRADE_TIMEOUT)
        frozen = cluster.status()
        operation = frozen.get("operation") or {}
        assert operation.get("kind") == "MajorUpgrade" and operation.get("step") == "upgrade", operation
        upgraded, kept = str(operation.get("source")), str(operation.get("kept"))
        frozen_at = time.monotonic()
        cluster.break_upgrade(upgraded, new)
        cluster.resume_operator()
        resumed_at = time.monotonic()
        status = cluster.wait_for(
            lambda s: _reached(s) == ("False", "RolledBack") and s.get("primary") == kept,
            UPGRADE_TIMEOUT,
            f"the rollback to {kept}",
        )
        status = cluster.wait_for(unless_failed(_on(old)), UPGRADE_TIMEOUT, f"every member back on {old}")
        before = load.acked_count()
        load.wait_for_acks(before + 100, timeout=ACKS_TIMEOUT)  # writes go on, on the old major
    finally:
        report = load.stop()
    assert status.get("postgresVersion") == old, status
    assert primary == upgraded != kept
    message = (condition(status, "PostgresVersionReached") or {}).get("message", "")
    assert "pg_upgrade" in message, message
    print(
        f"\nrollback: longest write gap {report.max_gap():.2f} s, the operator frozen for"
        f" {resumed_at - frozen_at:.1f} s of it ({report.summary()})"
    )
    assert_no_acknowledged_write_lost(cluster, report)
    # The spec still says the new major: nothing is retried until asked.
    time.sleep(5)
    assert cluster.status().get("postgresVersion") == old


def test_an_operator_killed_mid_upgrade_is_finished_by_the_next_one(
    rollback_cluster: tuple[Driver, dict[str, Any]], upgrade_majors: tuple[int, int]
) -> None:
    cluster, _ = rollback_cluster
    _, new = upgrade_majors
    load = WriteLoad(cluster.rw_dsn).start()
    try:
        load.wait_for_acks(50)
        cluster.arm_operator_kill("rebuild")  # the new major serves writes, the replicas not rebuilt yet
        cluster.annotate(RETRY, "the new cluster is whole again")
        cluster.wait_operator_killed(timeout=UPGRADE_TIMEOUT)
        cluster.resume_operator()
        cluster.wait_for(unless_failed(_upgraded(new)), UPGRADE_TIMEOUT, f"the resumed upgrade to {new}")
        load.wait_for_acks(load.acked_count() + 100, timeout=ACKS_TIMEOUT)
    finally:
        report = load.stop()
    assert_no_acknowledged_write_lost(cluster, report)
    cluster.annotate(CONFIRM, str(new))
    cluster.wait_for(unless_failed(_on(new)), UPGRADE_TIMEOUT, f"every member on PostgreSQL {new}")
