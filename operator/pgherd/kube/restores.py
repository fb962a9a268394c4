"""Restores on Kubernetes, carried out where the member's volume is: by the restoring member's agent.

- StartRestore is ``POST /actions/restore {snapshot, target, requestId: <restore>}`` on the member's
  agent (in the background: the agent answers at once and goes on alone, keeping the old data aside
  on its volume). Once the agent took the order, or answered that this restore already ran, the
  operator records which member runs which restore in the PostgresCluster's annotation
  ``pgherd.io/restore-job``: a restarted operator follows that restore instead of asking again, and an
  agent that then has no record of it lost its volume (the restore failed). One record serves a
  Restore object's restore and the engine's automatic recovery alike (which has no object).
- The engine's restore job is what that member's ``/status`` says of it
  (``pgherd.agentview.restore_job_view``, as in the sandbox).
- The Restore object's status: ``startedAt`` and the snapshot when the agent takes it, ``progress``
  (bytes written of the snapshot's size) and the resolved ``snapshotId`` while it runs,
  ``completedAt`` and ``keptData`` at the end (with the engine's phase, see actions.update_restore).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pgherd.agentview import kept_aside_since, restore_job_view, restore_snapshot
from pgherd.engine.view import JobKind, JobState, JobView
from pgherd.kube import names
from pgherd.kube.api import ApiError, KubeApi
from pgherd.kube.observe import ClusterObjects
from pgherd_backup.agent.wire import Status
from pgherd_backup.timestamps import rfc3339

log = logging.getLogger("pgherd.kube.restores")

JSON = dict[str, Any]


def iso(at: datetime) -> str:
    return rfc3339(at)


@dataclass(frozen=True)
class RestoreRecord:
    """Restore ``restore`` was taken by ``member``'s agent at ``started_at``; ``error``: it was refused
    before any agent took it (a Backup without a snapshot), which fails the engine's job."""

    restore: str
    member: str
    started_at: datetime
    error: str | None = None

    def annotation(self) -> str:
        doc: JSON = {"restore": self.restore, "member": self.member, "startedAt": iso(self.started_at)}
        if self.error is not None:
            doc["error"] = self.error
        return json.dumps(doc, sort_keys=True)

    @classmethod
    def parse(cls, text: str | None) -> RestoreRecord | None:
        if not text:
            return None
        try:
            doc = json.loads(text)
            started = datetime.fromisoformat(str(doc["startedAt"]).replace("Z", "+00:00"))
            return cls(str(doc["restore"]), str(doc["member"]), started, doc.get("error"))
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring an unreadable %s annotation: %r", names.ANNOTATION_RESTORE, text)
            return None


def snapshot_to_restore(objects: ClusterObjects, backup: str | None, snapshot_id: str | None) -> str:
    """The snapshot id (or ``latest``) of a restore order; ValueError for a Backup without a snapshot,
    or an Expired one (its snapshot deleted by retention)."""

    def backup_status_of(name: str) -> JSON | None:
        found = next((b for b in objects.backups if b["metadata"]["name"] == name), None)
        return None if found is None else dict(found.get("status") or {})

    return restore_snapshot(backup, snapshot_id, backup_status_of)


class Restores:
    """One cluster's restore record (in memory, and on the cluster's annotation) and its following."""

    def __init__(self, api: KubeApi, namespace: str, cluster: str) -> None:
        self.api, self.namespace, self.cluster = api, namespace, cluster
        self.record: RestoreRecord | None = None
        self._stage = "restoring"  # the stage the recorded restore was last seen in
        self._reported: JSON = {}  # what was last written to its Restore's status by follow()
        self._saved_at = float("-inf")  # time.monotonic() when this operator saved the record

    def load(self, cluster: JSON) -> None:
        """The record as the API has it (when the loop starts or regains the leadership)."""
        annotations = cluster["metadata"].get("annotations") or {}
        self.record = RestoreRecord.parse(annotations.get(names.ANNOTATION_RESTORE))

    def taken(self, name: str) -> bool:
        return self.record is not None and self.record.restore == name

    async def save(self, record: RestoreRecord) -> None:
        await self.api.patch(
            "PostgresCluster",
            self.namespace,
            self.cluster,
            {"metadata": {"annotations": {names.ANNOTATION_RESTORE: record.annotation()}}},
        )
        self.record, self._stage, self._reported = record, "restoring", {}
        self._saved_at = time.monotonic()

    def job_views(
        self, statuses: Mapping[str, Status | None], observed_at: float = float("inf")
    ) -> tuple[JobView, ...]:
        """The engine's restore job of the recorded restore, as its member's agent tells it.
        ``observed_at``: time.monotonic() when ``statuses`` were asked for. A status asked for before
        the record was saved may predate the agent's taking the order: it says nothing of the restore
        (running, as last seen), never that the agent has no record of it."""
        record = self.record
        if record is None:
            return ()
        if record.error is not None:
            return (
                JobView(
                    JobKind.RESTORE, record.restore, JobState.FAILED, record.member, message=record.error
                ),
            )
        status = statuses.get(record.member) if observed_at >= self._saved_at else None
        view = restore_job_view(record.restore, record.member, status, self._stage)
        if view.state is JobState.RUNNING and view.stage:
            self._stage = view.stage
        return (view,)

    async def follow(self, objects: ClusterObjects, statuses: Mapping[str, Status | None]) -> None:
        """The recorded restore's progress and resolved snapshot onto its Restore object, when changed."""
        record = self.record
        restore = restore_object(objects, record.restore) if record is not None else None
        if record is None or restore is None:
            return
        status = statuses.get(record.member)
        progress = status.action_progress if status is not None else None
        if progress is None or progress.request_id != record.restore:
            return
        fields: JSON = {}
        if progress.bytes_total is not None:
            fields["progress"] = {"bytesDone": progress.bytes_done or 0, "bytesTotal": progress.bytes_total}
        if progress.snapshot and progress.snapshot != "latest":
            fields["snapshotId"] = progress.snapshot
        changed = {k: v for k, v in fields.items() if self._reported.get(k) != v}
        if not changed:
            return
        try:
            await self.api.patch(
                "Restore", self.namespace, record.restore, {"status": changed}, subresource="status"
            )
        except ApiError as exc:
            log.warning(
                "%s/%s: restore %s progress not written: %s",
                self.namespace,
                self.cluster,
                record.restore,
                exc,
            )
            return
        self._reported.update(changed)

    def kept_data(self, name: str, statuses: Mapping[str, Status | None]) -> list[str]:
        """``member:path`` of each data directory kept aside since restore ``name`` started (the
        restored member's old data, and the survivors' the rebuild re-cloned)."""
        if self.record is None or self.record.restore != name:
            return []
        kept: list[str] = []
        for member, status in sorted(statuses.items()):
            if status is not None:
                kept += [f"{member}:{p}" for p in kept_aside_since(status.kept_aside, self.record.started_at)]
        return kept


def restore_object(objects: ClusterObjects, name: str) -> JSON | None:
    """The Restore object of that name, if the restore has one (the automatic recovery has none)."""
    return next((r for r in objects.restores if r["metadata"]["name"] == name), None)
