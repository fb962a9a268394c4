"""What the sandbox's status file shows of a member (local/observe.py, from its agent's /status), and
parsing what PostgreSQL reports of its synchronous standbys."""

from __future__ import annotations

from pgherd.agentview import parse_sync_standby_names
from pgherd.engine.quorum import SyncConfig
from pgherd.local.observe import Observation, observation
from pgherd_backup.agent.wire import Status, WalReceiver


def test_parse_the_forms_pgherd_writes() -> None:
    assert parse_sync_standby_names("") == SyncConfig()
    assert parse_sync_standby_names('ANY 1 ("a-1", "a-2")') == SyncConfig(1, frozenset({"a-1", "a-2"}))
    assert parse_sync_standby_names("any 2 (x, y, z)") == SyncConfig(2, frozenset({"x", "y", "z"}))
    # The rendering of the engine reads back as the same configuration.
    config = SyncConfig(2, frozenset({"h-1", "h-2", "h-3"}))
    assert parse_sync_standby_names(config.render()) == config


def test_a_hand_written_list_is_reported_not_guessed_away() -> None:
    assert parse_sync_standby_names("a, b") == SyncConfig(1, frozenset({"a", "b"}))


def test_an_observation_is_what_the_agent_reports() -> None:
    replica = Status(
        member="c-1",
        cluster="c",
        role="replica",
        postmaster="running",
        timeline=2,
        received_lsn="0/3000100",
        replayed_lsn="0/3000060",
        wal_receiver=WalReceiver("streaming", "127.0.0.1:6000", 2),
        synchronous_standby_names="",
    )
    seen = observation(replica)
    assert seen == Observation(
        reachable=True,
        in_recovery=True,
        received_lsn=0x3000100,
        replayed_lsn=0x3000060,
        timeline=2,
        receiver_streaming=True,
        sender_port=6000,
        sync=SyncConfig(),
    )
    primary = Status(member="c-0", cluster="c", role="primary", synchronous_standby_names='ANY 1 ("c-1")')
    assert observation(primary).sync == SyncConfig(1, frozenset({"c-1"}))
    assert not observation(primary).in_recovery
    # Not answering SQL (stopped, starting), or the agent itself silent: not reachable.
    assert observation(Status(member="c-2", cluster="c", postmaster="stopped")) == Observation(False)
    assert observation(None) == Observation(False)
