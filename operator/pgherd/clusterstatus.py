"""The PostgresCluster's ``status`` document from a Decision, built once for both platforms: what
`kubectl get pgc`, `pgherd sandbox status` and users read, and the engine's memory (``status.engine``)
that a restarted operator or supervisor resumes from. Each platform adds only its own keys (Kubernetes:
the scale selector, the image, the certificates; the sandbox: each member's port and DSN).

Where the two used to differ, Kubernetes' meaning holds: a member is ``ready`` when its agent says so
(PostgreSQL accepts connections) and its platform does not say otherwise, not merely when it answers;
LSNs are written as PostgreSQL prints them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pgherd.engine.conditions import Condition
from pgherd.engine.lsn import format_lsn
from pgherd.engine.plan import Decision
from pgherd.engine.view import ClusterView, MemberView, Role
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
    statuses: Mapping[str, Status | None] | None = None,
    extra: Sequence[Condition] = (),
) -> JSON:
    """The status document both platforms write (a merge patch replaces each key it names); ``previous``:
    the status written last; ``statuses``: the agents' /status by member; ``extra``: the platform's own
    conditions beside the engine's."""
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
        "members": listed,
        "timeline": decision.status.timeline,
        "postgresVersion": decision.status.major,
        "systemIdentifier": system_id,
        "operation": None if operation is None else operation.to_dict(),
        "engine": decision.status.to_dict(),
        "lastSuccessfulBackup": last_successful_backup(view) or previous.get("lastSuccessfulBackup"),
    }


def last_successful_backup(view: ClusterView) -> str | None:
    """The name of the cluster's most recently completed Backup."""
    done = [b for b in view.backups if b.phase == "Completed"]
    if not done:
        return None
    newest = max(done, key=lambda b: (b.completed_at.timestamp() if b.completed_at else 0.0, b.name))
    return newest.name
