"""Retention on Kubernetes: the Backups whose snapshot a prune Job deleted become Expired.

The engine asks for a Prune after each completed Backup when ``backup.retention`` is set; the adapter
runs it as a Job (``<cluster>-prune-<stamp>``, builders/jobs.py), whose container leaves its JSON summary
(``deleted_snapshots``: the snapshot ids it deleted) as its termination message. Once such a Job has
succeeded, every Completed Backup of the cluster whose ``backupId`` it deleted gets phase Expired,
``expiredAt`` (the Job's completion) and in ``message`` which retention did it, and a Normal Event
BackupExpired. From the watch-fed objects: no request unless a Backup changes. A Backup already patched
is not patched again while the watch catches up.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from pgherd.api.backup import expired_status, retention_text
from pgherd.engine.actions import RecordEvent
from pgherd.engine.view import JobState
from pgherd.kube import names
from pgherd.kube.api import ApiError, KubeApi
from pgherd.kube.events import Events
from pgherd.kube.observe import ClusterObjects, job_result, job_state
from pgherd_backup.timestamps import rfc3339

log = logging.getLogger("pgherd.kube.retention")

JSON = dict[str, Any]


def _stamp(at: datetime) -> str:
    return rfc3339(at)


def _finished_at(job: JSON) -> str:
    """When the Job finished (status.completionTime, else its Complete condition's time), else now."""
    status = job.get("status") or {}
    if status.get("completionTime"):
        return str(status["completionTime"])
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Complete" and condition.get("lastTransitionTime"):
            return str(condition["lastTransitionTime"])
    return _stamp(datetime.now(UTC))


def _retention_of(job: JSON) -> str:
    """The retention the Job applied, from its command (--keep-last N, --keep-within D)."""
    containers = ((job.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers") or []
    command = [str(arg) for c in containers for arg in (c.get("command") or []) + (c.get("args") or [])]

    def value(flag: str) -> str | None:
        return command[command.index(flag) + 1] if flag in command[:-1] else None

    keep_last = value("--keep-last")
    return retention_text(
        int(keep_last) if keep_last and keep_last.isdigit() else None, value("--keep-within")
    )


def deleted_snapshots(objects: ClusterObjects) -> dict[str, tuple[str, str]]:
    """snapshot id -> (when, which retention) for every snapshot a succeeded prune Job of the cluster
    deleted (the earliest Job that reports it)."""
    found: dict[str, tuple[str, str]] = {}
    jobs = [
        job
        for job in objects.jobs
        if (job["metadata"].get("labels") or {}).get(names.LABEL_COMPONENT) == names.COMPONENT_PRUNE
        and job_state(job) is JobState.SUCCEEDED
    ]
    for job in sorted(jobs, key=_finished_at):
        result = job_result(objects, job)
        for snapshot in result.get("deleted_snapshots") or []:
            found.setdefault(str(snapshot), (_finished_at(job), _retention_of(job)))
    return found


class Retention:
    """One cluster's Backups expired by its prune Jobs (the names already patched, while the watch lags)."""

    def __init__(self, api: KubeApi, events: Events, namespace: str, cluster: str) -> None:
        self.api, self.events, self.namespace, self.cluster = api, events, namespace, cluster
        self.expired: set[tuple[str, str]] = set()  # (Backup uid or name, snapshot id) patched

    async def expire(self, objects: ClusterObjects) -> list[str]:
        """Patch every Completed Backup of the cluster whose snapshot a prune Job deleted to Expired;
        returns their names."""
        deleted = deleted_snapshots(objects) if objects.backups else {}
        done: list[str] = []
        for backup in objects.backups:
            meta = backup["metadata"]
            status = backup.get("status") or {}
            snapshot = status.get("backupId")
            if (
                ((backup.get("spec") or {}).get("cluster") or {}).get("name") != self.cluster
                or status.get("phase") != "Completed"
                or snapshot not in deleted
            ):
                continue
            key = (str(meta.get("uid") or meta["name"]), str(snapshot))
            if key in self.expired:
                continue
            at, retention = deleted[str(snapshot)]
            fields = expired_status(str(snapshot), at, retention)
            try:
                await self.api.patch(
                    "Backup", self.namespace, meta["name"], {"status": fields}, subresource="status"
                )
            except ApiError as exc:
                log.warning(
                    "%s/%s: Backup %s not marked Expired: %s", self.namespace, self.cluster, meta["name"], exc
                )
                continue
            self.expired.add(key)
            done.append(meta["name"])
            log.info(
                "%s/%s: Backup %s expired: %s", self.namespace, self.cluster, meta["name"], fields["message"]
            )
            await self.events.record(
                backup, RecordEvent("BackupExpired", f"Backup {meta['name']}: {fields['message']}")
            )
        return done
