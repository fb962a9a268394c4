"""Planned or refused work never flips a phase or a condition, not even for one decision: every decision
of a simulated cluster (tests/engine/model.py) is recorded, as a watch of the status would see it."""

from __future__ import annotations

import pytest

from pgherd.api.cluster import Phase, PostgresClusterSpec
from pgherd.engine import EngineStatus, RestoreView, decide
from pgherd.engine.conditions import ConditionType
from pgherd.engine.plan import Decision

from .model import ModelCluster


def spec(instances: int) -> PostgresClusterSpec:
    return PostgresClusterSpec.model_validate(
        {
            "instances": instances,
            "failover": {"detectionSeconds": 3},
            "image": "img:1",
            "backup": {"store": {"s3": {"bucket": "bkt", "credentials": {"secretName": "s3"}}}},
        }
    )


class Operator:
    """The engine over the model, one decision per simulated half second, every decision kept."""

    def __init__(self, instances: int) -> None:
        self.spec = spec(instances)
        self.model = ModelCluster(self.spec)
        self.status = EngineStatus()
        self.decisions: list[Decision] = []

    def step(self) -> Decision:
        decision = decide(self.spec, self.model.observe(), self.status)
        self.status = decision.status
        self.decisions.append(decision)
        for action in decision.actions:
            self.model.apply(action)
        if self.model.switchover_to is not None and self.status.operation is not None:
            self.model.switchover_to = None  # the adapter clears the request once it is taken
        self.model.catch_up_all()
        self.model.complete_restarts()
        self.model.tick(0.5)
        return decision

    def until(self, done: object, steps: int = 200) -> None:
        for _ in range(steps):
            decision = self.step()
            if callable(done) and done(decision):
                return
        raise AssertionError(f"not reached: last {self.decisions[-1].phase} {self.decisions[-1].message}")

    def running(self) -> None:
        self.until(lambda d: d.phase is Phase.RUNNING and not d.actions)


def quorum_healthy(decision: Decision) -> bool | None:
    found = next((c for c in decision.conditions if c.type is ConditionType.QUORUM_HEALTHY), None)
    return None if found is None else found.status


@pytest.mark.parametrize("instances", [3, 5])
def test_quorum_healthy_stays_true_through_a_planned_switchover(instances: int) -> None:
    operator = Operator(instances)
    operator.running()
    old = operator.status.current_primary
    start = len(operator.decisions)
    operator.model.switchover_to = "pg-1" if old != "pg-1" else "pg-2"
    operator.until(lambda d: d.status.current_primary != old and d.phase is Phase.RUNNING and not d.actions)
    during = operator.decisions[start:]
    assert any(d.phase is Phase.SWITCHING_OVER for d in during)
    flips = [(d.phase, d.message) for d in during if quorum_healthy(d) is not True]
    assert not flips, f"QuorumHealthy not True during a planned switchover: {flips}"


def test_a_refused_restore_never_turns_the_cluster_failed() -> None:
    operator = Operator(3)
    operator.running()
    start = len(operator.decisions)
    operator.model.restores["r1"] = RestoreView("r1", backup="no-such-backup", created_at=operator.model.now)
    operator.until(lambda d: operator.model.restores["r1"].phase == "Failed")
    operator.step()
    seen = [(d.phase, d.message) for d in operator.decisions[start:]]
    assert all(phase is Phase.RUNNING for phase, _ in seen), f"phases written: {seen}"
    assert "no-such-backup" in seen[0][1]
