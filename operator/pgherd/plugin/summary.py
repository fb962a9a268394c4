"""The status document summarized: what a person on call reads, top to bottom, as plain data (the
text renderer prints it; `status -o json` prints it as is). Pure: no request, no clock."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from pgherd.engine.lsn import format_lsn
from pgherd.engine.quorum import SyncConfig, majority
from pgherd.engine.view import parse_time
from pgherd.plugin.document import StatusDocument, of_cluster
from pgherd.plugin.explain import Explanation, at, duration, engine_status, explain, next_scheduled

JSON = dict[str, Any]
# A certificate this close to its end is reported as expiring (pgherd renews 30 days ahead).
EXPIRING = timedelta(days=21)
EVENTS_SHOWN = 10


def _time(value: datetime | None) -> str | None:
    return None if value is None else at(value)


def summarize(document: StatusDocument) -> JSON:
    cluster = document["cluster"]
    meta: Mapping[str, Any] = cluster.get("metadata") or {}
    spec: Mapping[str, Any] = cluster.get("spec") or {}
    status: Mapping[str, Any] = cluster.get("status") or {}
    now = parse_time(document["now"])
    assert now is not None, "the document's `now` is an RFC 3339 time"
    why = explain(cluster, now)
    members = _members(document, status)
    return {
        "cluster": meta.get("name"),
        "namespace": document["namespace"],
        "platform": document["platform"],
        "readAt": document["now"],
        "phase": why.phase,
        "why": _why(why),
        "operation": _operation(why),
        "primary": status.get("currentPrimary"),
        "targetPrimary": status.get("targetPrimary"),
        "timeline": status.get("timeline"),
        "instances": {
            "wanted": spec.get("instances", 3),
            "members": len(members),
            "ready": sum(1 for m in members if m["ready"]),
        },
        "postgresVersion": {"running": status.get("postgresVersion"), "wanted": spec.get("postgresVersion")},
        "image": status.get("image") or spec.get("image"),
        "paused": bool(spec.get("paused")),
        "operator": document["operator"],
        "members": members,
        "replication": _replication(spec, status),
        "archiving": _archiving(spec, status),
        "backups": _backups(document, spec, status, now),
        "restores": _restores(document),
        "certificates": _certificates(document, now),
        "conditions": _conditions(status),
        "events": list(document["events"][-EVENTS_SHOWN:]),
        "notes": list(document["notes"]),
    }


def _why(why: Explanation) -> JSON:
    return {
        "meaning": why.meaning,
        "reason": why.reason,
        "waiting": why.waiting,
        "since": _time(why.since),
        "sinceWhat": why.since_what,
        "next": list(why.next),
    }


def _operation(why: Explanation) -> JSON | None:
    operation = why.operation
    if operation is None:
        return None
    return {
        "kind": operation.kind,
        "reason": operation.reason,
        "startedAt": _time(operation.started_at),
        "step": operation.step,
        "stepStartedAt": _time(operation.step_started_at),
        "steps": [{"name": s.name, "text": s.text, "state": s.state} for s in operation.steps],
    }


def _lsn(value: Any) -> str | None:
    """An LSN as PostgreSQL prints it (both platforms write text; a sandbox's status.json from before
    the shared status builder holds integers)."""
    if isinstance(value, int):
        return format_lsn(value)
    return None if value is None else str(value)


def _members(document: StatusDocument, status: Mapping[str, Any]) -> list[JSON]:
    rows = []
    for member in status.get("members") or []:
        name = str(member.get("name"))
        placement = document["placements"].get(name) or {}
        rows.append(
            {
                "name": name,
                "role": member.get("role") or "unknown",
                "ready": bool(member.get("ready")),
                "reachable": bool(member.get("reachable")),
                "timeline": member.get("timeline"),
                "lsn": _lsn(member.get("receivedLSN")),
                "replayedLsn": _lsn(member.get("replayedLSN")),
                "lagBytes": member.get("lagBytes"),
                "lagSeconds": member.get("lagSeconds"),
                "node": placement.get("node"),
                "restarts": placement.get("restarts"),
                "version": member.get("version"),
                "waiting": placement.get("waiting"),
            }
        )
    known = {row["name"] for row in rows}
    for name, placement in sorted(document["placements"].items()):
        if name not in known:  # a pod the operator has not reported yet (just created, or no status)
            rows.append(
                {
                    "name": name,
                    "role": "unknown",
                    "ready": False,
                    "reachable": False,
                    "timeline": None,
                    "lsn": None,
                    "replayedLsn": None,
                    "lagBytes": None,
                    "lagSeconds": None,
                    "node": placement.get("node"),
                    "restarts": placement.get("restarts"),
                    "version": None,
                    "waiting": placement.get("waiting") or placement.get("pod_phase"),
                }
            )
    return rows


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


def _replication(spec: Mapping[str, Any], status: Mapping[str, Any]) -> JSON:
    instances = int(spec.get("instances", 3))
    mode = (spec.get("replication") or {}).get("mode") or ("quorum" if instances >= 3 else "async")
    engine = status.get("engine") or {}
    voters = sorted(engine.get("voters") or [])

    def rendered(key: str) -> str | None:
        value = engine.get(key)
        if not isinstance(value, dict):
            return None
        try:
            return SyncConfig.from_dict(value).render() or "'' (asynchronous)"
        except ValueError:
            return None

    commit = _condition(status, "QuorumCommit")
    healthy = _condition(status, "QuorumHealthy")
    return {
        "mode": mode,
        "quorumCommit": commit.get("message") or None,
        "voters": voters,
        "needed": majority(len(voters)) if voters else None,
        "synchronousStandbyNames": rendered("sync"),
        "pending": rendered("syncPending"),
        "quorumHealthy": healthy.get("status"),
        "quorumMessage": healthy.get("message") or None,
    }


_ARCHIVER_FIELDS = {
    "lastArchivedWal": ("lastArchivedWal", "lastArchivedWAL", "lastArchivedSegment"),
    "lastArchivedAt": ("lastArchivedTime", "lastArchivedAt"),
    "lastFailedWal": ("lastFailedWal", "lastFailedWAL", "lastFailedSegment"),
    "lastFailedAt": ("lastFailedTime", "lastFailedAt"),
    "failedCount": ("failedCount",),
    "waiting": ("pending", "readySegments", "waitingSegments"),
}


def _archiving(spec: Mapping[str, Any], status: Mapping[str, Any]) -> JSON:
    backup = spec.get("backup") or {}
    enabled = bool(backup.get("store")) and backup.get("walArchiving", True) is not False
    condition = _condition(status, "ContinuousArchiving")
    out: JSON = {
        "enabled": enabled,
        "state": condition.get("reason") or ("Archiving" if enabled else "Disabled"),
        "healthy": condition.get("status"),
        "message": condition.get("message") or None,
        "known": False,
    }
    reported = status.get("archiving")
    if isinstance(reported, dict):
        out["known"] = True
        for key, candidates in _ARCHIVER_FIELDS.items():
            out[key] = next((reported[c] for c in candidates if c in reported), None)
    return out


def _backup_row(backup: Mapping[str, Any]) -> JSON:
    meta, st = backup.get("metadata") or {}, backup.get("status") or {}
    return {
        "name": meta.get("name"),
        "phase": st.get("phase") or "Pending",
        "backupId": st.get("backupId"),
        "startedAt": st.get("startedAt"),
        "completedAt": st.get("completedAt"),
        "size": st.get("size"),
        "storedSize": st.get("storedSize"),
        "verified": st.get("verified"),
        "postgresVersion": st.get("postgresVersion"),
        "error": st.get("error") or st.get("message"),
        "createdAt": meta.get("creationTimestamp"),
    }


def _finished_at(row: JSON) -> str:
    return str(row.get("completedAt") or row.get("createdAt") or "")


def _backups(
    document: StatusDocument, spec: Mapping[str, Any], status: Mapping[str, Any], now: datetime
) -> JSON:
    name = str((document["cluster"].get("metadata") or {}).get("name"))
    rows = [_backup_row(b) for b in of_cluster(document["backups"], name)]
    completed = sorted((r for r in rows if r["phase"] == "Completed"), key=_finished_at)
    failed = sorted((r for r in rows if r["phase"] == "Failed"), key=_finished_at)
    store = ((spec.get("backup") or {}).get("store") or {}).get("s3") or {}
    schedule = (spec.get("backup") or {}).get("schedule")
    due = next_scheduled(spec, engine_status(status), now)
    first = status.get("firstRecoverabilityPoint")
    first_from = "status" if first else None
    if not first and completed:
        first, first_from = (
            completed[0]["completedAt"],
            f"the oldest Completed Backup, {completed[0]['name']}",
        )
    last_failed = failed[-1] if failed else None
    if last_failed is not None and completed and _finished_at(completed[-1]) > _finished_at(last_failed):
        last_failed = None  # a success since: the failure is history
    return {
        "store": f"s3://{store.get('bucket')}/{store.get('path') or ''}".rstrip("/") if store else None,
        "schedule": schedule,
        "nextScheduled": None if due is None else at(due),
        "lastCompleted": completed[-1] if completed else None,
        "lastFailed": last_failed,
        "inProgress": [r for r in rows if r["phase"] in ("Pending", "Running")],
        "count": len(rows),
        "expired": sum(1 for r in rows if r["phase"] == "Expired"),
        "firstRecoverabilityPoint": first,
        "firstRecoverabilityFrom": first_from,
        "lastSuccessful": status.get("lastSuccessfulBackup"),
    }


def _restores(document: StatusDocument) -> list[JSON]:
    name = str((document["cluster"].get("metadata") or {}).get("name"))
    out = []
    for restore in of_cluster(document["restores"], name):
        meta, st, spec = restore.get("metadata") or {}, restore.get("status") or {}, restore.get("spec") or {}
        progress = st.get("progress") or {}
        out.append(
            {
                "name": meta.get("name"),
                "phase": st.get("phase") or "Pending",
                "from": spec.get("backup") or spec.get("snapshotId"),
                "target": spec.get("target"),
                "error": st.get("error"),
                "bytesDone": progress.get("bytesDone"),
                "bytesTotal": progress.get("bytesTotal"),
                "createdAt": meta.get("creationTimestamp"),
                "keptData": st.get("keptData"),
            }
        )
    return sorted(out, key=lambda r: str(r["createdAt"] or ""))


def _certificates(document: StatusDocument, now: datetime) -> list[JSON] | None:
    records = document["certificates"]
    if records is None:
        return None
    out = []
    for record in records:
        expires = parse_time(record["not_after"])
        if expires is None:
            state, left = "unknown", None
        else:
            remaining = expires - now
            state = "expired" if remaining <= timedelta(0) else ("expiring" if remaining < EXPIRING else "ok")
            left = duration(abs(remaining.total_seconds()))
        out.append(
            {
                "name": record["name"],
                "subject": record["subject"],
                "notAfter": record["not_after"],
                "state": state,
                "left": left,
                "source": record["source"],
            }
        )
    return out


def _conditions(status: Mapping[str, Any]) -> list[JSON]:
    return [
        {
            "type": c.get("type"),
            "status": c.get("status"),
            "reason": c.get("reason"),
            "message": c.get("message") or "",
            "since": c.get("lastTransitionTime"),
        }
        for c in status.get("conditions") or []
        if c.get("status") != "True"
    ]
