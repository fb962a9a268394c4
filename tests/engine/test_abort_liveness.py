"""A liveness defect the property search found (2026-11-27, in two full-suite runs of a fresh clone; the
same derandomized search run on its own does not reach it), kept as its exact sequence: a rolling
update's switchover is abandoned (its target lost) while the old primary has crashed; the engine's
Unfence is lost with the crash, the agent restarts PostgreSQL fenced, and the engine, seeing its recorded
primary stopped, waited for failover detection instead of unfencing it again, so no member was writable
for the three passes the property allows. Fixed by failover.unfence_again: the recorded primary fenced
and stopped with no operation under way, nothing else promoted, is sent Unfence again."""

from __future__ import annotations

from pgherd.api.cluster import PrimaryUpdateMethod

from .test_properties import ClusterMachine


def test_an_abandoned_switchover_whose_old_primary_crashed_leaves_a_writable_primary() -> None:
    state = ClusterMachine()
    state.setup(
        instances=3,
        quorum=False,
        method=PrimaryUpdateMethod.SWITCHOVER,
        restore_on_loss=False,
        fence_lags=False,
        with_backup=True,
    )
    state.rollout_switchover_fails(after=4, how="target-lost")
    state.raise_major()
    state.crash(node=0)
    state.long_wait(seconds=10)
    state.teardown()
