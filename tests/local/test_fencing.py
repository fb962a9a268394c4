"""Issue #10 item 4: a fenced member really stops and stays stopped, and no member starts read-write
except on the engine's explicit order (Promote, or RestartMember(primary=True))."""

from __future__ import annotations

import time
from collections.abc import Callable

from local_helpers import RESTART_DELAY, LocalCluster

from pgherd.engine import actions as act
from pgherd.engine.view import Role
from pgherd_backup.postgres import postmaster


def _ticks_keep_it_stopped(cluster: LocalCluster, name: str, seconds: float) -> None:
    """The platform's loop runs for a while; the member must never run meanwhile."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        cluster.tick()
        assert not cluster.running(name), f"{name} runs again although fenced"
        time.sleep(0.1)


def test_fence_stops_a_member_whose_worker_is_busy(local_cluster: Callable[..., LocalCluster]) -> None:
    cluster = local_cluster(2)
    primary, replica = cluster.name(0), cluster.name(1)
    assert not cluster.member(primary).stopped  # running: never reported stopped

    # A planned in-place restart is under way in the member's worker (it stops, then starts it)...
    cluster.apply(act.RestartMember(primary, "r2", primary=True))
    assert cluster.platform.busy(primary)
    # ...when the engine fences the member.
    cluster.apply(act.Fence(primary, reason="test"))
    cluster.wait_idle(primary)

    assert not cluster.running(primary), "the worker started the fenced member again"
    _ticks_keep_it_stopped(cluster, primary, 4 * RESTART_DELAY + 1)
    view = cluster.member(primary)
    assert view.fenced and view.stopped
    assert not cluster.member(replica).stopped


def test_a_fenced_member_started_read_only_by_demote_keeps_running(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = local_cluster(1)
    primary = cluster.name(0)
    cluster.apply(act.Fence(primary, reason="test"))
    assert not cluster.running(primary)
    assert cluster.member(primary).stopped

    cluster.apply(act.Demote(primary, reason="test"))
    cluster.wait_idle(primary)
    for _ in range(int(4 * RESTART_DELAY / 0.1)):
        cluster.tick()
        time.sleep(0.1)
    assert cluster.running(primary) and cluster.in_recovery(primary)
    view = cluster.member(primary)
    assert view.fenced and not view.stopped


def test_a_crashed_primary_is_restarted_read_only(local_cluster: Callable[..., LocalCluster]) -> None:
    cluster = local_cluster(1)
    primary = cluster.name(0)
    postmaster.kill(cluster.paths.member_data(primary))
    view_after_crash = cluster.member(primary)

    # The kubelet's part: it comes back after the restart delay, and only the engine may promote it.
    cluster.wait_until(
        lambda: (cluster.tick(), cluster.running(primary) and not cluster.platform.busy(primary))[1],
        "the restart of the crashed primary",
        timeout=60,
    )
    assert cluster.in_recovery(primary), "a crashed primary came back read-write on its own"
    assert view_after_crash.stopped and view_after_crash.shutdown_clean is False
    # What the engine needs to promote it in place: a standby with no upstream, on its timeline.
    view = cluster.member(primary)
    assert view.role is Role.REPLICA and view.upstream is None and not view.wal_receiver_streaming
    assert view.timeline == 1 and not view.stopped


def test_restart_member_is_read_write_only_on_the_engines_order(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = local_cluster(1)
    primary = cluster.name(0)

    cluster.apply(act.RestartMember(primary, "r2"))
    cluster.wait_idle(primary)
    assert cluster.in_recovery(primary), "RestartMember without primary=True came back read-write"

    cluster.apply(act.RestartMember(primary, "r3", primary=True))
    cluster.wait_idle(primary)
    assert not cluster.in_recovery(primary)
    assert cluster.platform.members[primary].revision == "r3"
