"""Issue #10 item 4, on the members' agents: a fenced member really stops and stays stopped (whatever
the platform's loop does meanwhile), and no member starts read-write except on the engine's explicit
order (Promote, or RestartMember(primary=True))."""

from __future__ import annotations

import time
from collections.abc import Callable

from local_helpers import RESTART_DELAY, LocalCluster

from pgherd.engine import actions as act
from pgherd.engine.view import Role
from pgherd.local.pods import kill_pod


def _ticks_keep_it_stopped(cluster: LocalCluster, name: str, seconds: float) -> None:
    """The platform's loop runs for a while (restart delays and liveness probes included); the member
    must never run meanwhile."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        cluster.tick()
        assert not cluster.running(name), f"{name} runs again although fenced"
        time.sleep(0.1)


def test_fence_stops_a_member_whose_worker_is_busy(local_cluster: Callable[..., LocalCluster]) -> None:
    cluster = local_cluster(2)
    primary, replica = cluster.name(0), cluster.name(1)
    assert not cluster.member(primary).stopped  # running: never reported stopped

    # A planned in-place restart is under way in the member's worker (its agent stops, then starts it)...
    cluster.apply(act.RestartMember(primary, "r2", primary=True))
    assert cluster.platform.busy(primary)
    # ...when the engine fences the member.
    cluster.apply(act.Fence(primary, reason="test"))
    cluster.wait_idle(primary)

    assert not cluster.running(primary), "the restart started the fenced member again"
    _ticks_keep_it_stopped(cluster, primary, 4 * RESTART_DELAY + 3)
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
    # the platform's loop (its liveness probe included) leaves a demoted member running
    deadline = time.monotonic() + 4 * RESTART_DELAY + 3
    while time.monotonic() < deadline:
        cluster.tick()
        time.sleep(0.1)
    assert cluster.running(primary) and cluster.in_recovery(primary)
    view = cluster.member(primary)
    assert view.fenced and not view.stopped and view.role is Role.REPLICA


def test_a_crashed_primary_is_restarted_read_only(local_cluster: Callable[..., LocalCluster]) -> None:
    cluster = local_cluster(1)
    primary = cluster.name(0)
    pid = cluster.platform.pods.pid(primary)
    kill_pod(cluster.paths, primary, postgres_only=True)  # PostgreSQL crashes under its live agent

    # The agent starts it again at once, read-only; only the engine may promote it.
    cluster.wait_until(
        lambda: (cluster.tick(), cluster.status(primary).postmaster == "running")[1],
        "the restart of the crashed primary",
        timeout=60,
    )
    assert cluster.in_recovery(primary), "a crashed primary came back read-write on its own"
    assert cluster.platform.pods.pid(primary) == pid  # its pod (agent) was never restarted
    assert cluster.status(primary).crashes == 1
    # What the engine needs to promote it in place: a standby with no upstream, on its timeline.
    view = cluster.member(primary)
    assert view.role is Role.REPLICA and view.upstream is None and not view.wal_receiver_streaming
    assert view.timeline == 1 and not view.stopped and not view.fenced


def test_restart_member_is_read_write_only_on_the_engines_order(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = local_cluster(1)
    primary = cluster.name(0)

    cluster.apply(act.RestartMember(primary, "r2", primary=True))
    cluster.wait_idle(primary)
    assert not cluster.in_recovery(primary)
    assert cluster.platform.members[primary].revision == "r2" == cluster.status(primary).revision

    cluster.apply(act.RestartMember(primary, "r3"))
    cluster.wait_idle(primary)
    assert cluster.in_recovery(primary), "RestartMember without primary=True came back read-write"

    # A member running read-only is never made read-write by a restart: the engine promotes it.
    cluster.apply(act.RestartMember(primary, "r4", primary=True))
    cluster.wait_idle(primary)
    assert cluster.in_recovery(primary)
    assert cluster.platform.members[primary].revision == "r3" == cluster.status(primary).revision
    cluster.apply(act.Promote(primary, reason="test"))
    cluster.wait_until(lambda: not cluster.in_recovery(primary), "the promotion")
