"""Issue #10 item 10: data a re-clone or a restore replaces is kept aside outside the member's own
folder, so that deleting the member (DeleteMember keep_data=False) never deletes it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from local_helpers import LocalCluster

from pgherd.engine import actions as act


def test_kept_aside_data_outlives_the_deleted_member(local_cluster: Callable[..., LocalCluster]) -> None:
    cluster = local_cluster(2)
    primary, replica = cluster.name(0), cluster.name(1)
    marker = "pgherd-test-marker"
    (cluster.paths.member_data(replica) / marker).write_text("the replaced data\n")
    assert cluster.member(replica).kept_aside == 0

    cluster.apply(act.Rejoin(replica, primary, reclone=True, reason="test"))
    cluster.wait_idle(replica)
    cluster.wait_streaming(replica)
    kept = [Path(p) for p in cluster.platform.kept_aside_since(0)]
    assert len(kept) == 1 and (kept[0] / marker).exists()
    assert not (cluster.paths.member_data(replica) / marker).exists()  # a fresh clone
    assert cluster.member(replica).kept_aside == 1

    cluster.apply(act.DeleteMember(replica, keep_data=False, reason="scale down"))
    assert not cluster.paths.member_dir(replica).exists()
    assert (kept[0] / marker).read_text() == "the replaced data\n"
