"""The operator (the sandbox's supervisor) killed in the middle of a rolling restart.

Killed while it restarts a replica: the cluster keeps serving writes while it is down, and a new operator
resumes the recorded operation instead of starting over (members restarted before the kill are not
restarted again, the old primary is still last). Killed in the middle of the primary's switchover (old
primary fenced, promotion ordered): writes wait for an operator, by design; the new one finishes the
handover with one primary and no acknowledged write lost."""

from __future__ import annotations

import time
from typing import Any

import pytest

from e2e import manifests
from e2e.checks import (
    assert_no_acknowledged_write_lost,
    in_recovery,
    postmaster_started,
    primaries,
    setting,
)
from e2e.driver import ClusterStatus, Driver, NewCluster, healthy, unless_failed
from e2e.workload import WriteLoad

pytestmark = pytest.mark.e2e

NAME = "e2e-resume"
OPERATOR_DOWN_SECONDS = 5.0


@pytest.fixture(scope="module")
def manifest(pg_version: int) -> dict[str, Any]:
    return manifests.cluster(
        NAME, postgres_version=pg_version, instances=3, parameters={"max_connections": "100"}
    )


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, manifest: dict[str, Any]) -> Driver:
    return new_cluster(manifest)


def _rollout(status: ClusterStatus) -> dict[str, Any] | None:
    operation = status.get("operation") or None
    return operation if operation and operation.get("kind") == "Rollout" else None


def _resume_until_rolled_out(cluster: Driver, members: list[str], value: str) -> ClusterStatus:
    """Start the operator again and wait for its resumed rollout to bring every member to ``value``."""
    cluster.resume_operator()
    return cluster.wait_for(
        unless_failed(
            lambda s: healthy(3)(s) and all(setting(cluster, m, "max_connections") == value for m in members)
        ),
        240,
        f"the resumed rollout to bring every member to max_connections = {value}",
    )


def test_operator_killed_mid_rollout_resumes_it(cluster: Driver, manifest: dict[str, Any]) -> None:
    before = cluster.wait_for(healthy(3), 120, "a healthy cluster before the rollout")
    old = str(before["primary"])
    members = sorted(m["name"] for m in before["members"])
    applied_at = time.time()

    load = WriteLoad(cluster.rw_dsn).start()
    try:
        load.wait_for_acks(200)
        # Killed once the first replica is done and the second one's restart was ordered.
        cluster.arm_operator_kill("restart:", done=1)
        cluster.apply(manifests.with_changes(manifest, parameters={"max_connections": "130"}))
        cluster.wait_operator_killed()
        frozen = cluster.status()
        operation = _rollout(frozen)
        assert operation is not None, f"the operation was not recorded before the operator died: {frozen}"
        assert str(operation.get("step")).startswith("restart:"), f"killed at the wrong step: {operation}"
        done_before_kill = [m for m in operation.get("done") or [] if m in members]
        assert done_before_kill and old not in done_before_kill, (
            f"unexpected progress at the kill: {operation}"
        )
        started_before = {name: postmaster_started(cluster, name) for name in done_before_kill}

        # Without its operator the cluster keeps serving writes, and nothing moves on.
        time.sleep(OPERATOR_DOWN_SECONDS)
        load.wait_for_acks(50, timeout=30)
        assert (_rollout(cluster.status()) or {}).get("kind") == "Rollout", "the recorded operation vanished"

        _resume_until_rolled_out(cluster, members, "130")
        load.wait_for_acks(200)
    finally:
        report = load.stop()

    print(f"\noperation at the kill: {operation}; {report.summary()}")
    assert_no_acknowledged_write_lost(cluster, report)
    started = {m: postmaster_started(cluster, m) for m in members}
    assert all(t > applied_at for t in started.values()), f"not every member restarted: {started}"
    for name, at in started_before.items():
        assert started[name] == at, f"{name} was restarted again after the resume: the rollout started over"
    assert max(started, key=lambda m: started[m]) == old, (
        f"the old primary {old} was not restarted last: {started}"
    )
    assert in_recovery(cluster, old), f"{old} is still primary: the resumed rollout did not switch over"
    assert len(report.failure_windows()) <= 1, (
        f"writes failed outside one switchover window:\n{report.describe_windows()}\n{cluster.describe()}"
    )


def test_operator_killed_mid_switchover_finishes_it(cluster: Driver, manifest: dict[str, Any]) -> None:
    before = cluster.wait_for(healthy(3), 120, "a healthy cluster before the second rollout")
    old = str(before["primary"])
    members = sorted(m["name"] for m in before["members"])

    load = WriteLoad(cluster.rw_dsn).start()
    try:
        load.wait_for_acks(200)
        # Killed right after it ordered the promotion of the old primary's successor.
        cluster.arm_operator_kill("switchover-promote")
        cluster.apply(manifests.with_changes(manifest, parameters={"max_connections": "160"}))
        cluster.wait_operator_killed()
        frozen = cluster.status()
        operation = _rollout(frozen)
        assert operation is not None and operation.get("step") == "switchover-promote", (
            f"killed at the wrong step: {frozen.get('operation')}"
        )
        time.sleep(OPERATOR_DOWN_SECONDS)
        writable = primaries(cluster, members)
        assert len(writable) <= 1, f"two members accept writes while the operator is down: {writable}"

        status = _resume_until_rolled_out(cluster, members, "160")
        load.wait_for_acks(200)
    finally:
        report = load.stop()

    print(f"\noperation at the kill: {operation}; {report.summary()}")
    assert_no_acknowledged_write_lost(cluster, report)
    assert status["primary"] == operation.get("target"), (
        f"the new primary is {status['primary']}, not the switchover's target {operation.get('target')}"
    )
    assert in_recovery(cluster, old), f"{old} is still primary after the resumed switchover"
    assert primaries(cluster, members) == [status["primary"]]
