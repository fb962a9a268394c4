"""What the recovery-under-faults scenarios share: lose a majority of a 3-member cluster (the primary and
one replica, at once), and check the cluster that a recovery brings back.

A person applies a Restore whenever they decide to, and the automatic recovery starts when its grace
ends: at that moment the lost members may be down, restarting, empty, never coming back, or coming back
in the middle of it. The scenarios drive each of those, on every driver.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from e2e.checks import insert_ids, wait_ids_on_member
from e2e.driver import ClusterStatus, Driver, healthy, replicas, unless_failed
from e2e.workload import present_ids

RECOVERY_TIMEOUT = 300.0


def lose_majority(cluster: Driver, *, wipe_primary: bool, wipe_replica: bool) -> tuple[str, str, str]:
    """Kill the primary and one replica of a healthy 3-member cluster at once (one after the other, the
    first loss would be failed over before the second), kept down until bring_back(); wait for
    QuorumLost. (primary, lost replica, survivor).

    Kept down, because a member allowed to restart may be back before anyone sees the quorum lost: on
    a kubelet a crashed container restarts at once, and the old primary, read-only with its data, and
    the survivor are a majority again within a second (a poll of the status can miss that)."""
    status = cluster.wait_for(healthy(3), 120, "a healthy cluster before the majority failure")
    primary = str(status["primary"])
    survivor, lost_replica = sorted(replicas(status))
    with ThreadPoolExecutor(max_workers=2) as pool:
        kills = [
            pool.submit(cluster.kill, primary, wipe=wipe_primary, keep_down=True),
            pool.submit(cluster.kill, lost_replica, wipe=wipe_replica, keep_down=True),
        ]
        for done in kills:
            done.result()
    cluster.wait_for(lambda s: s.get("phase") == "QuorumLost", 60, "phase QuorumLost")
    return primary, lost_replica, survivor


def running_members(status: ClusterStatus) -> list[str]:
    return [str(m["name"]) for m in status.get("members") or [] if m.get("role") in ("primary", "replica")]


def restored_with_members(running: int, absent: Iterable[str]) -> Callable[[ClusterStatus], bool]:
    """The cluster serves writes again on ``running`` members streaming (or primary), the ``absent``
    ones (kept down) not among them, no operation in progress."""
    missing = set(absent)

    def check(status: ClusterStatus) -> bool:
        members = status.get("members") or []
        primaries = [m for m in members if m.get("role") == "primary"]
        up = [m for m in members if m.get("role") in ("primary", "replica") and m.get("ready")]
        return (
            not status.get("operation")
            and len(primaries) == 1
            and status.get("primary") == primaries[0].get("name")
            and len(up) == running
            and not missing & {str(m.get("name")) for m in up}
        )

    return unless_failed(check)


def check_rows(cluster: Driver, status: ClusterStatus, ids: list[int], write_id: int) -> None:
    """The Backup's rows on the primary and every running member, and a write accepted (through the rw
    endpoint, once it selects the new primary: on Kubernetes its pod's readiness probe comes after)."""

    def rows_through_rw(_: ClusterStatus) -> bool:
        missing = set(ids) - present_ids(cluster.rw_dsn())
        assert not missing, f"the Backup's rows are missing: {sorted(missing)[:10]}"
        return True

    cluster.wait_for(rows_through_rw, 60, "the rw endpoint to answer")
    for name in running_members(status):
        wait_ids_on_member(cluster, name, ids, timeout=60)
    insert_ids(cluster.rw_dsn(), [write_id])
