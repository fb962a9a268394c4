"""Planned switchover under a write load: the chosen replica becomes primary, writes stop only briefly,
no acknowledged commit is lost, and the old primary follows the new one."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from e2e import manifests
from e2e.checks import assert_no_acknowledged_write_lost, in_recovery, wait_ids_on_member
from e2e.driver import Driver, NewCluster, healthy, replicas
from e2e.drivers.kube import KubeDriver
from e2e.workload import WriteLoad

pytestmark = pytest.mark.e2e

NAME = "e2e-switchover"


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, pg_version: int) -> Driver:
    return new_cluster(manifests.cluster(NAME, postgres_version=pg_version, instances=3, mode="quorum"))


@pytest.mark.parametrize("explicit_target", [True, False], ids=["to-member", "operator-chooses"])
def test_switchover_under_load(
    cluster: Driver, explicit_target: bool, record_property: Callable[[str, object], None]
) -> None:
    before = cluster.wait_for(healthy(3), 120, "a healthy cluster before the switchover")
    old = str(before["primary"])
    target = sorted(replicas(before))[-1] if explicit_target else None

    load = WriteLoad(cluster.rw_dsn).start()
    try:
        load.wait_for_acks(200)
        requested = time.monotonic()
        cluster.switchover(to=target)
        after = cluster.wait_for(
            lambda s: s.get("primary") not in (None, old) and healthy(3)(s),
            90,
            f"the switchover from {old} to {target or 'a replica'} to complete",
        )
        done = time.monotonic()
        load.wait_for_acks(200)
    finally:
        report = load.stop()

    new = str(after["primary"])
    if target is not None:
        assert new == target, f"switched over to {new}, asked for {target}"
    gap = report.max_gap(since=requested, until=done)
    record_property("switchover_unavailability_seconds", round(gap, 2))
    print(f"\nswitchover {old} -> {new}: longest write gap {gap:.2f} s; {report.summary()}")

    assert_no_acknowledged_write_lost(cluster, report)
    # Writes stopped only around the switchover: the failures form at most one window.
    windows = report.failure_windows()
    assert len(windows) <= 1, f"writes failed in {len(windows)} separate windows: {windows}"
    assert not in_recovery(cluster, new)
    assert in_recovery(cluster, old), f"the old primary {old} is not following {new}"
    wait_ids_on_member(cluster, old, report.acked_ids(), timeout=30)


def test_running_means_the_rw_service_routes_to_the_primary(cluster: Driver) -> None:
    """At the first status that says Running after a switchover, the -rw Service's EndpointSlice already
    routes to the new primary alone, and every member pod is Ready for the kubelet (a client that follows
    the status must not connect into nothing)."""
    if not isinstance(cluster, KubeDriver):
        pytest.skip("Kubernetes only: the sandbox's rw endpoint follows the primary at once")
    before = cluster.wait_for(healthy(3), 120, "a healthy cluster before the switchover")
    old = str(before["primary"])
    cluster.switchover()
    deadline = time.monotonic() + 90
    while True:
        status = cluster.get("postgresclusters.pgherd.io", NAME).get("status") or {}
        if status.get("phase") == "Running" and status.get("currentPrimary") not in (None, old):
            break
        assert time.monotonic() < deadline, f"no Running after the switchover from {old}: {status}"
        time.sleep(0.1)
    slices = cluster.kube.json(
        "-n", cluster.namespace, "get", "endpointslices", "-l", f"kubernetes.io/service-name={NAME}-rw"
    )["items"]
    pods = cluster.kube.json("-n", cluster.namespace, "get", "pods", "-l", f"pgherd.io/cluster={NAME}")[
        "items"
    ]
    routed = {
        str((e.get("targetRef") or {}).get("name"))
        for s in slices
        for e in s.get("endpoints") or []
        if (e.get("conditions") or {}).get("ready") is not False
    }
    new = status["currentPrimary"]
    assert routed == {new}, f"Running with {new} primary, the -rw Service routes to {sorted(routed)}"
    members = {p["metadata"]["name"]: p for p in pods if p["metadata"]["name"].startswith(f"{NAME}-")}
    unready = [
        name
        for name, pod in members.items()
        if not any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in pod["status"].get("conditions") or []
        )
    ]
    assert status.get("readyInstances") == 3 and not unready, (status.get("readyInstances"), unready)
