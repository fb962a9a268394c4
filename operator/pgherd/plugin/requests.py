"""A person's requests on a PostgresCluster, as the merge patch that asks for them, or the refusal
(in words) of one the engine would not carry out now: a switchover, a rolling restart, pause and
resume, a major upgrade's confirmation or rollback. Pure: the cluster object in, a Request out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pgherd.api.annotations import CONFIRM_UPGRADE, RESTART, ROLLBACK_UPGRADE
from pgherd.api.cluster import Phase
from pgherd.engine.status import OperationKind
from pgherd.kube import names
from pgherd.plugin.errors import PluginError
from pgherd.plugin.explain import at, engine_status

JSON = dict[str, Any]


@dataclass(frozen=True)
class Request:
    patch: JSON
    said: str  # what was asked, in words


def _annotate(key: str, value: str | None) -> JSON:
    return {"metadata": {"annotations": {key: value}}}


def _parts(cluster: Mapping[str, Any]) -> tuple[str, Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]]:
    meta = cluster.get("metadata") or {}
    return (
        str(meta.get("name")),
        meta.get("annotations") or {},
        cluster.get("spec") or {},
        cluster.get("status") or {},
    )


def _not_paused(name: str, spec: Mapping[str, Any], what: str) -> None:
    if spec.get("paused"):
        raise PluginError(
            f"{name} is paused (spec.paused): the operator acts on nothing, {what} included; resume it first"
        )


def members_of(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [m for m in status.get("members") or [] if isinstance(m, Mapping)]


def switchover(cluster: Mapping[str, Any], to: str | None) -> Request:
    """pgherd.io/switchover-to: a member, or ``any`` (the streaming replica with the most WAL). Refused
    when the engine would not act on it: it switches over a settled (Running) cluster only, to a ready
    replica, and once at a time."""
    name, annotations, spec, status = _parts(cluster)
    _not_paused(name, spec, "a switchover")
    asked = annotations.get(names.ANNOTATION_SWITCHOVER)
    if asked:
        raise PluginError(
            f"a switchover of {name} to {asked} is already asked for ({names.ANNOTATION_SWITCHOVER}); the operator"
            " removes the annotation once it is done or refused"
        )
    primary = status.get("currentPrimary")
    phase = status.get("phase") or Phase.PENDING
    if not primary:
        raise PluginError(f"{name} has no primary yet (phase {phase}): nothing to switch over from")
    if phase != Phase.RUNNING:
        why = f": {status['message']}" if status.get("message") else ""
        raise PluginError(
            f"{name} is {phase}, not Running{why}; the engine switches over a settled cluster only: ask again once"
            " it is Running"
        )
    replicas = [m for m in members_of(status) if m.get("role") == "replica"]
    if to is None:
        if not any(m.get("ready") for m in replicas):
            raise PluginError(f"{name} has no ready replica to switch over to")
        return Request(
            _annotate(names.ANNOTATION_SWITCHOVER, "any"),
            f"switchover of {name} from {primary} to the streaming replica holding the most WAL",
        )
    if to == primary:
        raise PluginError(f"{to} is already the primary of {name}")
    member = next((m for m in members_of(status) if m.get("name") == to), None)
    if member is None:
        known = ", ".join(str(m.get("name")) for m in members_of(status)) or "none"
        raise PluginError(f"{name} has no member {to} (members: {known})")
    if member.get("role") != "replica" or not member.get("ready"):
        raise PluginError(
            f"{to} is not a ready replica (role {member.get('role')}, ready {str(bool(member.get('ready'))).lower()}):"
            " the engine promotes only a ready replica streaming from the primary"
        )
    return Request(_annotate(names.ANNOTATION_SWITCHOVER, to), f"switchover of {name} from {primary} to {to}")


def rolling_restart(cluster: Mapping[str, Any], now: datetime) -> Request:
    """pgherd.io/restart: a new value is a new spec revision, which the engine rolls out in its safe order
    (replicas most lagging first, one at a time, each Ready and caught up before the next; then a
    switchover and the old primary last, or per upgrade.primaryUpdateMethod)."""
    name, _, spec, status = _parts(cluster)
    _not_paused(name, spec, "a restart")
    engine = engine_status(status)
    operation = engine.operation if engine is not None else None
    if operation is not None and operation.kind is not OperationKind.ROLLOUT:
        raise PluginError(
            f"{name} is in the middle of a {operation.kind} (step {operation.step}): ask for the restart once it is"
            " over"
        )
    if not status.get("currentPrimary"):
        raise PluginError(
            f"{name} has no primary yet (phase {status.get('phase') or Phase.PENDING}): nothing to restart"
        )
    stamp = at(now)
    return Request(
        _annotate(RESTART, stamp),
        f"rolling restart of {name} ({RESTART}={stamp}): replicas first, one at a time, the primary last",
    )


def member_restart(cluster: Mapping[str, Any], member: str) -> str:
    """The pod to delete for restarting one member, after the same checks. The StatefulSet makes it
    again; a primary's agent, told to stop, waits for the engine to switch over first."""
    name, _, spec, status = _parts(cluster)
    _not_paused(name, spec, "a restart")
    names_ = [str(m.get("name")) for m in members_of(status)]
    if member not in names_:
        raise PluginError(f"{name} has no member {member} (members: {', '.join(names_) or 'none'})")
    engine = engine_status(status)
    operation = engine.operation if engine is not None else None
    if operation is not None:
        raise PluginError(
            f"{name} is in the middle of a {operation.kind} (step {operation.step}): restart {member} once it is over"
        )
    return member


def pause(cluster: Mapping[str, Any], paused: bool) -> Request | None:
    """spec.paused; None when it already is as asked."""
    name, _, spec, _ = _parts(cluster)
    if bool(spec.get("paused")) == paused:
        return None
    said = (
        f"{name} paused: the operator observes and reports only (no failover either) until resumed"
        if paused
        else f"{name} resumed: the operator acts again"
    )
    return Request({"spec": {"paused": paused}}, said)


def _upgrade_target(name: str, status: Mapping[str, Any], what: str) -> tuple[str, str]:
    """(major, why it waits) of the upgrade a confirmation or rollback would act on."""
    engine = engine_status(status)
    running = status.get("postgresVersion")
    operation = engine.operation if engine is not None else None
    if operation is not None and operation.kind is OperationKind.MAJOR_UPGRADE and operation.to_major:
        return str(
            operation.to_major
        ), f"the upgrade to PostgreSQL {operation.to_major} is at step {operation.step}"
    if engine is not None and engine.kept is not None:
        kept = engine.kept
        return str(kept.to_major), f"{kept.member} is kept on PostgreSQL {kept.major} as the way back"
    raise PluginError(
        f"no upgrade of {name} waits for a {what}: it runs PostgreSQL {running or 'unknown'} and keeps no replica"
        " on an older major (status.engine.kept is empty, no MajorUpgrade in progress)"
    )


def upgrade_confirm(cluster: Mapping[str, Any]) -> Request:
    """pgherd.io/confirm-upgrade: "<major>": the replica kept on the old major is rebuilt on the new one
    (no way back after that)."""
    name, annotations, _, status = _parts(cluster)
    major, state = _upgrade_target(name, status, "confirmation")
    engine = engine_status(status)
    if annotations.get(CONFIRM_UPGRADE) == major and (engine is None or engine.confirmed != major):
        raise PluginError(
            f"the upgrade of {name} to PostgreSQL {major} is already being confirmed ({CONFIRM_UPGRADE}={major})"
        )
    return Request(
        _annotate(CONFIRM_UPGRADE, major),
        f"upgrade of {name} to PostgreSQL {major} confirmed ({state}): the old major's replica is rebuilt on"
        f" {major}; there is no way back after that",
    )


def upgrade_rollback(cluster: Mapping[str, Any]) -> Request:
    """pgherd.io/rollback-upgrade: "<major>": the replica kept on the old major is promoted; writes made
    on the new major since the upgrade are not in it (kept aside on the upgraded member's volume)."""
    name, annotations, _, status = _parts(cluster)
    major, state = _upgrade_target(name, status, "rollback")
    if annotations.get(ROLLBACK_UPGRADE) == major:
        raise PluginError(
            f"a rollback of {name}'s upgrade to PostgreSQL {major} is already asked for ({ROLLBACK_UPGRADE}={major})"
        )
    return Request(
        _annotate(ROLLBACK_UPGRADE, major),
        f"rollback of {name}'s upgrade to PostgreSQL {major} asked ({state}): the replica on the old major is"
        " promoted; writes made on the new major since are not in it (kept aside, never deleted)",
    )
