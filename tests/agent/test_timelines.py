"""The timeline a replica reports in /status (issue #10 item 11): the newest one it holds WAL for,
from its receiver, its last restartpoint and its WAL segments; a history file of a newer timeline is no
evidence of being on it."""

from __future__ import annotations

from agent_helpers import MEMBERS, Agent

from pgherd_backup.postgres.config import read_pgherd_conf, update_pgherd_conf


def _three(agents) -> tuple[Agent, Agent, Agent]:
    primary = agents.primary(MEMBERS[0])
    first = agents(MEMBERS[1], "--seed", "basebackup", "--upstream", primary.address)
    second = agents(MEMBERS[2], "--seed", "basebackup", "--upstream", primary.address)
    first.wait_streaming()
    second.wait_streaming()
    return primary, first, second


def _wait_replayed(agent: Agent, lsn: str) -> None:
    agent.wait_until(
        lambda: bool(agent.value(f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn")), f"replay of {lsn}"
    )


def _diverged(agents) -> tuple[Agent, Agent, Agent]:
    """A primary fenced, a replica ahead of the fork on timeline 1, and the fork promoted on its own:
    timeline 2 forks from timeline 1 behind the replica."""
    primary, replica, fork = _three(agents)
    fork.client.fence(reason="left behind")
    primary.sql("CREATE TABLE ahead AS SELECT generate_series(1, 1000) AS x")
    _wait_replayed(replica, str(primary.value("SELECT pg_current_wal_lsn()")))
    primary.client.fence(reason="gone")
    fork.client.promote(reason="test")
    assert fork.status().timeline == 2
    return primary, replica, fork


def test_a_diverged_replica_reports_the_timeline_it_is_on(agents):
    primary, replica, fork = _diverged(agents)

    # Pointed at the fork (by hand: the agent's rejoin would rewind it), the replica's walreceiver
    # fetches 00000002.history, but the replica cannot follow timeline 2: it stays on timeline 1.
    conninfo = read_pgherd_conf(replica.pgdata)["primary_conninfo"]
    update_pgherd_conf(
        replica.pgdata, {"primary_conninfo": conninfo.replace(str(primary.pg_port), str(fork.pg_port))}
    )
    replica.sql("SELECT pg_reload_conf()")
    replica.wait_until(lambda: (replica.pgdata / "pg_wal" / "00000002.history").exists(), "the history file")
    log = replica.volume / "data.log"
    replica.wait_until(lambda: "before current recovery point" in log.read_text(), "the refusal to switch")

    status = replica.status()
    assert status.role == "replica" and not status.streaming
    assert status.timeline == 1


def test_a_replica_that_followed_a_promotion_reports_the_new_timeline_without_its_upstream(agents):
    """Its last restartpoint is still on timeline 1 and its receiver is gone with the new primary: the
    WAL it received on timeline 2 says where it is."""
    primary, promoted, follower = _three(agents)
    primary.sql("CREATE TABLE before_promotion AS SELECT 1 AS x")
    lsn = str(primary.value("SELECT pg_current_wal_lsn()"))
    _wait_replayed(promoted, lsn)
    _wait_replayed(follower, lsn)
    primary.client.fence(reason="gone")
    promoted.client.promote(reason="test")
    assert follower.client.rejoin(promoted.address).method == "repoint"

    promoted.sql("CREATE TABLE after_promotion AS SELECT 2 AS x")
    _wait_replayed(follower, str(promoted.value("SELECT pg_current_wal_lsn()")))
    assert follower.value("SELECT timeline_id FROM pg_control_checkpoint()") == 1
    promoted.client.fence(reason="gone too")
    follower.wait_until(lambda: follower.status().wal_receiver is None, "no receiver")

    status = follower.status()
    assert status.role == "replica" and status.timeline == 2


def test_a_diverged_replica_asked_to_follow_the_fork_is_rewound_not_repointed(agents):
    """Its WAL receiver connects to the fork and says streaming for a moment before the startup process
    refuses the timeline switch: a rejoin that trusted one such sample answered "re-pointed; streaming"
    and the operator asked again and again (seen on localkube after a partition: ~20 rejoins in 60 s
    before one waited long enough to rewind)."""
    _, replica, fork = _diverged(agents)
    result = replica.client.rejoin(fork.address, reason="follow the new primary")
    assert result.method == "rewind", result
    status = replica.wait_streaming()
    assert (status.timeline, status.upstream) == (2, fork.address)
