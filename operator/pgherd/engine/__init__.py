"""The pgherd engine: a pure function from (spec, observed ClusterView, recorded EngineStatus) to a
Decision (phase, conditions, actions, status to record). No I/O, no clock, no kopf, no psycopg: both
platform adapters (kube, local) drive it. See docs/engine.md."""

from pgherd.engine.decide import decide
from pgherd.engine.plan import Decision
from pgherd.engine.status import EngineStatus, Operation, OperationKind
from pgherd.engine.view import (
    BackupView,
    ClusterView,
    JobKind,
    JobState,
    JobView,
    MemberView,
    RestoreView,
    Role,
)

__all__ = [
    "BackupView",
    "ClusterView",
    "Decision",
    "EngineStatus",
    "JobKind",
    "JobState",
    "JobView",
    "MemberView",
    "Operation",
    "OperationKind",
    "RestoreView",
    "Role",
    "decide",
]
