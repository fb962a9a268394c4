"""A liveness defect the property search found (2026-11-27, in two full-suite runs of a fresh clone; the
same derandomized search run on its own does not reach it), kept as its exact sequence: a rolling
update's switchover is abandoned (its target lost) while the old primary has crashed; the engine's
Unfence is lost with the crash, the agent restarts PostgreSQL fenced, and the engine, seeing its recorded
primary stopped, waited for failover detection instead of unfencing it again, so no member was writable
for the three passes the property allows. Fixed by failover.unfence_again: the recorded primary fenced
and stopped with no operation under way, nothing else promoted, is sent Unfence again."""

from __future__ import annotations

from .replays import async_machine
from .test_properties import ClusterMachine


def test_an_abandoned_switchover_whose_old_primary_crashed_leaves_a_writable_primary() -> None:
    state = async_machine(fence_lags=False, with_backup=True)
    state.rollout_switchover_fails(after=4, how="target-lost")
    state.raise_major()
    state.crash(node=0)
    state.long_wait(seconds=10)
    state.teardown()


def _switchover_abandoned_while_its_primary_pod_is_lost() -> ClusterMachine:
    """A switchover away from a terminating primary is abandoned (its stop killed, no final WAL end),
    started again, and the primary stops for good at the end of its grace period, then loses its pod:
    the next switchover is abandoned (the fence not confirmed in time) and sends an Unfence that no agent
    can receive."""
    state = async_machine(fence_lags=True, with_backup=False)
    state.request_backup()
    state.switchover_whose_stop_is_killed(base=1, count=1, node=0, rounds=2, skipped=set(), terminate=True)
    state.operator_rounds(rounds=2, seconds=0.5)
    return state


def test_an_abandoned_switchover_whose_old_primary_lost_its_pod_owes_nothing_until_it_is_back() -> None:
    """Found by the property search (2026-11-28, run after the other engine tests and tests/kube): the
    old primary's pod is lost when its switchover is abandoned, so the abort's Unfence reaches no agent
    (as on Kubernetes: Unfence is a call to the member's agent). The property held the engine to a
    writable primary within three passes all the same (``_available`` counted the fenced member as the
    engine's to start again); the engine can only wait for the platform to start the pod (then
    failover.unfence_again resumes it) or fail over once the failure is confirmed."""
    state = _switchover_abandoned_while_its_primary_pod_is_lost()
    state.end_terminations()
    state.crash(node=0)
    state.long_wait(seconds=10)
    state.long_wait(seconds=20)  # the switchover is abandoned: Unfence, SetPrimary to the lost pod
    state.long_wait(seconds=10)
    state.operator_rounds(rounds=2, seconds=0.5)
    state.teardown()


def test_the_old_primary_of_an_abandoned_switchover_may_be_failed_over_once_its_pod_is_lost() -> None:
    """The same search, its other failure: the pod stays lost, the replicas confirm the failure, and the
    engine fails over from the old primary; the property called that a failover instead of a resumption,
    though no resumption could reach it."""
    state = _switchover_abandoned_while_its_primary_pod_is_lost()
    state.commits_on_leavers_then_scale_down(count=1, drop=2, fault="crash", grow=False, rounds=3)
    state.end_terminations()
    state.crash(node=0)
    state.long_wait(seconds=10)
    state.long_wait(seconds=20)
    state.long_wait(seconds=10)
    state.long_wait(seconds=10)
    state.teardown()
