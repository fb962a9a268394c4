"""Major-version upgrade in place (``spec.postgresVersion`` above the major the data is on).

Started with a healthy, settled cluster on the spec's revision (a new image that carries both majors
is rolled out first, as any revision), and at least two members: one replica stays on the old major as
the way back. Steps of the MajorUpgrade operation (phase Upgrading):

``backup``    A Completed Backup younger than ``upgrade.backupMaxAge`` and of the data being upgraded
              (its major, its timeline), else a new one taken now (its snapshot Job streams a
              verified copy to the store). Writes go on.
``check``     The new major's ``pg_upgrade --check`` against the running primary and the room on its
              volume (CheckUpgrade). Writes go on. A failure here, or in ``backup``, refuses the
              upgrade: the cluster was never touched, the reason is in PostgresVersionReached and an
              Event.
``stop``      Writes stop cleanly: the primary is fenced (a clean shutdown hands every WAL record to
              the connected standbys) and the replica kept as the way back must hold its final WAL
              position exactly, in quorum and in async mode alike; then that replica is fenced too
              (stopped, untouched from here on). The other replicas keep serving reads. A replica that
              does not catch up in time: the primary resumes, nothing changed.
``upgrade``   ``pg_upgrade --link`` on the primary's volume by its agent, which then starts the new
              major read-write and checks it (UpgradeMember).
``rebuild``   The new primary takes the rw endpoint (the write downtime ends here: the Event says how
              long it was), alone in the quorum; the other replicas are re-cloned from it (their data
              kept aside) and join as they catch up. The statistics are rebuilt in the background.
              Done when every member but the kept one streams from it.
``rollback``  Any failure after ``stop`` and before the confirmation, or a person's
              ``pgherd.io/rollback-upgrade: "<major>"``: the primary is fenced (it must provably not
              write), the kept replica promoted on the old major: it holds every acknowledged write of
              the old major. Writes made on the new major since the upgrade are not in it: the new
              major's data directory is kept aside on its member's volume when that member is
              re-cloned, never deleted. The cluster then runs the old major; postgresVersion shows as
              not reached (PostgresVersionReached False, RolledBack) until ``pgherd.io/retry-upgrade``
              takes a new value.

After ``rebuild`` the operation ends and ``status.engine.kept`` remembers the replica kept on the old
major: membership upkeep leaves it alone, and no rollout starts, until the upgrade is confirmed
(``pgherd.io/confirm-upgrade: "<major>"``, or ``upgrade.keepOldMajorFor`` after the upgrade); it is
then re-cloned from the new primary like any member.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

from pgherd.api.backup import BackupPhase
from pgherd.api.cluster import Phase
from pgherd.engine.actions import (
    Action,
    CheckUpgrade,
    CreateBackup,
    Fence,
    Promote,
    RecordEvent,
    SetPrimary,
    SetSynchronousStandbys,
    Unfence,
    UpgradeMember,
)
from pgherd.engine.conditions import Condition, ConditionType, false, true
from pgherd.engine.context import Context, Outcome, by_most_data, cannot_write
from pgherd.engine.quorum import ASYNC
from pgherd.engine.status import EngineStatus, OldMajorKept, Operation, OperationKind
from pgherd.engine.view import MemberView, Role
from pgherd_backup.retention import parse_duration

RESTORED = "restored"  # the step of the record a restore of an older major leaves (status.aborted)
STOP_TIMEOUT = timedelta(seconds=60)  # for the primary's clean stop and the kept replica's catch-up
PHASE = Phase.UPGRADING


# -- when -------------------------------------------------------------------------------------------------


def observe_major(ctx: Context) -> Context:
    """``status.major`` from the primary's data directory when it is not recorded yet (a cluster from
    before the upgrades, or just bootstrapped)."""
    if ctx.status.major is not None:
        return ctx
    primary = ctx.healthy_primary()
    if primary is None or primary.data_major is None:
        return ctx
    return replace(ctx, status=replace(ctx.status, major=primary.data_major))


def wanted(ctx: Context) -> int | None:
    """The major to upgrade to now, or None: the spec asks for more than the data is on, and the
    upgrade to it was not refused or rolled back since the last pgherd.io/retry-upgrade value."""
    major = ctx.status.major
    if major is None or ctx.spec.postgres_version <= major:
        return None
    aborted = ctx.status.aborted
    if (
        aborted is not None
        and aborted.kind is OperationKind.MAJOR_UPGRADE
        and aborted.to_major == ctx.spec.postgres_version
        and aborted.retry == ctx.view.retry_upgrade
    ):
        return None
    return ctx.spec.postgres_version


def start(ctx: Context) -> Outcome | None:
    """Begin the upgrade the spec asks for (the caller found the cluster settled), or None."""
    major = wanted(ctx)
    if major is None:
        return None
    kept = ctx.status.kept
    if kept is not None:
        message = (
            f"postgresVersion {major}: the upgrade to {kept.to_major} is not confirmed yet ({kept.member}"
            f" is kept on PostgreSQL {kept.major}): confirm it (pgherd.io/confirm-upgrade) first"
        )
        return Outcome(Phase.RUNNING, ctx.status, message=message)
    primary = ctx.healthy_primary()
    assert primary is not None and ctx.status.major is not None
    operation = Operation(
        OperationKind.MAJOR_UPGRADE,
        started_at=ctx.now,
        source=primary.name,
        target=primary.name,
        from_major=ctx.status.major,
        to_major=major,
        retry=ctx.view.retry_upgrade,
        reason=f"postgresVersion {ctx.status.major} -> {major}",
    ).at("backup", ctx.now)
    refused = _refusal(ctx, operation)
    if refused is not None:
        return _refuse(ctx, operation, refused)
    status = replace(ctx.status, operation=operation, aborted=None)
    event = RecordEvent("UpgradeStarted", f"upgrading PostgreSQL {ctx.status.major} to {major}: preflight")
    outcome = advance(replace(ctx, status=status), operation)
    return replace(outcome, actions=(event, *outcome.actions))


def _refusal(ctx: Context, operation: Operation) -> str | None:
    if ctx.spec.instances < 2 or not [m for m in ctx.healthy_replicas() if ctx.wanted(m.name)]:
        return (
            "a major upgrade keeps one replica on the old major as the way back, and this cluster has"
            " none: scale it to 2 or more instances first"
        )
    store = ctx.spec.backup.store if ctx.spec.backup is not None else None
    if store is None:
        return (
            "a major upgrade starts from a Completed Backup, and backup.store is not set: configure a store"
            " (the upgrade then takes a Backup first)"
        )
    return None


# -- the steps ------------------------------------------------------------------------------------------


def advance(ctx: Context, operation: Operation) -> Outcome:
    status = replace(ctx.status, operation=operation)
    ctx = replace(ctx, status=status)
    requested = _rollback_requested(ctx, operation)
    if requested and operation.step in ("upgrade", "rebuild"):
        operation = replace(operation, rollback="asked for (pgherd.io/rollback-upgrade)").at(
            "rollback", ctx.now
        )
        ctx = replace(ctx, status=replace(status, operation=operation))
    step = operation.step
    if step in ("backup", "check"):
        primary = ctx.healthy_primary()
        if primary is None or primary.name != operation.source:
            return _refuse(
                ctx, operation, f"the primary {operation.source} became unavailable before writes stopped"
            )
        if requested:
            return _refuse(ctx, operation, "rolled back before writes stopped (pgherd.io/rollback-upgrade)")
        if ctx.spec.instances < 2:  # scaled down since it started
            return _refuse(ctx, operation, "scaled to one member: no replica to keep as the way back")
        if step == "backup":
            return _backup(ctx, operation)
        return _check(ctx, operation, primary)
    if step == "stop":
        return _stop(ctx, operation)
    if step == "upgrade":
        return _upgrade(ctx, operation)
    if step == "rebuild":
        return _rebuild(ctx, operation)
    if step == "rollback":
        return _rollback(ctx, operation)
    raise AssertionError(f"unknown major upgrade step {step!r}")


def _backup(ctx: Context, operation: Operation) -> Outcome:
    if operation.backup is None:
        recent = _recent_backup(ctx)
        name = recent or f"{ctx.view.cluster}-pre-pg{operation.to_major}-{ctx.now:%Y%m%d%H%M%S}"
        operation = replace(operation, backup=name)
        status = replace(ctx.status, operation=operation)
        if recent is None:
            return Outcome(
                PHASE,
                status,
                (CreateBackup(name, reason=f"before the upgrade to PostgreSQL {operation.to_major}"),),
                f"preflight: taking Backup {name}",
            )
        ctx = replace(ctx, status=status)
    backup = ctx.view.backup(str(operation.backup))
    if backup is None:
        # Recorded, not seen yet: created again (a no-op when it exists; the operator may have died
        # between recording its name and creating it).
        order = CreateBackup(
            str(operation.backup), reason=f"before the upgrade to PostgreSQL {operation.to_major}"
        )
        return Outcome(PHASE, ctx.status, (order,), f"preflight: taking Backup {operation.backup}")
    if backup.phase in (BackupPhase.PENDING, BackupPhase.RUNNING):
        return Outcome(PHASE, ctx.status, message=f"preflight: waiting for Backup {operation.backup}")
    if backup.phase != BackupPhase.COMPLETED:
        return _refuse(ctx, operation, f"the Backup taken first, {backup.name}, is {backup.phase}")
    operation = operation.at("check", ctx.now)
    primary = ctx.healthy_primary()
    assert primary is not None
    return _check(replace(ctx, status=replace(ctx.status, operation=operation)), operation, primary)


def _recent_backup(ctx: Context) -> str | None:
    limit = ctx.spec.upgrade.backup_max_age
    if limit is None:
        return None
    since = ctx.now - parse_duration(limit)
    # Of the data being upgraded: its major and its timeline (a Backup of the new major after an
    # earlier upgrade, or of a history a restore or a failover left behind, is no way back to it).
    data = (ctx.status.major, ctx.status.timeline)
    if None in data:
        return None
    done = [
        b
        for b in ctx.view.backups
        if b.phase == BackupPhase.COMPLETED
        and b.completed_at is not None
        and b.completed_at >= since
        and (b.major, b.timeline) == data
    ]
    return max(done, key=lambda b: (b.completed_at or ctx.now, b.name)).name if done else None


def request_id(operation: Operation, what: str) -> str:
    return f"pg{operation.to_major}-{what}-{operation.started_at:%Y%m%d%H%M%S}"


def _check(ctx: Context, operation: Operation, primary: MemberView) -> Outcome:
    wanted_id = request_id(operation, "check")
    ended = primary.last_action
    if ended is None or ended.request_id != wanted_id:
        order = CheckUpgrade(primary.name, int(operation.to_major or 0), wanted_id, reason=operation.reason)
        return Outcome(PHASE, ctx.status, (order,), f"preflight: pg_upgrade --check on {primary.name}")
    if not ended.ok:
        return _refuse(ctx, operation, f"pg_upgrade --check on {primary.name}: {ended.error}")
    kept = _kept_candidate(ctx)
    if kept is None:
        if ctx.now - (operation.step_started_at or operation.started_at) > STOP_TIMEOUT:
            return _refuse(
                ctx,
                operation,
                "no replica caught up with the primary within 60 s, to keep as the way back (one trails it: retry once writes calm down)",
            )
        return Outcome(
            PHASE, ctx.status, message="preflight passed: waiting for a replica to keep as the way back"
        )
    operation = replace(operation, kept=kept.name).at("stop", ctx.now)
    return _stop(replace(ctx, status=replace(ctx.status, operation=operation)), operation)


def _kept_candidate(ctx: Context) -> MemberView | None:
    """The replica to keep on the old major: a healthy voter caught up with the primary, with the most
    data, the lowest ordinal first among equals (scale-downs remove the highest)."""
    # Caught up (within a WAL segment) before writes stop: the stop then waits for that much, not for
    # the gigabytes an async replica may trail by after a bulk load.
    candidates = [
        m
        for m in ctx.healthy_replicas()
        if ctx.wanted(m.name) and m.name in ctx.status.voters and ctx.caught_up(m)
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda m: (by_most_data(m)[:2], m.ordinal))


def _stop(ctx: Context, operation: Operation) -> Outcome:
    primary = ctx.view.member(operation.source)
    kept = ctx.view.member(operation.kept)
    age = ctx.now - (operation.step_started_at or operation.started_at)
    assert primary is not None and kept is not None
    if operation.writes_stopped_at is None:
        operation = replace(operation, writes_stopped_at=ctx.now)
        ctx = replace(ctx, status=replace(ctx.status, operation=operation))
    if not (primary.fenced and primary.stopped):
        if age > STOP_TIMEOUT:
            return _resume_old(ctx, operation, f"{primary.name} did not stop within {STOP_TIMEOUT.seconds}s")
        return Outcome(
            PHASE, ctx.status, (Fence(primary.name, reason="writes stop for the upgrade"),), "stopping writes"
        )
    if operation.final_lsn is None:
        if primary.shutdown_clean is not True or primary.received_lsn is None:
            return _resume_old(ctx, operation, f"{primary.name} did not shut down cleanly")
        operation = replace(operation, final_lsn=primary.received_lsn)
        ctx = replace(ctx, status=replace(ctx.status, operation=operation))
    final = operation.final_lsn
    assert final is not None
    if not kept.fenced:
        have = kept.most_wal if kept.reachable else None
        if have is None or have < final:
            if age > STOP_TIMEOUT:
                return _resume_old(ctx, operation, f"{kept.name} did not receive every write in time")
            return Outcome(
                PHASE, ctx.status, message=f"writes stopped: waiting for {kept.name} to hold them all"
            )
        return Outcome(
            PHASE,
            ctx.status,
            (Fence(kept.name, reason=f"kept on PostgreSQL {operation.from_major} as the way back"),),
            f"keeping {kept.name} on PostgreSQL {operation.from_major}",
        )
    if not kept.stopped:
        return Outcome(PHASE, ctx.status, message=f"waiting for {kept.name} to stop")
    operation = operation.at("upgrade", ctx.now)
    return _upgrade(replace(ctx, status=replace(ctx.status, operation=operation)), operation)


def _resume_old(ctx: Context, operation: Operation, why: str) -> Outcome:
    """Writes stopped but nothing was upgraded: the old primary starts read-write again (Unfence, the
    engine's explicit order: it is still the recorded primary, nothing was promoted)."""
    refused = _refuse(ctx, operation, why)
    actions = (
        Unfence(str(operation.source), reason=f"upgrade abandoned: {why}"),
        SetPrimary(str(operation.source), reason="upgrade abandoned"),
        *refused.actions,
    )
    return replace(refused, actions=actions)


def _upgrade(ctx: Context, operation: Operation) -> Outcome:
    """Order the upgrade until its agent says how it ended. Failed (the new major never served a
    client: its checks run on its Unix socket alone): roll back. Passed: the new major may hold
    acknowledged writes from then on, so there is no automatic way back: a member that restarted
    read-only since is promoted again in place (the kept replica is stopped: nothing else can write)."""
    primary = ctx.view.member(operation.source)
    wanted_id = request_id(operation, "upgrade")
    ended = primary.last_action if primary is not None else None
    if ended is not None and ended.request_id == wanted_id and ended.ok:
        assert primary is not None
        if primary.is_primary and primary.data_major == operation.to_major:
            return _resume_writes(ctx, operation, primary)
        if primary.reachable and primary.role is Role.REPLICA and primary.data_major == operation.to_major:
            again = Promote(primary.name, reason=f"the upgraded primary {primary.name} restarted read-only")
            return Outcome(
                PHASE,
                ctx.status,
                (again,),
                f"promoting {primary.name} again on PostgreSQL {operation.to_major}",
            )
        return Outcome(
            PHASE, ctx.status, message=f"waiting for {primary.name} to run PostgreSQL {operation.to_major}"
        )
    if ended is not None and ended.request_id == wanted_id:
        return _start_rollback(ctx, operation, f"the upgrade of {operation.source} failed: {ended.error}")
    if primary is None or primary.absent or not primary.data_present:
        return _start_rollback(ctx, operation, f"{operation.source} went away during the upgrade")
    order = UpgradeMember(primary.name, int(operation.to_major or 0), wanted_id, reason=operation.reason)
    return Outcome(PHASE, ctx.status, (order,), f"pg_upgrade --link on {primary.name}")


def _alone(status: EngineStatus, primary: MemberView, major: int | None, **fields: Any) -> EngineStatus:
    """``primary`` recorded as the only voter, on ``major``, with no synchronous standby yet (another
    major's members cannot follow it): membership upkeep adds the others as they stream from it."""
    return replace(
        status,
        current_primary=primary.name,
        timeline=primary.timeline,
        major=major,
        voters=frozenset({primary.name}),
        sync=None,
        sync_pending=ASYNC,
        sync_since_lsn=None,
        primary_lost_since=None,
        votes_since={},
        **fields,
    )


def _resume_writes(ctx: Context, operation: Operation, primary: MemberView) -> Outcome:
    stopped_at = operation.writes_stopped_at or operation.step_started_at or operation.started_at
    kept = OldMajorKept(
        str(operation.kept), int(operation.from_major or 0), int(operation.to_major or 0), ctx.now
    )
    operation = replace(
        operation, plan=tuple(n for n in ctx.expected_names() if n not in (primary.name, kept.member))
    )
    operation = operation.at("rebuild", ctx.now)
    status = _alone(ctx.status, primary, operation.to_major, operation=operation, kept=kept)
    message = (
        f"PostgreSQL {operation.from_major} -> {operation.to_major} on {primary.name}: writes stopped for"
        f" {(ctx.now - stopped_at).total_seconds():.1f}s; {kept.member} kept on"
        f" PostgreSQL {kept.major} until confirmed"
    )
    actions: tuple[Action, ...] = (
        SetPrimary(primary.name, reason=operation.reason),
        SetSynchronousStandbys(primary.name, ASYNC, reason="the quorum is rebuilt on the new major"),
        RecordEvent("MajorUpgraded", message),
    )
    return Outcome(PHASE, status, actions, message)


def _rebuild(ctx: Context, operation: Operation) -> Outcome:
    from pgherd.engine import membership

    primary = ctx.healthy_primary()
    if primary is None or primary.name != operation.target:
        # The new primary failed: the ordinary failure handling takes over (the kept replica stays).
        status = replace(ctx.status, operation=None)
        return Outcome(PHASE, status, message=f"the upgraded primary {operation.target} is not available")
    to_major = operation.to_major
    upkeep = membership.upkeep(ctx)
    behind = [
        n
        for n in operation.plan
        if ctx.wanted(n)
        and not (
            (m := ctx.view.member(n)) is not None
            and (m.absent or (m.streams_from(primary.name) and m.data_major == to_major))
        )
    ]
    analyzing = " (statistics being rebuilt)" if primary.analyzing else ""
    if behind:
        message = f"rebuilding {', '.join(behind)} on PostgreSQL {to_major} from {primary.name}{analyzing}"
        return replace(upkeep.outcome, phase=PHASE, message=message)
    status = replace(upkeep.outcome.status, operation=None)
    return replace(upkeep.outcome, status=status, message=f"upgraded to PostgreSQL {to_major}{analyzing}")


# -- the way back -----------------------------------------------------------------------------------------


def _rollback_requested(ctx: Context, operation: Operation) -> bool:
    return ctx.view.rollback_upgrade is not None and ctx.view.rollback_upgrade.strip() == str(
        operation.to_major
    )


def _start_rollback(ctx: Context, operation: Operation, why: str) -> Outcome:
    operation = replace(operation, rollback=why).at("rollback", ctx.now)
    return _rollback(replace(ctx, status=replace(ctx.status, operation=operation)), operation)


def _rollback(ctx: Context, operation: Operation) -> Outcome:
    kept = ctx.view.member(operation.kept)
    upgraded = ctx.view.member(operation.target)
    why = str(operation.rollback)
    if kept is not None and kept.is_primary:
        return _rolled_back(ctx, operation, kept)
    actions: list[Action] = []
    # Nothing but the kept replica may write from here on: the upgraded member first.
    if upgraded is not None and upgraded.exists and not upgraded.absent and not upgraded.fenced:
        actions.append(Fence(upgraded.name, reason=f"rollback: {why}"))
    if not cannot_write(upgraded) or (upgraded is not None and upgraded.reachable and not upgraded.fenced):
        return Outcome(PHASE, ctx.status, tuple(actions), f"rolling back ({why}): fencing {operation.target}")
    if kept is None or kept.absent or not kept.data_present or not (kept.reachable or kept.stopped):
        # Its agent must answer (it starts the stopped member, then promotes it).
        return Outcome(
            PHASE, ctx.status, tuple(actions), f"rolling back ({why}): waiting for {operation.kept}"
        )
    actions.append(
        Promote(kept.name, reason=f"rollback of the upgrade to PostgreSQL {operation.to_major}: {why}")
    )
    return Outcome(PHASE, ctx.status, tuple(actions), f"rolling back ({why}): promoting {kept.name}")


def _rolled_back(ctx: Context, operation: Operation, kept: MemberView) -> Outcome:
    why = str(operation.rollback)
    aborted = replace(operation, failed=f"rolled back: {why}")
    status = _alone(ctx.status, kept, operation.from_major, operation=None, aborted=aborted, kept=None)
    message = (
        f"the upgrade to PostgreSQL {operation.to_major} was rolled back ({why}): {kept.name} is the primary"
        f" on PostgreSQL {operation.from_major}, with every write acknowledged before the upgrade"
    )
    if ctx.status.kept is not None:
        message += (
            f"; writes made on PostgreSQL {operation.to_major} since {ctx.status.kept.since.isoformat()} are"
            f" not in it: {operation.target}'s PostgreSQL {operation.to_major} data directory is kept aside on"
            " its volume when it is re-cloned"
        )
    actions: tuple[Action, ...] = (
        SetPrimary(kept.name, reason="rollback"),
        SetSynchronousStandbys(kept.name, ASYNC, reason="the quorum is rebuilt on the old major"),
        RecordEvent("UpgradeRolledBack", message, warning=True),
    )
    # The other members rejoin it from the next pass on (membership upkeep): Degraded until then.
    return Outcome(Phase.DEGRADED, status, actions, message)


def rollback_kept(ctx: Context) -> Outcome | None:
    """A person asks for the way back after the upgrade's operation ended (the old major still kept)."""
    kept = ctx.status.kept
    if (
        kept is None
        or ctx.view.rollback_upgrade is None
        or ctx.view.rollback_upgrade.strip() != str(kept.to_major)
    ):
        return None
    primary = ctx.status.current_primary
    operation = Operation(
        OperationKind.MAJOR_UPGRADE,
        started_at=ctx.now,
        source=primary,
        target=primary,
        from_major=kept.major,
        to_major=kept.to_major,
        kept=kept.member,
        retry=ctx.view.retry_upgrade,
        rollback="asked for (pgherd.io/rollback-upgrade)",
        reason=f"rollback of PostgreSQL {kept.major} -> {kept.to_major}",
    ).at("rollback", ctx.now)
    return _rollback(replace(ctx, status=replace(ctx.status, operation=operation)), operation)


def confirm(ctx: Context) -> Context:
    """The kept replica is released once the upgrade is confirmed (annotation, or keepOldMajorFor), or
    once the spec no longer wants its member (a scale-down)."""
    value = (ctx.view.confirm_upgrade or "").strip() or None
    status = ctx.status
    if status.confirmed is not None and value != status.confirmed:
        status = replace(status, confirmed=None)  # changed or removed: it may confirm again
    kept = status.kept
    if kept is not None:
        asked = value == str(kept.to_major) and value != status.confirmed
        expired = ctx.now - kept.since >= parse_duration(ctx.spec.upgrade.keep_old_major_for)
        if asked or expired or not ctx.wanted(kept.member):
            used = value if value == str(kept.to_major) else status.confirmed
            status = replace(status, kept=None, confirmed=used)
    return ctx if status is ctx.status else replace(ctx, status=status)


def restored(ctx: Context, status: EngineStatus, what: str) -> EngineStatus:
    """``what`` (a restore) brought back a snapshot of ``status.major``: when older than the spec's, it is
    recorded like a rolled back upgrade (the cluster stays on it until pgherd.io/retry-upgrade gets a
    new value), never upgraded again on its own: whoever restored data of the old major may want to
    stay on it."""
    major = status.major
    if major is None or major >= ctx.spec.postgres_version:
        return status
    record = Operation(
        OperationKind.MAJOR_UPGRADE,
        started_at=ctx.now,
        step=RESTORED,
        from_major=major,
        to_major=ctx.spec.postgres_version,
        retry=ctx.view.retry_upgrade,
        reason=what,
        failed=f"{what} brought back a snapshot of PostgreSQL {major}",
    )
    return replace(status, aborted=record)


def _refuse(ctx: Context, operation: Operation, why: str) -> Outcome:
    """The upgrade does not happen (before writes stopped): the cluster goes on as it was."""
    status = replace(ctx.status, operation=None, aborted=replace(operation, failed=why))
    message = f"upgrade to PostgreSQL {operation.to_major} refused: {why}"
    return Outcome(Phase.RUNNING, status, (RecordEvent("UpgradeRefused", message, warning=True),), message)


# -- what the status says ------------------------------------------------------------------------------


def condition(ctx: Context) -> Condition | None:
    major, wanted_major = ctx.status.major, ctx.spec.postgres_version
    if major is None:
        return None
    operation, aborted, kept = ctx.status.operation, ctx.status.aborted, ctx.status.kept
    kind = ConditionType.POSTGRES_VERSION_REACHED
    if operation is not None and operation.kind is OperationKind.MAJOR_UPGRADE:
        return false(kind, "Upgrading", f"PostgreSQL {major} -> {operation.to_major}: {operation.step}")
    if major < wanted_major:
        if (
            aborted is not None
            and aborted.kind is OperationKind.MAJOR_UPGRADE
            and aborted.to_major == wanted_major
        ):
            reason = {"rollback": "RolledBack", RESTORED: "Restored"}.get(aborted.step, "UpgradeRefused")
            return false(
                kind,
                reason,
                f"running PostgreSQL {major}, not {wanted_major}: {aborted.failed}; set a new value of the"
                " annotation pgherd.io/retry-upgrade to try again",
            )
        return false(kind, "Pending", f"running PostgreSQL {major}; the upgrade to {wanted_major} waits")
    primary = ctx.healthy_primary()
    analyzing = "; statistics being rebuilt" if primary is not None and primary.analyzing else ""
    if kept is not None:
        until = kept.since + parse_duration(ctx.spec.upgrade.keep_old_major_for)
        return true(
            kind,
            "OldMajorKept",
            f"PostgreSQL {major}; {kept.member} is kept on PostgreSQL {kept.major} as the way back until"
            f' {until.isoformat()} (pgherd.io/confirm-upgrade: "{kept.to_major}" confirms now,'
            f' pgherd.io/rollback-upgrade: "{kept.to_major}" goes back){analyzing}',
        )
    return true(kind, "Reached", f"PostgreSQL {major}{analyzing}")
