"""A replica re-pointed at a member about to be promoted (the engine's early follow: a rejoin with
`aheadOfPromotion`) switches to the new timeline without asking the archive, whose every answer delays
the new primary's first quorum commit; and only for a moment: its own promotion, which must choose a
timeline the archive does not hold, asks the archive again. Real PostgreSQL, a real S3 server behind
one counting proxy per member."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from agent_helpers import CLUSTER, MEMBERS, Agent, SlowProxy

from pgherd_backup.agent.actions import SKIP_ARCHIVE_SECONDS
from pgherd_backup.postgres.config import read_pgherd_conf
from pgherd_backup.postgres.control import read_system_id


@dataclass
class Members:
    primary: Agent
    target: Agent  # to be promoted
    follower: Agent  # to follow it
    follower_s3: SlowProxy  # the follower's way to S3 (its WAL service's, restore_command's)


@pytest.fixture
def members(agents, s3_store) -> Iterator[Members]:
    port = int(s3_store.endpoint.endpoint_url.rsplit(":", 1)[1])
    proxies = [SlowProxy(port, 0.0) for _ in MEMBERS[:3]]

    def through(proxy: SlowProxy) -> dict[str, str]:
        return {**s3_store.endpoint.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}

    try:
        store = ("--store", s3_store.url)
        primary = agents.primary(MEMBERS[0], *store, env=through(proxies[0]))
        seed = ("--seed", "basebackup", "--upstream", primary.address, *store)
        target = agents(MEMBERS[1], *seed, env=through(proxies[1]))
        follower = agents(MEMBERS[2], *seed, env=through(proxies[2]))
        target.wait_streaming()
        follower.wait_streaming()
        primary.sql("CREATE TABLE t AS SELECT generate_series(1, 100) AS x")
        lsn = primary.value("SELECT pg_current_wal_lsn()")
        for replica in (target, follower):
            replica.wait_until(
                lambda r=replica: bool(r.value(f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'")), "the rows"
            )
        yield Members(primary, target, follower, proxies[2])
    finally:
        for proxy in proxies:
            proxy.close()


def _marker(agent: Agent) -> Path:
    return Path(read_pgherd_conf(agent.pgdata)["unix_socket_directories"]) / "skip-archive"


def _on_timeline(agent: Agent, timeline: int) -> bool:
    status = agent.status()
    return status.streaming and status.timeline == timeline


def test_a_replica_following_a_promotion_switches_timeline_without_the_archive(members):
    primary, target, follower = members.primary, members.target, members.follower
    primary.client.fence(reason="the primary is lost")
    asked = len(members.follower_s3.requests)
    # As the operator does: the follower re-pointed and the target promoted at the same time.
    rejoin = threading.Thread(
        target=follower.client.rejoin,
        args=(target.address,),
        kwargs={"reason": "follow it, being promoted", "ahead_of_promotion": True},
    )
    rejoin.start()
    follower.wait_until(lambda: _marker(follower).exists(), "the re-point")
    target.client.promote(reason="failover")
    rejoin.join()
    follower.wait_until(lambda: _on_timeline(follower, 2), "streaming on timeline 2")
    # Its WAL receiver brought the new timeline's history file; without the skip, it asks S3 for the
    # next one (through the WAL service: a history file's miss is never remembered), and maybe for
    # timeline 2's segment. Before, without its primary, it asked for timeline 1's segment and for
    # 00000002.history at every retry: not the switch's questions.
    switch = [
        r
        for r in members.follower_s3.requests[asked:]
        if "00000003.history" in r or re.search("/00000002[0-9A-F]{16}", r)
    ]
    assert switch == []
    assert target.value("SELECT count(*) FROM t") == 100

    # The moment ends by itself.
    follower.wait_until(lambda: not _marker(follower).exists(), "the end", timeout=SKIP_ARCHIVE_SECONDS + 5)
    assert _marker(follower).parent.is_dir()  # the file went, not the directory the test looks in


def test_a_replica_promoted_inside_the_moment_asks_the_archive_for_its_timeline(members, agent, tmp_path):
    """Another promotion's timeline 2 is in the archive; the follower, re-pointed ahead of the target's
    promotion that does not come, is promoted itself within the moment: timeline 3, never 2."""
    primary, target, follower = members.primary, members.target, members.follower
    history = tmp_path / "00000002.history"
    history.write_text("1\t0/3000000\tno recovery target specified\n")
    system_id = read_system_id(primary.pgdata)
    pushed = agent("wal-push", "--cluster", CLUSTER, "--system-id", system_id, str(history))
    assert pushed.returncode == 0, pushed.stderr
    primary.client.fence(reason="the primary is lost")
    follower.client.rejoin(target.address, reason="follow it, being promoted", ahead_of_promotion=True)
    assert _marker(follower).exists()
    follower.client.promote(reason="the target failed instead")
    assert follower.status().timeline == 3  # 2 when the promotion did not ask the archive
    assert not _marker(follower).exists()
    assert follower.value("SELECT count(*) FROM t") == 100
