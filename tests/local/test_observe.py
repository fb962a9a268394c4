"""Parsing what PostgreSQL reports, and observing an unreachable member quickly."""

from __future__ import annotations

import socket
import time

from pgherd.engine.quorum import SyncConfig
from pgherd.local.observe import observe, parse_sync_standby_names


def test_parse_the_forms_pgherd_writes() -> None:
    assert parse_sync_standby_names("") == SyncConfig()
    assert parse_sync_standby_names('ANY 1 ("a-1", "a-2")') == SyncConfig(1, frozenset({"a-1", "a-2"}))
    assert parse_sync_standby_names("any 2 (x, y, z)") == SyncConfig(2, frozenset({"x", "y", "z"}))
    # The rendering of the engine reads back as the same configuration.
    config = SyncConfig(2, frozenset({"h-1", "h-2", "h-3"}))
    assert parse_sync_standby_names(config.render()) == config


def test_a_hand_written_list_is_reported_not_guessed_away() -> None:
    assert parse_sync_standby_names("a, b") == SyncConfig(1, frozenset({"a", "b"}))


def test_an_unreachable_member_is_reported_fast() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    result = observe(f"host=127.0.0.1 port={port} user=postgres dbname=postgres")
    assert not result.reachable and result.error
    assert time.monotonic() - started < 2
