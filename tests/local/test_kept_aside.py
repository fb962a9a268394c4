"""Issue #10 item 10, on the members' agents: data a re-clone replaces is kept aside on the member's own
volume (`<volume>/kept/<stamp>`, as on a pod's PersistentVolume), counted in its view, listed for a
Restore's keptData, and gone only with the volume itself: deleting the member with keep_data keeps it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from local_helpers import LocalCluster

from pgherd.engine import actions as act


def test_a_reclone_keeps_the_old_data_on_the_members_volume(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = local_cluster(2)
    primary, replica = cluster.name(0), cluster.name(1)
    marker = "pgherd-test-marker"
    (cluster.paths.member_data(replica) / marker).write_text("the replaced data\n")
    assert cluster.member(replica).kept_aside == 0
    assert cluster.platform.kept_aside_since(0) == []

    cluster.apply(act.Rejoin(replica, primary, reclone=True, reason="test"))
    cluster.wait_idle(replica)
    cluster.wait_streaming(replica)
    kept = [Path(p) for p in cluster.platform.kept_aside_since(0)]
    assert len(kept) == 1 and (kept[0] / marker).exists()
    assert kept[0].parent == cluster.paths.member_kept(replica)  # on the member's volume
    assert not (cluster.paths.member_data(replica) / marker).exists()  # a fresh clone
    assert cluster.member(replica).kept_aside == 1

    # Deleting the member but not its volume (keep_data) keeps what was kept aside.
    cluster.apply(act.DeleteMember(replica, keep_data=True, reason="scale down"))
    assert replica not in cluster.platform.members
    assert (kept[0] / marker).read_text() == "the replaced data\n"
