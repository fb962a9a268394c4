"""The primary cut off by a partition, as a real one behaves (tests/engine/model.py: silence on the
replicas' streams, which still say streaming until wal_receiver_timeout; the kubelet still reaches the
pod): it is replaced about as fast as a crashed one, in quorum and in async mode; in quorum mode it
acknowledges nothing once cut off; never two writers the engine routes to. On the model before silence
was modelled, the replicas' receivers knew at once: kinder than PostgreSQL."""

from __future__ import annotations

import pytest

from pgherd.api.cluster import Phase, PrimaryUpdateMethod
from pgherd.engine.view import Role

from .test_properties import ClusterMachine


def _cluster(quorum: bool) -> ClusterMachine:
    state = ClusterMachine()
    state.setup(instances=3, quorum=quorum, method=PrimaryUpdateMethod.SWITCHOVER, restore_on_loss=False)
    assert state.last is not None and state.last.phase is Phase.RUNNING
    return state


@pytest.mark.parametrize("quorum", [True, False], ids=["quorum", "async"])
def test_a_primary_cut_off_from_everyone_is_replaced_within_detection_and_its_heartbeat(quorum: bool) -> None:
    state = _cluster(quorum)
    model = state.model
    old = state.status.current_primary
    assert old is not None
    model.nodes[old].net_cut = True
    acked = set(model.acked)
    detection = state.spec.failover.detection_seconds
    promoted_after = None
    for second in range(1, 40):
        model.commit(set(model.nodes))  # clients still reach the old primary
        state.long_wait(1)
        new = state.status.current_primary
        if new != old and model.nodes[new].role is Role.PRIMARY:
            promoted_after = second
            break
    assert promoted_after is not None, f"never replaced: {state.last.message if state.last else ''}"
    # Silence counts from the primary's last word once it exceeds the heartbeat (+ 1 s margin), seen at
    # two passes; then a pass to fence, one to promote, one to see it: about a crash's detection (3 passes
    # after it), not wal_receiver_timeout plus detection (12 s here).
    assert promoted_after <= max(detection, model.heartbeat + 1) + 4, promoted_after
    if quorum:
        assert {c for c in model.acked - acked if c in model.nodes[old].wal} <= set(model.nodes[new].wal)
    state.teardown()
