"""The operator's orders that change a member's role: fence, demote, unfence, promote, rejoin (rewind,
re-clone) and seed; a fence always wins over a slow order in progress."""

from __future__ import annotations

import threading
import time

import pytest
from agent_helpers import MEMBERS, Agent, SlowProxy

from pgherd_backup.agent.client import AgentActionError, AgentBusy, AgentError
from pgherd_backup.agent.wire import ActionResult, lsn_value


def _pair(agents) -> tuple[Agent, Agent]:
    primary = agents.primary(MEMBERS[0])
    replica = agents(MEMBERS[1], "--seed", "basebackup", "--upstream", primary.address)
    replica.wait_streaming()
    return primary, replica


@pytest.fixture(scope="module")
def pair(module_agents) -> tuple[Agent, Agent]:
    """A primary and its replica for the tests below that leave the replica a replica (the last one
    leaves it fenced)."""
    return _pair(module_agents)


def test_fence_demote_unfence_and_promote(agents):
    primary = agents.primary(MEMBERS[0])
    primary.sql("CREATE TABLE t (x int)")
    client = primary.client

    fenced = client.fence(reason="test")
    again = client.fence()
    assert fenced.changed and not again.changed
    assert fenced.shutdown_clean and fenced.final_lsn == again.final_lsn
    status = primary.status()
    assert (status.postmaster, status.fenced, status.role, status.ready) == (
        "stopped",
        True,
        "unknown",
        False,
    )
    assert status.final_lsn == fenced.final_lsn and status.held_lsn == fenced.final_lsn
    assert status.shutdown_clean is True and status.timeline == 1
    assert primary.client.probe("healthz") == 200  # stopped on purpose is healthy
    assert primary.client.probe("readyz") == 503
    # it stays stopped: a restart order is refused while fenced, and changes nothing
    with pytest.raises(AgentActionError) as refused:
        client.restart(revision="r9")
    assert refused.value.status == 409 and "fenced" in refused.value.message
    time.sleep(1)
    assert primary.status().postmaster == "stopped"

    # demote: read-only with no upstream, still fenced; twice is a no-op
    assert client.demote().changed
    assert not client.demote().changed
    status = primary.status()
    assert (status.role, status.fenced, status.demoted, status.upstream) == ("replica", True, True, None)
    assert lsn_value(status.held_lsn) >= lsn_value(fenced.final_lsn)
    # it runs read-only since the demote: unfence cannot make it read-write again
    with pytest.raises(AgentActionError) as read_only:
        client.unfence(primary=True)
    assert "promote" in read_only.value.message
    assert primary.status().role == "replica"

    # fence it again, then unfence as the primary it was when first fenced
    client.fence()
    unfenced = client.unfence(primary=True)
    assert unfenced.changed and "read-write" in unfenced.detail
    status = primary.status()
    assert (status.role, status.fenced, status.timeline) == ("primary", False, 1)
    assert not client.unfence(primary=True).changed
    primary.sql("INSERT INTO t VALUES (1)")

    # a fenced member that was a replica never comes back read-write through unfence
    client.restart(primary=False)
    assert primary.status().role == "replica"
    client.fence()
    with pytest.raises(AgentActionError) as was_replica:
        client.unfence(primary=True)
    assert was_replica.value.status == 409 and "replica" in was_replica.value.message
    assert primary.status().postmaster == "stopped"
    # promote starts it (read-only, no upstream) and promotes it: a new timeline, no longer fenced
    promoted = client.promote()
    assert promoted.changed and promoted.timeline == 2
    status = primary.status()
    assert (status.role, status.fenced, status.demoted) == ("primary", False, False)
    assert primary.value("SELECT count(*) FROM t") == 1


def test_fence_survives_a_restart_of_the_agent(agents):
    primary = agents.primary(MEMBERS[0])
    primary.client.fence()
    primary.stop()
    primary.start()
    status = primary.status()
    assert (status.postmaster, status.fenced) == ("stopped", True)
    assert primary.client.probe("healthz") == 200 and primary.client.probe("startupz") == 200


def test_rejoin_after_the_other_was_promoted_rewinds(agents):
    primary, replica = _pair(agents)
    primary.sql("CREATE TABLE t (x int)")
    primary.sql("INSERT INTO t VALUES (1)")
    replica.wait_until(lambda: replica.value("SELECT count(*) FROM t") == 1, "replay")
    # the replica stops (fenced) and misses what the primary writes next: their histories diverge
    replica.client.fence()
    primary.sql("INSERT INTO t SELECT generate_series(2, 1000)")
    primary.client.fence()
    promoted = replica.client.promote()
    assert promoted.timeline == 2
    replica.sql("INSERT INTO t VALUES (-1)")

    rejoined = primary.client.rejoin(replica.address, reason="the old primary follows the new one")
    assert rejoined.method == "rewind" and rejoined.kept_aside is None
    status = primary.wait_streaming()
    assert (status.role, status.fenced, status.timeline, status.upstream) == (
        "replica",
        False,
        2,
        replica.address,
    )
    assert status.wal_receiver is not None and status.wal_receiver.upstream == replica.address
    assert primary.value("SELECT count(*) FROM t") == 2  # 1 and -1: the diverged rows were rewound away
    # rejoining the upstream it already streams from changes nothing
    again = primary.client.rejoin(replica.address)
    assert not again.changed and again.method == "none"


def test_rejoin_with_reclone_keeps_the_old_data_aside_on_the_same_volume(pair):
    primary, replica = pair
    old_system = replica.status().system_identifier
    # an upstream that does not answer: refused before anything changes
    with pytest.raises(AgentActionError) as unreachable:
        replica.client.rejoin("127.0.0.1:1", reclone=True)
    assert unreachable.value.status == 409 and "does not answer" in unreachable.value.message
    status = replica.status()
    assert status.streaming and status.kept_aside == () and status.upstream == primary.address
    result = replica.client.rejoin(primary.address, reclone=True)
    assert result.method == "reclone" and result.kept_aside is not None
    # It answers once it streams: an operator looking right after never finds a fresh clone still
    # connecting (it would order another re-clone of a member it rebuilds).
    assert replica.status().streaming and "; streaming" in result.detail
    kept = result.kept_aside
    assert kept.startswith(str(replica.volume / "kept"))
    assert (replica.volume / "kept").stat().st_dev == replica.volume.stat().st_dev
    from pathlib import Path

    assert (Path(kept) / "PG_VERSION").exists()  # kept whole, never deleted
    status = replica.wait_streaming()
    assert status.kept_aside == (kept,) and status.system_identifier == old_system


def test_a_running_replica_is_repointed_without_a_restart(pair, agents):
    primary, replica = pair
    third = agents(MEMBERS[2], "--seed", "basebackup", "--upstream", primary.address)
    third.wait_streaming()
    since = third.status().postmaster_since
    result = third.client.rejoin(replica.address)  # cascade from the replica
    assert result.method == "repoint"
    status = third.status()
    assert status.wal_receiver is not None and status.wal_receiver.upstream == replica.address
    assert status.postmaster_since == since  # not restarted


def test_a_rejoin_whose_upstream_stops_answering_leaves_the_replica_running_and_whole(pair):
    """An upstream that answered when the rejoin began and stopped before the replica streamed from it
    (the primary fenced by a switchover meanwhile): the replica was stopped to be rewound, pg_rewind could
    not reach the upstream, and the re-clone after it moved the data directory aside and failed too
    (CI, 2026-12-06). Now it refuses: the replica runs on, read-only, its data in place."""
    primary, replica = pair
    kept_before = replica.status().kept_aside
    proxy = SlowProxy(primary.pg_port, delay=3.0)  # answers, slowly: the replica cannot stream at once
    address = f"127.0.0.1:{proxy.port}"
    outcome: list[ActionResult | AgentError] = []

    def rejoin() -> None:
        try:
            outcome.append(replica.client.rejoin(address, reason="follow a member about to stop"))
        except AgentError as exc:
            outcome.append(exc)

    slow = threading.Thread(target=rejoin)
    slow.start()
    try:
        replica.wait_until(lambda: replica.status().upstream == address, "the re-point", timeout=20)
    finally:
        proxy.close()  # the upstream goes away before the replica streams from it
    slow.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], AgentActionError), outcome
    assert outcome[0].status == 409 and "does not answer" in outcome[0].message
    status = replica.status()
    assert (status.postmaster, status.role, status.action) == ("running", "replica", None)
    assert status.data_present and status.kept_aside == kept_before
    back = replica.client.rejoin(primary.address, reason="the primary again")
    assert back.method == "repoint" and replica.wait_streaming().upstream == primary.address


def test_a_fence_wins_over_a_slow_rejoin_and_the_member_stays_stopped(pair):
    primary, replica = pair
    kept_before = len(replica.status().kept_aside)
    proxy = SlowProxy(primary.pg_port, delay=3.0)  # every connection to the upstream waits 3 s
    outcome: list[ActionResult | AgentError] = []

    def rejoin() -> None:
        try:
            outcome.append(replica.client.rejoin(f"127.0.0.1:{proxy.port}", reclone=True))
        except AgentError as exc:
            outcome.append(exc)

    slow = threading.Thread(target=rejoin)
    slow.start()
    try:
        replica.wait_until(lambda: replica.status().action == "rejoin", "the rejoin in progress", timeout=10)
        replica.wait_until(lambda: replica.status().postmaster == "stopped", "the rejoin's stop", timeout=20)
        with pytest.raises(AgentBusy):
            replica.client.checkpoint()  # one action at a time...
        started = time.monotonic()
        fenced = replica.client.fence(reason="the fence does not wait")  # ...but a fence never waits
        assert time.monotonic() - started < 2.5
        assert fenced.ok
        slow.join(120)
    finally:
        proxy.close()
    assert len(outcome) == 1 and isinstance(outcome[0], AgentActionError), outcome
    assert outcome[0].status == 409 and "fenced" in outcome[0].message
    time.sleep(1)
    status = replica.status()
    assert (status.postmaster, status.fenced, status.action) == ("stopped", True, None)
    assert status.data_present and len(status.kept_aside) == kept_before + 1


def test_an_empty_member_waits_for_a_seed_order(agents):
    primary = agents.primary(MEMBERS[0])
    empty = agents(MEMBERS[1])  # --seed none
    status = empty.status()
    assert (status.data_present, status.postmaster, status.role) == (False, "stopped", "unknown")
    assert [empty.client.probe(p) for p in ("healthz", "startupz", "readyz")] == [200, 200, 503]
    with pytest.raises(AgentActionError) as nothing:
        empty.client.promote()
    assert nothing.value.status == 409 and "seed" in nothing.value.message
    seeded = empty.client.seed("basebackup", upstream=primary.address)
    assert seeded.method == "basebackup"
    status = empty.wait_streaming()
    assert (status.role, status.data_present, status.upstream) == ("replica", True, primary.address)
    again = empty.client.seed("initdb")
    assert not again.changed and "already holds data" in again.detail
    assert empty.status().role == "replica"
