"""The engine's answer: phase, conditions, the next actions, and the status to record first."""

from __future__ import annotations

from dataclasses import dataclass

from pgherd.api.cluster import Phase
from pgherd.engine.actions import Action, RecordEvent
from pgherd.engine.conditions import Condition, ConditionType
from pgherd.engine.status import EngineStatus


@dataclass(frozen=True)
class Decision:
    """What to do now. The adapter writes ``status`` (and phase/conditions) first, then applies
    ``actions`` in order, then observes again and calls decide() anew."""

    phase: Phase
    conditions: tuple[Condition, ...]
    actions: tuple[Action, ...]
    status: EngineStatus
    message: str = ""
    # What changed in the engine's memory, told to people (engine/narrate.py): posted once the status is
    # written, apart from ``actions`` (these are no orders, and never repeated).
    events: tuple[RecordEvent, ...] = ()

    @property
    def current_primary(self) -> str | None:
        return self.status.current_primary

    @property
    def target_primary(self) -> str | None:
        operation = self.status.operation
        return operation.target if operation is not None and operation.failed is None else None

    def condition(self, kind: ConditionType) -> Condition | None:
        return next((c for c in self.conditions if c.type is kind), None)
