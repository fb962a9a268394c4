"""Issue #10 item 12 (part): the supervisor stops applying a decision's actions at the first that fails."""

from __future__ import annotations

import logging

import pytest

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import actions as act
from pgherd.engine.quorum import SyncConfig
from pgherd.local.supervisor import apply_actions


class _Platform:
    """Records what it applied; fails on one chosen action."""

    def __init__(self, failing: act.Action) -> None:
        self.failing = failing
        self.applied: list[act.Action] = []

    def apply(self, action: act.Action, spec: PostgresClusterSpec) -> None:
        self.applied.append(action)
        if action == self.failing:
            raise RuntimeError("cannot reach the member")


def test_actions_after_a_failed_one_are_not_applied(caplog: pytest.LogCaptureFixture) -> None:
    fence = act.Fence("c-0", reason="failover")
    sync = act.SetSynchronousStandbys("c-1", SyncConfig(1, frozenset({"c-2"})), reason="failover")
    promote = act.Promote("c-1", reason="failover")
    platform = _Platform(failing=sync)

    with caplog.at_level(logging.INFO, logger="pgherd.sandbox"):
        apply_actions(platform, (fence, sync, promote), PostgresClusterSpec(), set())

    assert platform.applied == [fence, sync]  # never a promotion without its synchronous standbys
    assert any(
        "SetSynchronousStandbys" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records
    )


def test_every_action_is_applied_when_none_fails() -> None:
    actions = (act.Fence("c-0"), act.Promote("c-1"), act.SetPrimary("c-1"))
    platform = _Platform(failing=act.RecordEvent("never", "issued"))
    apply_actions(platform, actions, PostgresClusterSpec(), set())
    assert platform.applied == list(actions)
