"""What a decision changed, told to people: the Events that make `kubectl describe pgc` say what the
engine did and why.

The engine's memory changes once for each decision it acts on: an operation recorded (started), moved
to its next step, ended (completed, or aborted: failed), a new primary recorded, the first primary of a
new cluster. ``narrate`` compares the memory before a decision with the one after it and says what
changed, in the engine's own words (each operation's ``reason``). It is pure like ``decide``, which
calls it (``Decision.events``); the adapters post its Events once the status is written, so a change
is told once and a later tick, which finds the memory as it left it, never tells it again.

A major upgrade tells its start, its pg_upgrade and its way back in its own Events (engine/upgrade.py:
UpgradeStarted, MajorUpgraded, UpgradeRefused, UpgradeRolledBack, UpgradeConfirmed); here only its other
steps and its end. A requested switchover is answered by the adapter (the Event `Switchover`, which
`kubectl pgherd switchover` reads): here its start and steps.
"""

from __future__ import annotations

from datetime import datetime

from pgherd.engine.actions import RecordEvent
from pgherd.engine.status import EngineStatus, Operation, OperationKind
from pgherd.engine.switchover import REQUESTED
from pgherd.engine.view import ClusterView

PREFIX = {
    OperationKind.FAILOVER: "Failover",
    OperationKind.SWITCHOVER: "Switchover",
    OperationKind.ROLLOUT: "Rollout",
    OperationKind.SCALE_DOWN: "ScaleDown",
    OperationKind.RECOVERY: "Recovery",
    OperationKind.RESTORE: "Restore",
    OperationKind.MAJOR_UPGRADE: "Upgrade",
}
# Started by a failure, not by a person's request: a Warning from the start.
UNPLANNED = (OperationKind.FAILOVER, OperationKind.RECOVERY)
# Waits, not actions (the phase's message says what for).
WAITING_STEPS = ("before:", "await-target")
RESTART_STEPS = ("restart:", "restart-primary", "restart-old-primary")


def narrate(before: EngineStatus, after: EngineStatus, view: ClusterView) -> tuple[RecordEvent, ...]:
    """The Events of the change from ``before`` to ``after`` (``view``: what the decision saw)."""
    events: list[RecordEvent] = []
    old, new = before.operation, after.operation
    if not before.initialized and after.initialized:
        events.append(
            RecordEvent("Initialized", f"{after.current_primary} is the first primary{_timeline(after)}")
        )
    if new is not None and not _same(old, new):
        events += _started(new, old)
    elif new is not None and old is not None and new.step != old.step:
        events += _step(new)
    if before.current_primary is not None and after.current_primary not in (None, before.current_primary):
        why = old or new
        events.append(
            RecordEvent(
                "Promoted",
                f"{after.current_primary} is the primary{_timeline(after)}, was {before.current_primary}"
                + (f": {_what(why)}" if why is not None else ""),
            )
        )
    aborted = after.aborted if not _same(after.aborted, before.aborted) else None
    if old is not None and new is None and not _same(aborted, old):
        events += _ended(old, after, view)
    if aborted is not None and aborted.failed is not None and _told_here(aborted):
        events.append(
            RecordEvent(f"{PREFIX[aborted.kind]}Failed", f"{_what(aborted)} failed: {aborted.failed}", True)
        )
    return tuple(events)


def _same(a: Operation | None, b: Operation | None) -> bool:
    return a is not None and b is not None and a.kind is b.kind and a.started_at == b.started_at


def _told_here(operation: Operation) -> bool:
    """Not a major upgrade's end nor a requested switchover's: those have Events of their own."""
    if operation.kind is OperationKind.MAJOR_UPGRADE:
        return False
    return not (operation.kind is OperationKind.SWITCHOVER and operation.reason == REQUESTED)


def _started(new: Operation, old: Operation | None) -> list[RecordEvent]:
    if new.kind is OperationKind.MAJOR_UPGRADE:
        # Its start is UpgradeStarted; a rollback asked for after it ended begins at a later step.
        return _step(new) if new.step != "backup" else []
    step = _step_text(new)
    message = _what(new) + (f"; {step}" if step else "")
    if old is not None and old.kind is not new.kind:
        message += f" (the {_what(old)} stops here)"
    return [RecordEvent(f"{PREFIX[new.kind]}Started", message, new.kind in UNPLANNED)]


def _step(operation: Operation) -> list[RecordEvent]:
    text = _step_text(operation)
    if not text:
        return []
    if operation.step.startswith(RESTART_STEPS):
        return [RecordEvent("MemberRestarted", f"{text}: {operation.reason}")]
    return [RecordEvent(f"{PREFIX[operation.kind]}Step", f"{_what(operation)}: {text}")]


def _ended(old: Operation, after: EngineStatus, view: ClusterView) -> list[RecordEvent]:
    """An operation that ended without being aborted completed when it left a primary up (the recorded
    one, as the view shows it); else it stopped short (its new primary vanished, the primary failed)."""
    primary = view.member(after.current_primary)
    if primary is None or not primary.is_primary:
        message = f"{_what(old)} stopped before its end: the primary {after.current_primary} is not available"
        return [RecordEvent(f"{PREFIX[old.kind]}Interrupted", message, True)]
    if not _told_here(old):
        return [] if old.kind is not OperationKind.MAJOR_UPGRADE else [_upgraded(old, view.now)]
    took = _took(old.started_at, view.now)
    if old.kind in (OperationKind.FAILOVER, OperationKind.SWITCHOVER):
        message = f"{_what(old)}: {after.current_primary} is the primary, after {took}"
    elif old.kind is OperationKind.ROLLOUT:
        message = f"{_what(old)}: every member runs it, after {took}"
    else:
        message = f"{_what(old)}: {after.current_primary} is the primary{_timeline(after)}, after {took}"
    return [RecordEvent(f"{PREFIX[old.kind]}Completed", message)]


def _upgraded(old: Operation, now: datetime) -> RecordEvent:
    message = (
        f"the upgrade to PostgreSQL {old.to_major} is done after {_took(old.started_at, now)}: every member"
        f" runs it"
        + (f" but {old.kept}, kept on PostgreSQL {old.from_major} until confirmed" if old.kept else "")
    )
    return RecordEvent("UpgradeCompleted", message)


def _what(operation: Operation) -> str:
    """The operation in a few words, with the reason it was decided for."""
    kind, reason = operation.kind, operation.reason
    if kind is OperationKind.FAILOVER:
        return f"failover from {operation.source} ({reason})"
    if kind is OperationKind.SWITCHOVER:
        return f"switchover from {operation.source} to {operation.target} ({reason})"
    if kind is OperationKind.ROLLOUT:
        return f"{reason} ({', '.join(operation.plan)}, in that order)"
    if kind in (OperationKind.RECOVERY, OperationKind.RESTORE):
        source = operation.backup or operation.snapshot_id or "the latest snapshot"
        target = f", to {operation.recovery_target}" if operation.recovery_target else ""
        return f"{kind.value.lower()} {operation.restore} from {source}{target} ({reason})"
    if kind is OperationKind.MAJOR_UPGRADE:
        return f"upgrade to PostgreSQL {operation.to_major} ({reason})"
    return f"{kind.value} ({reason})"


def _step_text(operation: Operation) -> str:
    """What the step does; empty for a wait."""
    step, source, target = operation.step, operation.source, operation.target
    if step.startswith(WAITING_STEPS):
        return ""
    if step.startswith("restart:"):
        member = step.split(":", 1)[1]
        return f"restarting {member} ({len(operation.done) + 1} of {len(operation.plan)})"
    kind = operation.kind
    texts = {
        "fence": f"fencing the old primary {source}"
        if kind is OperationKind.FAILOVER
        else "fencing every member: nothing may write while the data is replaced",
        "promote": f"promoting {target}",
        "switchover-fence": f"draining {source}: a clean shutdown (writes refused), then the promotion",
        "switchover-catchup": f"waiting for {target} to hold all of {source}'s WAL",
        "switchover-promote": f"promoting {target}",
        "replicas": f"restarting {len(operation.plan)} member(s)",
        "old-primary": f"switched over to {target}: the old primary {source} is restarted last",
        "restart-primary": f"restarting the primary {source} in place",
        "restart-old-primary": f"restarting the old primary {source}",
        "restore": f"restoring {target}: its data directory moved aside, the snapshot fetched, WAL replayed",
        "rebuild": f"re-cloning the other members from {target}",
        "backup": "preflight: a recent Backup",
        "check": f"preflight: pg_upgrade --check on {source}",
        "stop": f"stopping writes on {source}",
        "upgrade": f"pg_upgrade --link of {source}",
        "rollback": f"rolling back to {operation.kept} on PostgreSQL {operation.from_major}: {operation.rollback}",
    }
    if kind in (OperationKind.RECOVERY, OperationKind.RESTORE) and step == "promote":
        return f"promoting {target} at the end of the restored WAL, on a new timeline"
    if kind is OperationKind.MAJOR_UPGRADE and step == "rebuild":
        return ""  # MajorUpgraded tells it
    return texts.get(step, f"step {step}")


def _timeline(status: EngineStatus) -> str:
    return f" on timeline {status.timeline}" if status.timeline is not None else ""


def _took(start: datetime, end: datetime) -> str:
    seconds = max(0.0, (end - start).total_seconds())
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
