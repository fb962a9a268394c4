"""The PostgresCluster's ``status`` from a Decision: what `kubectl get pgc` and users read, and the
engine's memory (``status.engine``) that a restarted or newly elected operator resumes from.

Written through the status subresource *before* any action of the decision is applied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pgherd.engine.conditions import Condition
from pgherd.engine.lsn import format_lsn
from pgherd.engine.plan import Decision
from pgherd.engine.view import ClusterView, MemberView, Role
from pgherd.kube import names
from pgherd_backup.agent.wire import Status
from pgherd_backup.timestamps import now_rfc3339

JSON = dict[str, Any]


def _now() -> str:
    return now_rfc3339()


def conditions(
    current: Sequence[Condition], previous: Sequence[Mapping[str, Any]], generation: int | None
) -> list[JSON]:
    """metav1.Condition documents; lastTransitionTime moves only when the status changes."""
    before = {c.get("type"): c for c in previous}
    out = []
    for condition in current:
        old = before.get(condition.type.value) or {}
        text = condition.status_text
        since = old.get("lastTransitionTime") if old.get("status") == text else None
        out.append(
            {
                "type": condition.type.value,
                "status": text,
                "reason": condition.reason or "Unknown",
                "message": condition.message,
                "lastTransitionTime": since or _now(),
                "observedGeneration": generation,
            }
        )
    return out


def member_role(view: MemberView) -> str:
    if view.fenced:
        return "fenced"
    if not view.reachable:
        return "unknown"
    return "primary" if view.role is Role.PRIMARY else "replica"


def members(
    view: ClusterView, primary: str | None, statuses: Mapping[str, Status | None] | None = None
) -> list[JSON]:
    """status.members; ``statuses``: the agents' /status by member, for what the engine's view does not
    carry (the server version)."""
    primary_view = view.member(primary)
    primary_lsn = primary_view.received_lsn if primary_view is not None and primary_view.reachable else None
    out = []
    for member in view.existing():
        lag = None
        if primary_lsn is not None and member.reachable and member.replayed_lsn is not None:
            lag = max(0, primary_lsn - member.replayed_lsn)
        agent = (statuses or {}).get(member.name)
        out.append(
            {
                "name": member.name,
                "role": member_role(member),
                # Ready for clients: the agent's word and, where there is one, the platform's (kubelet).
                "ready": member.ready and member.platform_ready is not False,
                "reachable": member.reachable,
                "timeline": member.timeline,
                "version": agent.server_version if agent is not None else None,
                "receivedLSN": None if member.received_lsn is None else format_lsn(member.received_lsn),
                "replayedLSN": None if member.replayed_lsn is None else format_lsn(member.replayed_lsn),
                "lagBytes": lag,
            }
        )
    return out


def cluster_status(
    decision: Decision,
    view: ClusterView,
    previous: Mapping[str, Any],
    *,
    image: str,
    statuses: Mapping[str, Status | None] | None = None,
    extra: Sequence[Condition] = (),
    certificates: Sequence[Mapping[str, Any]] | None = None,
) -> JSON:
    """The whole status document (a merge patch replaces each key it names); ``extra``: the adapter's
    own conditions beside the engine's; ``certificates``: status.certificates, when known."""
    generation = view.generation
    listed = members(view, decision.current_primary, statuses)
    system_id = previous.get("systemIdentifier")
    # The primary's first: after a major upgrade the kept replica still reports the old system's.
    ordered = sorted((statuses or {}).items(), key=lambda item: item[0] != decision.current_primary)
    for _, status in ordered:
        if status is not None and status.system_identifier:
            system_id = str(status.system_identifier)
            break
    operation = decision.status.operation
    return {
        "phase": decision.phase.value,
        "message": decision.message or None,
        "conditions": conditions(
            [*decision.conditions, *extra], previous.get("conditions") or [], generation
        ),
        "observedGeneration": generation,
        "currentPrimary": decision.current_primary,
        "targetPrimary": decision.target_primary,
        "instances": len(listed),
        "readyInstances": sum(1 for m in listed if m["ready"]),
        "selector": f"{names.LABEL_CLUSTER}={view.cluster},{names.LABEL_COMPONENT}={names.COMPONENT_POSTGRES}",
        "members": listed,
        "timeline": decision.status.timeline,
        "postgresVersion": decision.status.major,
        "image": image,
        "systemIdentifier": system_id,
        "operation": None if operation is None else operation.to_dict(),
        "engine": decision.status.to_dict(),
        "lastSuccessfulBackup": last_successful_backup(view) or previous.get("lastSuccessfulBackup"),
        "certificates": [dict(c) for c in certificates]
        if certificates is not None
        else previous.get("certificates"),
    }


def last_successful_backup(view: ClusterView) -> str | None:
    """The name of the cluster's most recently completed Backup."""
    done = [b for b in view.backups if b.phase == "Completed"]
    if not done:
        return None
    newest = max(done, key=lambda b: (b.completed_at.timestamp() if b.completed_at else 0.0, b.name))
    return newest.name


def unchanged(document: Mapping[str, Any], previous: Mapping[str, Any]) -> bool:
    """True when writing ``document`` would change nothing but condition timestamps."""
    for key, value in document.items():
        if key == "conditions":
            if not _same_conditions(value or [], previous.get(key) or []):
                return False
        elif previous.get(key) != value:
            return False
    return True


def _same_conditions(new: Sequence[Mapping[str, Any]], old: Sequence[Mapping[str, Any]]) -> bool:
    """The same conditions in the same order, lastTransitionTime aside (compared in place: at every
    tick of every cluster, copies of both lists without it cost more than the comparison)."""
    if len(new) != len(old):
        return False
    for mine, theirs in zip(new, old, strict=True):
        for key, value in mine.items():
            if key != "lastTransitionTime" and (key not in theirs or theirs[key] != value):
                return False
        for key in theirs:
            if key != "lastTransitionTime" and key not in mine:
                return False
    return True


def merge_patch(document: Mapping[str, Any], stored: Mapping[str, Any] | None) -> JSON:
    """`document` as a JSON merge patch over what is `stored`: a merge patch keeps every key it does not
    name, so a key of a nested object (the engine's memory, the operation) that `document` no longer
    holds is written as null. Top-level keys it does not name stay (others write them)."""

    def nulled(new: Any, old: Any) -> Any:
        if isinstance(new, Mapping) and isinstance(old, Mapping):
            out = {key: nulled(value, old.get(key)) for key, value in new.items()}
            out.update({key: None for key in old if key not in new})
            return out
        return new

    return {key: nulled(value, (stored or {}).get(key)) for key, value in document.items()}
