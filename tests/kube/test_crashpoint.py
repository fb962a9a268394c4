"""The operator's crash point for the e2e drivers (operator/pgherd/kube/crashpoint.py): armed from the
environment, reached at the step's prefix with enough members done, refused when malformed."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from pgherd.engine.status import Operation, OperationKind
from pgherd.kube.crashpoint import ENV, CrashPoint

NOW = datetime(2026, 11, 25, tzinfo=UTC)


def rollout(step: str, done: tuple[str, ...] = ()) -> Operation:
    return Operation(OperationKind.ROLLOUT, NOW, step=step, plan=("a-1", "a-2", "a-0"), done=done)


def test_unset_or_empty_arms_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert CrashPoint.from_env() is None
    monkeypatch.setenv(ENV, " ")
    assert CrashPoint.from_env() is None


def test_reached_at_the_steps_prefix_once_enough_members_are_done(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, '{"step": "restart:", "done": 1}')
    point = CrashPoint.from_env()
    assert point == CrashPoint("restart:", 1)
    assert not point.reached(rollout("restart:a-1"))
    assert point.reached(rollout("restart:a-2", done=("a-1",)))
    assert not point.reached(rollout("switchover-promote", done=("a-1", "a-2")))


def test_done_defaults_to_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, '{"step": "switchover-promote"}')
    point = CrashPoint.from_env()
    assert point is not None and point.reached(rollout("switchover-promote"))


@pytest.mark.parametrize("raw", ["switchover-promote", '{"done": 1}', '{"step": "x", "done": "many"}', "[]"])
def test_a_malformed_value_stops_the_operator_with_the_expected_form(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(SystemExit, match=f"{ENV}=.*expected JSON"):
        CrashPoint.from_env()
