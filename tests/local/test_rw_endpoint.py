"""The member the rw endpoint selects (ClusterView.rw_member): the sandbox's last SetPrimary, out of it
once fenced, and the same after the supervisor restarts (the engine re-points it when it differs)."""

from __future__ import annotations

from collections.abc import Callable

from local_helpers import LocalCluster

from pgherd.engine import actions as act
from pgherd.local.objects import ObjectStore
from pgherd.local.platform import LocalPlatform


def test_the_rw_endpoint_is_the_last_set_primary_until_fenced(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = local_cluster(2)
    primary = cluster.name(0)
    view, _ = cluster.platform.view(cluster.spec, None)
    assert view.rw_member is None  # never pointed yet

    cluster.apply(act.SetPrimary(primary, reason="first primary"))
    view, _ = cluster.platform.view(cluster.spec, None)
    assert view.rw_member == primary

    # A restarted supervisor (a new platform) finds the record, and the members' pods running.
    restarted = LocalPlatform(cluster.paths, cluster.platform.state, ObjectStore(cluster.paths))
    view, _ = restarted.view(cluster.spec, None)
    assert view.rw_member == primary
    assert {m.name for m in view.members if m.reachable} == {primary, cluster.name(1)}

    cluster.apply(act.Fence(primary, reason="failover"))
    view, _ = cluster.platform.view(cluster.spec, None)
    assert view.rw_member is None
    assert view.member(primary) is not None and view.member(primary).stopped  # type: ignore[union-attr]
