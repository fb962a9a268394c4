"""Membership upkeep under a healthy primary: create, re-point, admit to the quorum, remove.

Level-triggered: everything here is derived from the spec, the view and the quorum memory (voters and
sync configuration), so it needs no operation record to resume. Scaling up creates the missing
ordinals from the primary; a new member joins the voters (through the quorum resolver) once it
streams and holds every commit acknowledged under earlier configurations. Scaling down removes the
highest ordinals: first from the voters (only once enough of the remaining voters hold every commit
acknowledged under earlier configurations, see ``_leaving_keeps_commits``), then from the sync
standbys, then the member is deleted and its replication slot dropped; its volume is kept when it holds
data kept aside. The primary is never removed here (decide() switches over first).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pgherd.api.cluster import Phase
from pgherd.engine.actions import (
    Action,
    CreateMember,
    DeleteMember,
    DropReplicationSlot,
    Rejoin,
    Seed,
    SetPrimary,
    SetSynchronousStandbys,
)
from pgherd.engine.context import Context, Outcome, data_lost
from pgherd.engine.quorum import SyncStep, VotersStep, check, majority, next_step, steady_config
from pgherd.engine.status import EngineStatus
from pgherd.engine.view import MemberView, Role


@dataclass(frozen=True)
class Upkeep:
    outcome: Outcome
    settled: bool  # nothing in flight: all wanted members streaming voters, sync config steady


def needs_rejoin(ctx: Context, member: MemberView, primary: str) -> bool:
    if member.name == primary or not member.exists or member.absent:
        return False
    if member.fenced or data_lost(member):
        return True  # an empty volume whose agent answers is seeded by the rejoin
    if not member.reachable:
        return False
    if member.role is Role.PRIMARY:
        return True  # a stray primary: it must follow (see _rejoin_action: rewound or re-cloned)
    if member.role is Role.REPLICA and member.upstream != primary:
        return True
    return not member.wal_receiver_streaming and not ctx.on_current_timeline(member)


def _quorum(ctx: Context, primary: MemberView) -> tuple[EngineStatus, list[Action]]:
    """Confirm the sync configuration observed on the primary, then take the next safe step."""
    status = ctx.status
    observed = primary.sync
    pending = status.sync_pending
    if pending is not None:
        if observed == pending:
            status = replace(status, sync=observed, sync_pending=None, sync_since_lsn=primary.received_lsn)
        else:
            return status, [
                SetSynchronousStandbys(primary.name, pending, reason="quorum change not yet observed")
            ]
    elif observed is not None and observed != status.sync:
        status = replace(status, sync=observed, sync_since_lsn=primary.received_lsn)
    if status.sync is None:
        return status, []
    wanted = {v for v in status.voters if ctx.wanted(v)} | {primary.name}
    for member in ctx.view.existing():
        if (
            ctx.wanted(member.name)
            and member.streams_from(primary.name)
            and not member.fenced
            and ctx.on_current_timeline(member)
        ):
            wanted.add(member.name)
    for _ in range(64):
        step = next_step(status.voters, primary.name, status.sync, frozenset(wanted), ctx.quorum_mode)
        if step is None:
            return status, []
        if isinstance(step, VotersStep):
            joining = [ctx.view.member(name) for name in sorted(step.voters - status.voters)]
            if ctx.quorum_mode and not all(_holds_older_commits(status, m) for m in joining):
                # Commits acknowledged under the narrower configuration are below sync_since_lsn: a
                # member counts for majorities only once it has them (else a majority of voters could
                # miss one). Wait for it to catch up.
                return status, []
            if (
                ctx.quorum_mode
                and step.voters < status.voters
                and not _leaving_keeps_commits(ctx, status, step.voters, primary)
            ):
                return status, []
            if ctx.quorum_mode:
                check(step.voters, primary.name, status.possible_sync_configs())
            status = replace(status, voters=step.voters)
            continue
        assert isinstance(step, SyncStep)
        if ctx.quorum_mode:
            check(status.voters, primary.name, [step.config])
        status = replace(status, sync_pending=step.config)
        return status, [SetSynchronousStandbys(primary.name, step.config, reason="quorum membership change")]
    raise AssertionError("the quorum resolver did not converge")


def ready_to_promote(ctx: Context, status: EngineStatus, primary: str) -> list[Action]:
    """Each voting replica carries the synchronous standbys it would need as the primary (a standby
    ignores them), so that a failover's promotion is one agent call: setting them there, inside the
    write outage, took 0.1-0.3 s of it on localkube. promote_step still sets them when they differ."""
    if not ctx.quorum_mode:
        return []
    return [
        SetSynchronousStandbys(m.name, config, reason=f"ready to take over from {primary}")
        for m in ctx.healthy_replicas()
        if m.name in status.voters
        and m.name != ctx.kept_member
        and m.sync != (config := steady_config(status.voters, m.name, quorum=True))
    ]


def _holds_older_commits(status: EngineStatus, member: MemberView | None) -> bool:
    if member is None or member.received_lsn is None:
        return False
    return status.sync_since_lsn is None or member.received_lsn >= status.sync_since_lsn


def _leaving_keeps_commits(
    ctx: Context, status: EngineStatus, remaining: frozenset[str], primary: MemberView
) -> bool:
    """May the voters shrink to ``remaining``? Commits acknowledged before the configuration in force
    (below sync_since_lsn, or anything the primary wrote when that is unknown) may live on the leaving
    member and on no remaining replica. Every majority of the remaining voters a failover could use
    must include a replica holding them: at least ``replicas - majority + 1`` holders."""
    bound = status.sync_since_lsn if status.sync_since_lsn is not None else primary.received_lsn
    if bound is None:
        return False
    replicas = [ctx.view.member(name) for name in sorted(remaining - {primary.name})]
    holders = sum(
        1
        for m in replicas
        if m is not None
        and m.received_lsn is not None
        and m.received_lsn >= bound
        and ctx.on_current_timeline(m)
    )
    return holders >= len(replicas) - majority(len(remaining)) + 1


def _rejoin_action(ctx: Context, member: MemberView, primary: str, reclone: bool) -> Rejoin:
    """Rejoin ``member`` to ``primary``. A stray primary on a history as new as the recorded one (or
    newer) is re-cloned, never rewound: pg_rewind would throw away writes made on a timeline the engine
    did not create, and a re-clone keeps the replaced data aside."""
    stray = (
        member.reachable
        and member.role is Role.PRIMARY
        and (ctx.status.timeline is None or member.timeline is None or member.timeline >= ctx.status.timeline)
    )
    # Another major's data (an upgrade's, or a rollback's): pg_rewind cannot cross majors.
    other_major = (
        member.data_major is not None
        and ctx.status.major is not None
        and member.data_major != ctx.status.major
    )
    return Rejoin(member.name, primary, reclone=reclone or stray or other_major, reason="follow")


def routing_pending(ctx: Context, primary: str) -> list[str]:
    """What the platform's routing still lacks while the engine's own work is done: the rw endpoint
    routing to the primary alone, and every ready member ready for the platform too (its Services)."""
    notes = []
    routes = ctx.view.rw_routes
    if ctx.view.rw_member == primary and routes is not None and routes != {primary}:
        others = sorted(routes - {primary})
        if primary not in routes:
            notes.append(f"the rw endpoint does not route to {primary} yet")
        if others:
            notes.append(f"the rw endpoint still routes to {', '.join(others)}")
    waiting = [m.name for m in ctx.view.existing() if m.ready and m.platform_ready is False]
    if waiting:
        notes.append(f"{', '.join(waiting)} not yet ready for its Services (readiness probe)")
    return notes


def maintain(ctx: Context, reclone: frozenset[str] = frozenset()) -> Outcome:
    return upkeep(ctx, reclone).outcome


def upkeep(ctx: Context, reclone: frozenset[str] = frozenset()) -> Upkeep:
    primary = ctx.healthy_primary()
    assert primary is not None, "membership upkeep needs a healthy primary"
    reclone = reclone | ctx.status.rebuild_pending
    if primary.timeline is not None and primary.timeline != ctx.status.timeline:
        # Observed truth (e.g. a promotion that was confirmed only after the operation ended).
        ctx = replace(ctx, status=replace(ctx.status, timeline=primary.timeline))
    actions: list[Action] = []
    notes: list[str] = []
    if ctx.view.rw_member != primary.name:
        actions.append(SetPrimary(primary.name, reason=f"the rw endpoint selects {ctx.view.rw_member}"))
        notes.append(f"pointing the rw endpoint at {primary.name}")
    unrouted = routing_pending(ctx, primary.name)
    notes += unrouted
    for name in ctx.expected_names():
        member = ctx.view.member(name)
        if member is None or not member.exists:
            ordinal = int(name.rsplit("-", 1)[1])
            actions.append(
                CreateMember(
                    name, ordinal, Seed.BASEBACKUP, ctx.revision, primary.name, primary.name, reason="scale"
                )
            )
            notes.append(f"creating {name}")
    kept = ctx.kept_member
    for member in ctx.view.existing():
        if member.name == primary.name:
            continue  # the primary never rejoins itself
        if member.name == kept:
            notes.append(f"{member.name} kept on the old major until the upgrade is confirmed")
            continue  # the way back after a major upgrade: fenced and untouched until confirmed
        # A member being removed is not rebuilt: a re-clone would keep its data aside on the very
        # volume the scale-down deletes.
        rebuild = member.name in reclone and ctx.wanted(member.name) and not member.absent
        if (rebuild and not member.streams_from(primary.name)) or needs_rejoin(ctx, member, primary.name):
            actions.append(_rejoin_action(ctx, member, primary.name, rebuild))
            notes.append(f"rejoining {member.name}")
        elif member.absent:
            notes.append(f"{member.name} not running")
        elif not member.reachable and member.name != primary.name:
            notes.append(f"{member.name} unreachable")
    status, quorum_actions = _quorum(ctx, primary)
    if status.rebuild_pending:
        rebuilt = {
            name
            for name in status.rebuild_pending
            if not ctx.wanted(name)
            or ((m := ctx.view.member(name)) is not None and m.streams_from(primary.name) and not m.fenced)
        }
        status = replace(status, rebuild_pending=status.rebuild_pending - rebuilt)
    actions += quorum_actions
    if quorum_actions:
        notes.append("changing synchronous standbys")
    for member in ctx.view.existing():
        if ctx.wanted(member.name) or member.name == primary.name:
            continue
        listed = any(member.name in c.standbys for c in status.possible_sync_configs())
        rejoining = any(isinstance(a, Rejoin) and a.member == member.name for a in actions)
        if member.name in status.voters or listed or rejoining:
            notes.append(f"removing {member.name} from the quorum")
            continue
        # Data kept aside (by a re-clone or a restore) lives on the member's volume: never deleted.
        actions.append(DeleteMember(member.name, keep_data=member.kept_aside > 0, reason="scale down"))
        actions.append(DropReplicationSlot(primary.name, member.name, reason="scale down"))
        notes.append(f"deleting {member.name}")
    expected = set(ctx.expected_names()) - {kept}
    healthy = {m.name for m in ctx.healthy_replicas()} | {primary.name}
    settled = (
        not actions
        and not unrouted
        and status.sync_pending is None
        and expected <= healthy
        and expected == set(status.voters)
    )
    # Upkeep, not a change in flight (the cluster stays settled); last, so that a refusal of one of them
    # never holds back the actions before them in the same pass.
    if not quorum_actions and status.sync_pending is None:
        actions += ready_to_promote(ctx, status, primary.name)
    status = replace(status, primary_lost_since=None, votes_since={}, quorum_lost_since=None)
    if settled and not status.complete:
        status = replace(status, complete=True)
    # Members with nothing running (pods not scheduled, nodes gone) make the cluster Degraded, not Scaling.
    absent = any((m := ctx.view.member(n)) is not None and m.absent for n in expected)
    scaling = any(isinstance(a, DeleteMember) for a in actions) or (
        set(status.voters) != expected and not absent
    )
    reachable, needed = len(ctx.reachable_voters()), ctx.needed()
    if reachable < needed:
        # The primary is up but cannot gather a quorum (writes wait in quorum mode): never promote.
        phase = Phase.QUORUM_LOST
        notes.insert(0, f"{reachable} of {len(status.voters)} members reachable, {needed} needed")
    elif not status.complete:
        phase = Phase.CREATING
    elif scaling:
        phase = Phase.SCALING
    elif not settled:
        phase = Phase.DEGRADED
    else:
        phase = Phase.RUNNING
    message = "; ".join(notes) or ("waiting for members to stream and become ready" if not settled else "")
    return Upkeep(Outcome(phase, status, tuple(actions), message), settled)
