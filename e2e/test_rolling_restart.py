"""A restart-requiring parameter change under a write load: the ordered rolling restart (replicas first,
then a switchover to an updated replica, the old primary last), no failed transaction outside the
switchover window, no acknowledged commit lost, and every member running with the new setting."""

from __future__ import annotations

import time
from typing import Any

import pytest

from e2e import manifests
from e2e.checks import (
    StatusRecorder,
    assert_no_acknowledged_write_lost,
    in_recovery,
    postmaster_started,
    setting,
)
from e2e.driver import Driver, NewCluster, healthy, unless_failed
from e2e.workload import WriteLoad, WriteReport

pytestmark = pytest.mark.e2e

NAME = "e2e-rollout"
ROLLOUT_TIMEOUT = 240.0
# Margin around the change of primary seen in the status (sampled every ~0.3 s through a CLI or kubectl).
WINDOW_MARGIN = 3.0


@pytest.fixture(scope="module")
def manifest(pg_version: int) -> dict[str, Any]:
    return manifests.cluster(
        NAME, postgres_version=pg_version, instances=3, parameters={"max_connections": "100"}
    )


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, manifest: dict[str, Any]) -> Driver:
    return new_cluster(manifest)


def assert_failures_only_around_the_switchover(report: WriteReport, recorder: StatusRecorder) -> None:
    windows = report.failure_windows()
    changes = recorder.primary_changes()
    if not windows:
        return
    assert len(changes) == 1, f"expected one change of primary, saw {changes}; failures: {windows}"
    switched_at = changes[0][0]
    # A window belongs to the switchover when it overlaps [switched_at - margin, switched_at + margin]: it
    # ends when writes reach the new primary, about when the status first shows it.
    outside = [
        w for w in windows if w.end < switched_at - WINDOW_MARGIN or w.start > switched_at + WINDOW_MARGIN
    ]
    assert not outside, (
        f"writes failed outside the switchover window (primary change seen at {switched_at:.1f}): {outside};"
        f" all windows: {windows}"
    )


def test_rolling_restart_under_load(cluster: Driver, manifest: dict[str, Any]) -> None:
    before = cluster.wait_for(healthy(3), 120, "a healthy cluster before the rollout")
    old = str(before["primary"])
    members = sorted(m["name"] for m in before["members"])
    applied_at = time.time()

    load = WriteLoad(cluster.rw_dsn).start()
    with StatusRecorder(cluster) as recorder:
        try:
            load.wait_for_acks(200)
            cluster.apply(manifests.with_changes(manifest, parameters={"max_connections": "120"}))
            cluster.wait_for(
                unless_failed(
                    lambda s: (
                        healthy(3)(s)
                        and all(setting(cluster, m, "max_connections") == "120" for m in members)
                    )
                ),
                ROLLOUT_TIMEOUT,
                "every member to run with max_connections = 120",
            )
            load.wait_for_acks(200)
        finally:
            report = load.stop()

    print(
        f"\nrollout phases {recorder.phases()}; primary changes {recorder.primary_changes()}; {report.summary()}"
    )
    assert "Upgrading" in recorder.phases(), f"the phase never showed the rollout: {recorder.phases()}"
    assert_no_acknowledged_write_lost(cluster, report)
    assert_failures_only_around_the_switchover(report, recorder)

    # Order, read from PostgreSQL itself: every member restarted after the change, the old primary last,
    # after a switchover (it is a replica now).
    started = {m: postmaster_started(cluster, m) for m in members}
    assert all(t > applied_at for t in started.values()), f"not every member restarted: {started}"
    assert max(started, key=lambda m: started[m]) == old, (
        f"the old primary {old} was not restarted last: {started}"
    )
    assert in_recovery(cluster, old), f"{old} is still primary: the rollout did not switch over first"
