"""A model defect the property search found (2026-11-28, with the seed the edit of _available in
test_properties.py gave it): a restart of the primary as primary, in flight when its pod was lost, still
ended read-write in the model, after the engine had moved on. On both platforms that order is the
agent's (kube/actions.py restart_member spawns it on the new pod's agent while the rollout repeats
RestartMember; local/platform.py runs it in the agent), so it dies with the pod and the new pod's agent
starts a standby: the model was harsher than the platforms, and reported two writable primaries."""

from __future__ import annotations

from .replays import async_machine


def test_a_restart_as_primary_in_flight_when_the_pod_is_lost_ends_read_only() -> None:
    state = async_machine(fence_lags=False, with_backup=True)
    state.wipe(node=1)
    state.new_image()
    # Restored, scaled to one member, the new image's rollout restarts pg-0 in place (as primary).
    state.restore_then_scale_down(rounds=4, smaller=1)
    pg0 = state.model.nodes["pg-0"]
    assert pg0.restarting_to is not None and pg0.restart_as_primary
    state.request_restore()
    state.crash(node=0)  # its pod is lost mid-restart: absent, a Restore goes ahead without it
    state.scale(instances=2)
    state.long_wait(seconds=10)  # the Restore restores into pg-1; pg-0's pod comes back in the teardown
    state.teardown()
