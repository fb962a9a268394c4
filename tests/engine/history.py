"""A scripted cluster history, printed as canonical JSON (one decision per line).

``python -m tests.engine.history`` is run by test_determinism.py under several PYTHONHASHSEED values:
the decisions must be identical, so that nothing in the engine depends on set or dict iteration order.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from enum import Enum
from typing import Any

from pgherd.api.cluster import PrimaryUpdateMethod

from .test_properties import ClusterMachine


def canonical(value: Any) -> Any:
    """JSON-ready, with every set sorted: equal decisions print the same text under any hash seed."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {"__type__": type(value).__name__}
        for item in dataclasses.fields(value):
            if item.compare:
                out[item.name] = canonical(getattr(value, item.name))
        return out
    if isinstance(value, set | frozenset):
        return sorted((canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, datetime):
        return value.isoformat()
    return value


class Recorder(ClusterMachine):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def _operator_step(
        self, apply_all: bool = False, applied: int = 100, stale: bool = False, late: bool = False
    ) -> None:
        super()._operator_step(apply_all, applied, stale, late)
        self.lines.append(json.dumps(canonical(self.last), sort_keys=True))


def run() -> list[str]:
    """Bring-up, commits, the item-3 partition sequence, a rollout, a scale-down by two, a failover."""
    machine = Recorder()
    machine.setup(
        instances=5, quorum=True, method=PrimaryUpdateMethod.SWITCHOVER, restore_on_loss=True, fence_lags=True
    )
    for receivers in ({1, 2}, {3, 4}, {2, 4}, {1, 3}):
        machine.commit(receivers=receivers)
        machine.operator(applied=6, seconds=1)
    machine.isolate(node=0, cut=True)
    machine.operator(applied=0, seconds=0)
    machine.operator(applied=1, seconds=4)
    machine.isolate(node=1, cut=True)
    machine.operator(applied=1, seconds=0)
    machine.isolate(node=1, cut=False)
    machine.new_image()
    machine.operator(applied=6, seconds=0)
    machine.isolate(node=0, cut=False)
    machine.land_fences()
    for _ in range(30):
        machine.operator(applied=6, seconds=1)
        machine.model.catch_up_all()
        machine.complete_restarts()
    machine.scale(instances=3)
    for _ in range(30):
        machine.operator(applied=6, seconds=1)
        machine.model.catch_up_all()
    machine.crash(node=0)
    for _ in range(20):
        machine.operator(applied=6, seconds=1)
        machine.land_fences()
    machine.teardown()
    return machine.lines


if __name__ == "__main__":
    print("\n".join(run()))
