"""A cluster's phase and operation in words: what the phase means, why the engine is there (its own
message), since when, what it does next and when.

Written from the engine's rules (pgherd.engine: decide, failover, switchover, rollout, recovery,
upgrade, backups) and with its own timeouts, read from its modules, so that a deadline printed here is
the one the engine keeps. Pure: a status document in, an Explanation out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from pgherd.api.cluster import Phase
from pgherd.engine import backups as engine_backups
from pgherd.engine.quorum import majority
from pgherd.engine.rollout import PRIMARY_RESTART_TIMEOUT, STEP_TIMEOUT
from pgherd.engine.status import EngineStatus, Operation, OperationKind
from pgherd.engine.switchover import SWITCHOVER_TIMEOUT
from pgherd.engine.upgrade import STOP_TIMEOUT
from pgherd.engine.view import parse_time
from pgherd_backup.retention import parse_duration
from pgherd_backup.timestamps import rfc3339

JSON = dict[str, Any]

# What each phase means, from the engine's routing (decide.py) and docs/engine.md's table.
MEANING: dict[str, str] = {
    Phase.PENDING: "the first member waits for what it is made from: bootstrap.fromBackup names a Backup"
    " that is not Completed yet",
    Phase.CREATING: "the first member is initialized (initdb, or from a snapshot), then the others are cloned"
    " from it; Running once every member has streamed and joined the quorum",
    Phase.RUNNING: "every member streams from the primary and is ready, the quorum is steady, no operation"
    " runs",
    Phase.DEGRADED: "a member does not stream or is not ready, or the primary is unavailable and its failure"
    " not confirmed (yet): members are repaired (rejoined, created again) and a lost primary is timed",
    Phase.SCALING: "members join or leave (spec.instances changed): the quorum changes one member at a time",
    Phase.UPGRADING: "a rolling update (image, restart-only parameters, resources, a restart asked for) or a"
    " major upgrade runs: one member at a time, replicas first, the primary last",
    Phase.SWITCHING_OVER: "a planned switchover: the primary stops cleanly, the target catches up exactly,"
    " then is promoted; writes pause for about a second",
    Phase.FAILING_OVER: "the primary's failure is confirmed by a majority: the old primary is fenced, then the"
    " reachable replica holding the most WAL is promoted",
    Phase.QUORUM_LOST: "a majority of the members cannot be reached: nothing is promoted (the reachable ones"
    " may miss acknowledged commits)",
    Phase.RECOVERING: "recovery from backup (recovery.onQuorumLoss: RestoreFromBackup): every member fenced,"
    " one restored from the snapshot, the others re-cloned from it",
    Phase.RESTORING: "a Restore is carried out in place: every member fenced, one restored from the snapshot"
    " and the archived WAL, promoted on a new timeline, the others rebuilt from it",
    Phase.PAUSED: "spec.paused is set: the operator observes and reports, and acts on nothing (no failover"
    " either)",
    Phase.FAILED: "an operation was aborted or cannot be carried out; the cluster serves where it can, and"
    " failover still works",
    Phase.DELETING: "the cluster is being deleted; its volumes stay unless storage.deletePolicy is Delete",
}


# What the engine does next when no operation, lost primary or lost quorum says more (decide.py: membership
# upkeep under a healthy primary).
AT_REST: dict[str, str] = {
    Phase.PENDING: "creates the first member once what it is made from is ready",
    Phase.CREATING: "creates the other members from the primary; Running once each streams and joined the quorum",
    Phase.RUNNING: "nothing: it watches (members every 2 s) and acts on the next change",
    Phase.DEGRADED: "rejoins or creates again each member that does not stream, until every one is ready",
    Phase.SCALING: "a new member joins the quorum once it streams and holds every acknowledged commit (the"
    " synchronous standbys widened first); a leaving one leaves the quorum first, then is deleted and its"
    " replication slot dropped",
    Phase.QUORUM_LOST: "waits for members to return: with the primary up, commits wait for a majority",
    Phase.FAILED: "keeps the cluster serving (members repaired, failover on); the reason above says what to change",
}
# Phases in which the engine takes no Backup (it needs a healthy primary, and acts at all).
_NO_BACKUPS = (Phase.RESTORING, Phase.RECOVERING, Phase.PAUSED, Phase.DELETING)


@dataclass(frozen=True)
class Step:
    name: str
    text: str
    state: str  # done | current | todo


@dataclass(frozen=True)
class OperationText:
    kind: str
    reason: str
    started_at: datetime | None
    step: str
    step_started_at: datetime | None
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Explanation:
    phase: str
    meaning: str
    reason: str  # the engine's own message
    waiting: bool  # the engine takes no action: it waits (condition Waiting)
    since: datetime | None
    since_what: str
    next: tuple[str, ...] = ()
    operation: OperationText | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


def engine_status(status: Mapping[str, Any]) -> EngineStatus | None:
    """status.engine as the engine reads it back, believed only where the rest of the status agrees;
    None when absent or unreadable.

    The status is written by JSON merge patches, in which a key left out is kept: a field the engine
    cleared may linger in status.engine. The top-level fields and the conditions are written whole, so
    they decide: the operation is status.operation's, a lost primary's clock counts only while
    PrimaryAvailable is False, the quorum's while QuorumHealthy is False, an aborted operation while
    Progressing is False, a replica kept on the old major while PostgresVersionReached says so."""
    recorded = status.get("engine")
    if not isinstance(recorded, dict):
        return None
    try:
        engine = EngineStatus.from_dict(recorded)
    except (KeyError, TypeError, ValueError):
        return None
    operation: Operation | None = None
    if isinstance(status.get("operation"), dict):
        try:
            operation = Operation.from_dict(status["operation"])
        except (KeyError, TypeError, ValueError):
            operation = None

    def condition_is(kind: str, value: str, reason: str | None = None) -> bool:
        found = _condition(status, kind) or {}
        return found.get("status") == value and (reason is None or found.get("reason") == reason)

    return replace(
        engine,
        operation=operation,
        primary_lost_since=engine.primary_lost_since if condition_is("PrimaryAvailable", "False") else None,
        quorum_lost_since=engine.quorum_lost_since if condition_is("QuorumHealthy", "False") else None,
        aborted=engine.aborted if operation is None and condition_is("Progressing", "False") else None,
        kept=engine.kept if condition_is("PostgresVersionReached", "True", "OldMajorKept") else None,
    )


def _condition(status: Mapping[str, Any], kind: str) -> JSON | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)


def at(moment: datetime) -> str:
    """One way to write a moment: RFC 3339 in UTC, to the second."""
    return rfc3339(moment)


def ago(moment: datetime, now: datetime) -> str:
    """How long before ``now`` (or after it: "in ...")."""
    seconds = (now - moment).total_seconds()
    text = duration(abs(seconds))
    return f"{text} ago" if seconds >= 0 else f"in {text}"


def duration(seconds: float) -> str:
    whole = round(seconds)
    if whole < 120:
        return f"{whole} s"
    if whole < 7200:
        return f"{whole // 60} min"
    if whole < 2 * 86400:
        return f"{whole // 3600} h {whole % 3600 // 60} min"
    return f"{whole // 86400} d"


def when(moment: datetime, now: datetime) -> str:
    return f"{at(moment)} ({ago(moment, now)})"


def explain(cluster: Mapping[str, Any], now: datetime) -> Explanation:
    spec: Mapping[str, Any] = cluster.get("spec") or {}
    status: Mapping[str, Any] = cluster.get("status") or {}
    phase = str(status.get("phase") or Phase.PENDING)
    engine = engine_status(status)
    waiting = _condition(status, "Waiting")
    reason = str(status.get("message") or (waiting or {}).get("message") or "")
    if not reason:
        ready = _condition(status, "Ready")
        reason = str((ready or {}).get("message") or "")
    if not status:
        reason = "the operator has not written a status yet: is it running, and watching this namespace?"
    operation = engine.operation if engine is not None else None
    since, since_what = _since(status, engine, operation)
    nexts = _next(phase, spec, status, engine, operation, now)
    return Explanation(
        phase=phase,
        meaning=MEANING.get(phase, "a phase this plugin does not know: a newer operator?"),
        reason=reason,
        waiting=(waiting or {}).get("status") == "True",
        since=since,
        since_what=since_what,
        next=tuple(nexts),
        operation=None if operation is None else _operation_text(operation, spec, engine),
    )


# -- since when -------------------------------------------------------------------------------------------


def _since(
    status: Mapping[str, Any], engine: EngineStatus | None, operation: Operation | None
) -> tuple[datetime | None, str]:
    if operation is not None:
        if operation.step_started_at is not None and operation.step:
            return operation.step_started_at, f"step {operation.step}"
        return operation.started_at, f"the {operation.kind}"
    if engine is not None and engine.primary_lost_since is not None:
        return engine.primary_lost_since, "the primary was lost"
    if engine is not None and engine.quorum_lost_since is not None:
        return engine.quorum_lost_since, "the quorum was lost"
    ready = _condition(status, "Ready")
    moment = parse_time((ready or {}).get("lastTransitionTime"))
    if moment is not None:
        return moment, f"Ready {str((ready or {}).get('status', '')).lower()}"
    return None, ""


# -- what comes next --------------------------------------------------------------------------------------


def _deadline(operation: Operation, limit: timedelta) -> datetime:
    return (operation.step_started_at or operation.started_at) + limit


def _detection(spec: Mapping[str, Any]) -> int:
    return int((spec.get("failover") or {}).get("detectionSeconds") or 5)


def _next(
    phase: str,
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    engine: EngineStatus | None,
    operation: Operation | None,
    now: datetime,
) -> list[str]:
    if phase == Phase.DELETING:
        return ["nothing: the operator's finalizer lets the cluster go"]
    if phase == Phase.PAUSED:
        paused = ["nothing, not even a failover, until spec.paused is false (kubectl pgherd resume)"]
        if operation is not None:
            paused.append(f"the {operation.kind} recorded (step {operation.step}) resumes then")
        return paused
    out: list[str] = []
    if operation is not None:
        out += _operation_next(operation, spec, engine, now)
    elif engine is not None:
        out += _waiting_next(spec, engine, now)
    if engine is not None and engine.aborted is not None and operation is None:
        out.append(_aborted_next(engine.aborted))
    if engine is not None and engine.kept is not None:
        kept = engine.kept
        keep_for = str((spec.get("upgrade") or {}).get("keepOldMajorFor") or "1h")
        until = kept.since + parse_duration(keep_for)
        out.append(
            f"{kept.member} stays on PostgreSQL {kept.major} as the way back until {when(until, now)}"
            f" (upgrade.keepOldMajorFor {keep_for}): `kubectl pgherd upgrade confirm` releases it now,"
            " `kubectl pgherd upgrade rollback` goes back to it"
        )
    wanted, major = spec.get("postgresVersion"), status.get("postgresVersion")
    upgrading = operation is not None and operation.kind is OperationKind.MAJOR_UPGRADE
    aborted = engine is not None and engine.aborted is not None
    if (
        isinstance(wanted, int)
        and isinstance(major, int)
        and wanted > major
        and not upgrading
        and not aborted
    ):
        out.append(f"upgrades PostgreSQL {major} to {wanted} once the cluster is settled (Running)")
    if not out:
        out.append(AT_REST.get(phase, "nothing more this plugin can tell"))
    due = next_scheduled(spec, engine, now)
    if due is not None and status.get("currentPrimary") and phase not in _NO_BACKUPS:
        out.append(f"a scheduled Backup ({(spec.get('backup') or {}).get('schedule')}) at {when(due, now)}")
    return out


def next_scheduled(spec: Mapping[str, Any], engine: EngineStatus | None, now: datetime) -> datetime | None:
    """When the engine creates the next scheduled Backup: the schedule's next run after the last one it
    recorded (or from now, before the first), as backups.plan() decides it."""
    schedule = (spec.get("backup") or {}).get("schedule")
    if not schedule:
        return None
    last = engine.last_scheduled_backup if engine is not None else None
    try:
        return engine_backups.next_run(str(schedule), last or now)
    except (ValueError, KeyError):
        return None


def _waiting_next(spec: Mapping[str, Any], engine: EngineStatus, now: datetime) -> list[str]:
    out = []
    detection = _detection(spec)
    failover_on = (spec.get("failover") or {}).get("enabled", True) is not False
    primary = engine.current_primary
    if engine.quorum_lost_since is not None:
        recovery = spec.get("recovery") or {}
        if recovery.get("onQuorumLoss") == "RestoreFromBackup":
            grace = max(timedelta(seconds=15), timedelta(seconds=3 * detection))
            start = engine.quorum_lost_since + grace
            out.append(
                f"restores from Backup {recovery.get('backup') or 'latest'} at {when(start, now)} at the earliest,"
                " and only once a majority of the members' data is reported lost (never on unreachability"
                " alone); until then it waits for members to return"
            )
        else:
            out.append(
                "waits for the members to return (recovery.onQuorumLoss: Wait): nothing is promoted. A Restore"
                " (kubectl pgherd restore) restores anyway"
            )
    elif engine.primary_lost_since is not None:
        if failover_on:
            earliest = engine.primary_lost_since + timedelta(seconds=detection)
            needed = majority(len(engine.voters)) if engine.voters else 1
            out.append(
                f"fails over at {when(earliest, now)} at the earliest: once {primary} has been unreachable for"
                f" failover.detectionSeconds ({detection} s) and {needed} of the {len(engine.voters)} quorum"
                f" members lost it as long, {primary} is fenced and the replica holding the most WAL promoted"
            )
        else:
            out.append(f"waits for {primary} to come back: failover.enabled is false")
    return out


def _aborted_next(aborted: Operation) -> str:
    failed = aborted.failed or "no reason recorded"
    if aborted.kind is OperationKind.ROLLOUT:
        return (
            f"the rolling update to revision {aborted.revision} was aborted ({failed}): it starts again when the"
            " revision changes (a spec change, or kubectl pgherd restart)"
        )
    if aborted.kind is OperationKind.SWITCHOVER:
        return f"the switchover to {aborted.target} was abandoned ({failed}): ask again with kubectl pgherd switchover"
    if aborted.kind is OperationKind.MAJOR_UPGRADE:
        return (
            f"the upgrade to PostgreSQL {aborted.to_major} did not happen or was rolled back ({failed}): it is"
            " tried again when the annotation pgherd.io/retry-upgrade takes a new value"
        )
    return f"the {aborted.kind} {aborted.restore or ''} failed ({failed}): create a Restore to try again"


def _operation_next(
    operation: Operation, spec: Mapping[str, Any], engine: EngineStatus | None, now: datetime
) -> list[str]:
    kind, step = operation.kind, operation.step
    source, target = operation.source, operation.target
    if kind is OperationKind.FAILOVER:
        if step == "fence":
            return [
                f"fences {source} again at every pass until it is gone, stopped or answers read-only; then"
                " promotes the reachable replica holding the most WAL, if a majority is reachable"
            ]
        deadline = _deadline(operation, timedelta(seconds=_detection(spec)))
        return [
            f"promotes {target} until it is observed primary; if it does not answer by {when(deadline, now)} it"
            " is treated as the primary and its failure confirmed like any other (never a second promotion)"
        ]
    if kind is OperationKind.SWITCHOVER or step.startswith("switchover-"):
        return _switchover_next(operation, now)
    if kind is OperationKind.ROLLOUT:
        return _rollout_next(operation, now)
    if kind in (OperationKind.RESTORE, OperationKind.RECOVERY):
        source_text = operation.backup or operation.snapshot_id or "the snapshot"
        texts = {
            "fence": "restores once every member is fenced (stopped, or running read-only): nothing writes"
            " while the cluster is rebuilt",
            "restore": f"promotes {target} on a new timeline once the restore of {source_text} ends (a failed"
            " restore leaves the cluster Failed; a new Restore tries again)",
            "promote": f"promotes {target}, then re-clones the other members from it",
            "rebuild": f"done once every other member streams from {target} (their old data kept aside)",
        }
        return [texts.get(step, f"step {step}")]
    if kind is OperationKind.MAJOR_UPGRADE:
        return _upgrade_next(operation, now)
    return [f"step {step} of the {kind}"]


def _switchover_next(operation: Operation, now: datetime) -> list[str]:
    source, target = operation.source, operation.target
    deadline = _deadline(operation, SWITCHOVER_TIMEOUT)
    if operation.step == "switchover-fence":
        return [
            f"once {source} has stopped cleanly, waits for {target} to hold its final WAL position; abandoned"
            f" at {when(deadline, now)} if {source} has not stopped ({source} then resumes as the primary)"
        ]
    if operation.step == "switchover-catchup":
        return [
            f"promotes {target} once it holds {source}'s final WAL position; abandoned at {when(deadline, now)}"
            f" if it does not ({source} then resumes, nothing promoted)"
        ]
    return [
        f"promotes {target} and re-points the others; no timeout now: once {target} may be promoted, no other member is"
    ]


def _rollout_next(operation: Operation, now: datetime) -> list[str]:
    step, source = operation.step, operation.source
    if step.startswith("switchover-"):
        return _switchover_next(operation, now)
    remaining = [n for n in operation.plan if n not in operation.done]
    if step.startswith("restart:"):
        member = step.split(":", 1)[1]
        deadline = _deadline(operation, STEP_TIMEOUT)
        return [
            f"waits for {member} to be Ready and caught up at the new revision; aborts at {when(deadline, now)}"
            f" if it is not (the primary is never restarted as a fallback); {len(remaining)} of"
            f" {len(operation.plan)} to go"
        ]
    if step.startswith("before:"):
        member = step.split(":", 1)[1]
        deadline = _deadline(operation, STEP_TIMEOUT)
        return [
            f"restarts {member} once every other member is ready and the quorum holds without it; aborts at"
            f" {when(deadline, now)} otherwise"
        ]
    if step == "await-target":
        deadline = _deadline(operation, STEP_TIMEOUT)
        return [
            f"switches over from {source} once an updated replica is caught up; aborts at {when(deadline, now)}"
        ]
    if step == "restart-primary":
        deadline = _deadline(operation, PRIMARY_RESTART_TIMEOUT)
        return [
            f"waits for the primary {source} to come back from its restart in place; aborts at"
            f" {when(deadline, now)}, and the ordinary failure handling takes over"
        ]
    if step in ("old-primary", "restart-old-primary"):
        deadline = _deadline(operation, STEP_TIMEOUT)
        return [
            f"restarts the old primary {source} last, once it streams from the new primary; aborts at {when(deadline, now)}"
        ]
    return [f"restarts the next member of the plan: {', '.join(remaining) or 'none left'}"]


def _upgrade_next(operation: Operation, now: datetime) -> list[str]:
    step = operation.step
    old, new = operation.from_major, operation.to_major
    if step == "backup":
        return [
            f"runs the preflight once Backup {operation.backup or '(being named)'} is Completed; a Failed one"
            " refuses the upgrade, the cluster untouched (writes go on)"
        ]
    if step == "check":
        deadline = _deadline(operation, STOP_TIMEOUT)
        return [
            f"stops writes once pg_upgrade --check passed and a replica is caught up to keep on PostgreSQL {old};"
            f" refused at {when(deadline, now)} if none is (writes go on)"
        ]
    if step == "stop":
        deadline = _deadline(operation, STOP_TIMEOUT)
        return [
            f"upgrades {operation.source} once {operation.kept} holds every write; if not by {when(deadline, now)},"
            f" {operation.source} resumes writes on PostgreSQL {old}, nothing changed"
        ]
    if step == "upgrade":
        return [
            f"resumes writes on PostgreSQL {new} once {operation.source} runs it; a failure rolls back to"
            f" {operation.kept} on PostgreSQL {old}, losing nothing acknowledged"
        ]
    if step == "rebuild":
        return [
            f"done once every replica but {operation.kept} streams from {operation.target} on PostgreSQL {new}"
        ]
    if step == "rollback":
        return [
            f"promotes {operation.kept} on PostgreSQL {old} once {operation.target} is fenced ({operation.rollback})"
        ]
    return [f"step {step} of the upgrade to PostgreSQL {new}"]


# -- the operation's steps --------------------------------------------------------------------------------


def _states(order: list[tuple[str, str]], current: str) -> tuple[Step, ...]:
    names = [name for name, _ in order]
    index = names.index(current) if current in names else -1
    return tuple(
        Step(name, text, "done" if i < index else ("current" if i == index else "todo"))
        for i, (name, text) in enumerate(order)
    )


def _operation_text(
    operation: Operation, spec: Mapping[str, Any], engine: EngineStatus | None
) -> OperationText:
    return OperationText(
        kind=str(operation.kind),
        reason=operation.reason,
        started_at=operation.started_at,
        step=operation.step,
        step_started_at=operation.step_started_at,
        steps=steps(operation, spec, engine),
    )


def steps(operation: Operation, spec: Mapping[str, Any], engine: EngineStatus | None) -> tuple[Step, ...]:
    """The operation's steps, each done, current or to do."""
    kind, step = operation.kind, operation.step
    source, target = operation.source, operation.target
    if kind is OperationKind.FAILOVER:
        return _states(
            [
                ("fence", f"fence the old primary {source} until it provably cannot write"),
                ("promote", f"promote {target or 'the reachable replica holding the most WAL'}"),
                ("finish", "point the rw Service at it, re-point the other members"),
            ],
            step,
        )
    if kind is OperationKind.SWITCHOVER:
        return _switchover_steps(operation)
    if kind is OperationKind.ROLLOUT:
        return _rollout_steps(operation, spec, engine)
    if kind in (OperationKind.RESTORE, OperationKind.RECOVERY):
        others = [n for n in operation.plan if n != target]
        rebuilt = [n for n in operation.done if n != target]
        replay = (
            f", replay the archived WAL to {operation.recovery_target}" if operation.recovery_target else ""
        )
        return _states(
            [
                ("fence", f"fence every member ({', '.join(operation.plan) or 'none'})"),
                (
                    "restore",
                    f"restore {operation.backup or operation.snapshot_id} into"
                    f" {target or 'the lowest member whose agent answers'}{replay}",
                ),
                ("promote", f"promote {target or 'it'} on a new timeline"),
                (
                    "rebuild",
                    f"re-clone {', '.join(others) or 'the others'} from it"
                    + (f" (done: {', '.join(rebuilt)})" if rebuilt else ""),
                ),
            ],
            step,
        )
    if kind is OperationKind.MAJOR_UPGRADE:
        old, new = operation.from_major, operation.to_major
        order = [
            ("backup", f"a Completed Backup of PostgreSQL {old} ({operation.backup or 'to be taken'})"),
            ("check", f"pg_upgrade --check and room on {source}'s volume (writes go on)"),
            ("stop", f"stop writes; {operation.kept or 'a caught-up replica'} kept on PostgreSQL {old}"),
            ("upgrade", f"pg_upgrade --link on {source}, PostgreSQL {new} started and checked"),
            ("rebuild", f"re-clone the other replicas on PostgreSQL {new}"),
        ]
        if step == "rollback":
            order.append(("rollback", f"promote {operation.kept} on PostgreSQL {old}: {operation.rollback}"))
        return _states(order, step)
    return (Step(step or str(kind), operation.reason, "current"),)


def _switchover_steps(operation: Operation) -> tuple[Step, ...]:
    source, target = operation.source, operation.target
    return _states(
        [
            ("switchover-fence", f"drain {source}: a clean shutdown (writes refused)"),
            ("switchover-catchup", f"{target} catches up with {source}'s final WAL position"),
            ("switchover-promote", f"promote {target}, re-point the others"),
        ],
        operation.step,
    )


def _rollout_steps(
    operation: Operation, spec: Mapping[str, Any], engine: EngineStatus | None
) -> tuple[Step, ...]:
    step, source = operation.step, operation.source
    primary = engine.current_primary if engine is not None else source
    out: list[Step] = []
    for name in operation.plan:
        if name == source:
            continue
        state = "done" if name in operation.done else "todo"
        if step in (f"restart:{name}", f"before:{name}"):
            state = "current"
        out.append(Step(f"restart:{name}", f"restart {name}", state))
    if source in operation.plan:
        in_place = (spec.get("upgrade") or {}).get("primaryUpdateMethod") == "restart" or spec.get(
            "instances"
        ) == 1
        if in_place:
            state = "current" if step in ("restart-primary", f"before:{source}") else "todo"
            out.append(Step("restart-primary", f"restart the primary {source} in place", state))
        else:
            moved = primary != source
            switching = step == "await-target" or step.startswith("switchover-")
            state = "done" if moved and not switching else ("current" if switching else "todo")
            out.append(Step("switchover", f"switch over from {source} to an updated replica", state))
            old_state = (
                "current"
                if moved and step in ("old-primary", "restart-old-primary", f"before:{source}")
                else "todo"
            )
            out.append(Step("restart-old-primary", f"restart the old primary {source}", old_state))
    return tuple(out)
