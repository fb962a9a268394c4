"""The start the property search's shrunk sequences share, for the tests that replay them."""

from __future__ import annotations

from pgherd.api.cluster import PrimaryUpdateMethod

from .test_properties import ClusterMachine


def async_machine(*, fence_lags: bool, with_backup: bool) -> ClusterMachine:
    """Three members, async replication, the primary updated by switchover, no restore on quorum loss."""
    state = ClusterMachine()
    state.setup(
        instances=3,
        quorum=False,
        method=PrimaryUpdateMethod.SWITCHOVER,
        restore_on_loss=False,
        fence_lags=fence_lags,
        with_backup=with_backup,
    )
    return state
