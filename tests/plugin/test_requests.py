"""The requests' patches and refusals (pure), on documents the engine produced (phases.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from pgherd.plugin import manifests, requests
from pgherd.plugin.errors import PluginError

from . import phases

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def test_switchover_to_a_ready_replica_or_any() -> None:
    cluster = phases.running()["cluster"]
    asked = requests.switchover(cluster, "pg-1")
    assert asked.patch == {"metadata": {"annotations": {"pgherd.io/switchover-to": "pg-1"}}}
    assert (
        requests.switchover(cluster, None).patch["metadata"]["annotations"]["pgherd.io/switchover-to"]
        == "any"
    )


@pytest.mark.parametrize(
    ("build", "to", "refusal"),
    [
        (phases.running, "pg-0", "pg-0 is already the primary"),
        (phases.running, "pg-7", "has no member pg-7 (members: pg-0, pg-1, pg-2)"),
        (phases.degraded, "pg-1", "pg is Degraded, not Running: primary pg-0 unreachable"),
        (phases.paused, "pg-1", "pg is paused (spec.paused)"),
        (phases.creating, "pg-1", "has no primary yet (phase Creating)"),
        (phases.switching_over, "pg-2", "a switchover of pg to pg-1 is already asked for"),
    ],
)
def test_switchover_refusals(build, to: str, refusal: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PluginError, match=None) as refused:
        requests.switchover(build()["cluster"], to)
    assert refusal in str(refused.value)


def test_switchover_to_a_replica_that_is_not_ready_is_refused() -> None:
    cluster = phases.running()["cluster"]
    cluster["status"]["members"][1]["ready"] = False
    with pytest.raises(PluginError, match="pg-1 is not a ready replica"):
        requests.switchover(cluster, "pg-1")


def test_rolling_restart_writes_the_time_and_is_refused_mid_operation() -> None:
    asked = requests.rolling_restart(phases.running()["cluster"], NOW)
    assert asked.patch == {"metadata": {"annotations": {"pgherd.io/restart": "2026-01-01T12:00:00Z"}}}
    assert "replicas first" in asked.said
    # During a rollout a new request replans it; during another operation it waits for its end.
    requests.rolling_restart(phases.upgrading()["cluster"], NOW)
    with pytest.raises(PluginError, match="in the middle of a Failover"):
        requests.rolling_restart(phases.failing_over()["cluster"], NOW)
    with pytest.raises(PluginError, match="paused"):
        requests.rolling_restart(phases.paused()["cluster"], NOW)


def test_one_member_restart() -> None:
    assert requests.member_restart(phases.running()["cluster"], "pg-1") == "pg-1"
    with pytest.raises(PluginError, match="has no member pg-9"):
        requests.member_restart(phases.running()["cluster"], "pg-9")
    with pytest.raises(PluginError, match="in the middle of a Switchover"):
        requests.member_restart(phases.switching_over()["cluster"], "pg-2")


def test_pause_and_resume_are_idempotent() -> None:
    running = phases.running()["cluster"]
    asked = requests.pause(running, True)
    assert asked is not None and asked.patch == {"spec": {"paused": True}}
    assert requests.pause(running, False) is None
    paused = phases.paused()["cluster"]
    assert requests.pause(paused, True) is None
    resumed = requests.pause(paused, False)
    assert resumed is not None and resumed.patch == {"spec": {"paused": False}}


def test_upgrade_confirm_and_rollback_name_the_major() -> None:
    kept = phases.old_major_kept()["cluster"]
    confirm = requests.upgrade_confirm(kept)
    assert confirm.patch == {"metadata": {"annotations": {"pgherd.io/confirm-upgrade": "17"}}}
    assert "pg-2 is kept on PostgreSQL 16" in confirm.said
    rollback = requests.upgrade_rollback(kept)
    assert rollback.patch == {"metadata": {"annotations": {"pgherd.io/rollback-upgrade": "17"}}}
    upgrading = phases.upgrading_major()["cluster"]
    assert (
        requests.upgrade_confirm(upgrading).patch["metadata"]["annotations"]["pgherd.io/confirm-upgrade"]
        == "17"
    )


def test_upgrade_requests_are_refused_when_no_upgrade_waits() -> None:
    for ask in (requests.upgrade_confirm, requests.upgrade_rollback):
        with pytest.raises(PluginError, match="no upgrade of pg waits for a") as refused:
            ask(phases.running()["cluster"])
        assert "runs PostgreSQL 16" in str(refused.value)


def test_backup_and_restore_manifests() -> None:
    cluster = phases.running()["cluster"]
    body = manifests.backup(cluster, "pg-now", "primary")
    assert body == {
        "apiVersion": "pgherd.io/v1alpha1",
        "kind": "Backup",
        "metadata": {"name": "pg-now", "namespace": "apps"},
        "spec": {"cluster": {"name": "pg"}, "target": "primary"},
    }
    with pytest.raises(PluginError, match="no backup store"):
        manifests.backup(phases.degraded()["cluster"], "x")
    done = phases.backup_object("pg-nightly-2", "Completed", NOW, backupId="20260101T030000")
    restore = manifests.restore(
        cluster, "r", backup=done, backup_name="pg-nightly-2", time="2026-01-01T10:00:00Z"
    )
    assert restore["spec"] == {
        "cluster": {"name": "pg"},
        "backup": "pg-nightly-2",
        "target": {"time": "2026-01-01T10:00:00Z"},
    }
    by_id = manifests.restore(cluster, "r", snapshot="20260101T030000", lsn="0/3000060")
    assert by_id["spec"] == {
        "cluster": {"name": "pg"},
        "snapshotId": "20260101T030000",
        "target": {"lsn": "0/3000060"},
    }


@pytest.mark.parametrize(
    ("kwargs", "refusal"),
    [
        ({"backup_name": "gone"}, "Backup 'gone' not found"),
        (
            {"backup_name": "failed", "backup": phases.backup_object("failed", "Failed")},
            "no completed snapshot",
        ),
        (
            {
                "backup_name": "old",
                "backup": phases.backup_object("old", "Expired", expiredAt="2026-01-01T00:00:00Z"),
            },
            "Expired",
        ),
        ({"snapshot": "x", "time": "yesterday"}, "--time 'yesterday'"),
        ({"snapshot": "x", "lsn": "3000060"}, "not a PostgreSQL LSN"),
        ({}, "name one of --backup and --snapshot"),
    ],
)
def test_restore_refusals(kwargs: dict[str, object], refusal: str) -> None:
    with pytest.raises(PluginError) as refused:
        manifests.restore(phases.running()["cluster"], "r", **kwargs)  # type: ignore[arg-type]
    assert refusal in str(refused.value)
