"""Backups and restores in the sandbox, as Kubernetes would run them.

- A snapshot is a Job: a detached `pgherd-backup snapshot` process (jobs.py) reading the member over the
  replication protocol; it outlives the supervisor, as a Job outlives the operator.
- A restore is the member's agent's own action (`restore {snapshot, target, requestId}`, the Restore's
  name as its id): the agent moves the member's data aside on its volume, restores, replays and
  promotes; the job the engine follows is what the agent's /status says of it.
- The Backup and Restore objects' status, the verify task of a completed Backup, retention's prune task
  (and the Backups whose snapshot it deleted: phase Expired).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import UTC, datetime
from typing import Any, Protocol

from pgherd.agentview import kept_aside_since, restore_job_view, restore_snapshot
from pgherd.api.backup import expired_status, retention_text, status_from_summary
from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import actions as act
from pgherd.engine.view import BackupView, JobKind, JobState, JobView, RestoreView, parse_time
from pgherd.local.jobs import Job, LocalJobs, agent_executable
from pgherd.local.layout import SandboxPaths
from pgherd.local.objects import ObjectStore, now_iso
from pgherd.local.state import SandboxState
from pgherd_backup.agent.client import AgentActionError, AgentClient
from pgherd_backup.agent.wire import FenceRequest, Status
from pgherd_backup.timestamps import rfc3339

log = logging.getLogger("pgherd.sandbox")

PRUNE_TASK = "prune-"  # retention's tasks: prune-<UTC stamp>


class Members(Protocol):
    """What the backups need of the platform's members."""

    def has(self, name: str) -> bool: ...
    def busy(self, name: str) -> bool: ...
    def pod_running(self, name: str) -> bool: ...
    def client(self, name: str) -> AgentClient: ...
    def status(self, name: str) -> Status | None: ...
    def replication_dsn(self, name: str) -> str: ...


class Backups:
    def __init__(
        self,
        paths: SandboxPaths,
        state: SandboxState,
        objects: ObjectStore,
        jobs: LocalJobs,
        members: Members,
    ) -> None:
        self.paths = paths
        self.state = state
        self.objects = objects
        self.jobs = jobs
        self.members = members
        self.agent = agent_executable()
        self._restore_stages: dict[str, str] = {}  # the stage each restore was last seen in
        self._restore_progress: dict[str, dict[str, int]] = {}

    def env(self) -> dict[str, str]:
        """The jobs' environment: the store, its credentials, and pgherd-backup on the PATH."""
        env = dict(os.environ)
        env.update(self.state.s3.env())
        env.update(self.state.postgres_env())  # the cluster's major's pg_basebackup, not the machine's
        env.update(PGHERD_STORE=self.state.store_url, PGHERD_CLUSTER=self.state.cluster)
        env["PATH"] = f"{os.path.dirname(self.agent)}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    def _store_flags(self) -> list[str]:
        return ["--store", self.state.store_url, "--cluster", self.state.cluster]

    # --- what the engine sees -------------------------------------------------------------------------
    def backup_views(self) -> list[BackupView]:
        views = []
        for item in self.objects.backups():
            views.append(BackupView.of(item))
        return views

    def restore_views(self) -> list[RestoreView]:
        views = []
        for item in self.objects.restores():
            spec = item["spec"]
            target = spec.get("target") or {}
            views.append(
                RestoreView(
                    name=item["metadata"]["name"],
                    backup=spec.get("backup"),
                    snapshot_id=spec.get("snapshotId"),
                    target_time=target.get("time"),
                    target_lsn=target.get("lsn"),
                    target_immediate=bool(target.get("immediate", False)),
                    phase=(item.get("status") or {}).get("phase", "Pending"),
                    created_at=parse_time(item["metadata"].get("creationTimestamp")),
                )
            )
        return views

    def job_views(self) -> list[JobView]:
        return [
            self.jobs.view(job) if job.kind is JobKind.SNAPSHOT else self._restore_view(job)
            for job in self.jobs.all()
        ]

    def _restore_view(self, job: Job) -> JobView:
        """A restore as its agent tells it (pgherd.agentview.restore_job_view)."""
        member = job.meta.get("member")
        if job.rc is not None or not member:
            return self.jobs.view(job)  # failed before it reached the agent
        stage = self._restore_stages.get(job.name, "restoring")
        view = restore_job_view(job.name, member, self.members.status(member), stage)
        if view.state is JobState.RUNNING and view.stage:
            self._restore_stages[job.name] = view.stage
        return view

    # --- the engine's actions ----------------------------------------------------------------------------
    def _do_StartSnapshot(self, action: act.StartSnapshot, spec: PostgresClusterSpec) -> None:
        if not self.members.has(action.member):
            return
        compression = spec.backup.compression.value if spec.backup is not None else "zstd"
        command = [
            self.agent,
            "snapshot",
            *self._store_flags(),
            "--source",
            self.members.replication_dsn(action.member),
            "--compression",
            compression,
        ]
        self.jobs.start(JobKind.SNAPSHOT, action.backup, command, self.env(), member=action.member)
        self.objects.update_status("Backup", action.backup, startedAt=now_iso())

    def _do_StartRestore(self, action: act.StartRestore, spec: PostgresClusterSpec) -> None:
        """Ask the member's agent to restore in place (it answers at once; the restore goes on there).
        The job is recorded once the agent took the order; asked again under the same name, the agent
        answers that restore's state and never starts another."""
        name = action.member
        job = self.jobs.job(JobKind.RESTORE, action.restore)
        if not self.members.has(name) or (job.folder / "job.json").exists() or self.members.busy(name):
            return
        try:
            snapshot = self.snapshot_id(action.backup, action.snapshot_id)
        except ValueError as exc:
            self.jobs.fail(JobKind.RESTORE, action.restore, str(exc), member=name)
            return
        if not self.members.pod_running(name):
            return  # its pod is being restarted: the engine asks again
        started_at = time.time()
        client = self.members.client(name)
        status = self.members.status(name)
        try:
            if status is not None and not status.fenced and not status.data_present:
                # An empty volume (no member yet for the engine, which fences members only) has nothing
                # to fence, but its agent restores only under a fence: as on Kubernetes.
                client.act(FenceRequest(reason=f"restore {action.restore} into an empty member"))
            result = client.restore(snapshot, action.target, request_id=action.restore, reason=action.reason)
        except AgentActionError as exc:
            if exc.status != 500:
                raise  # refused or busy: the engine asks again
            # This restore already ran on the agent and failed (a supervisor that restarted before it
            # recorded the job): its failure is the job's.
            self.jobs.fail(JobKind.RESTORE, action.restore, exc.message, member=name)
            return
        self.jobs.record(
            JobKind.RESTORE, action.restore, member=name, started_at=started_at, snapshot=snapshot
        )
        log.info("restore %s into %s: %s", action.restore, name, result.detail)
        fields: dict[str, Any] = {"startedAt": now_iso()}
        if snapshot != "latest":
            fields["snapshotId"] = snapshot
        self.objects.update_status("Restore", action.restore, **fields)

    def _do_CreateBackup(self, action: act.CreateBackup, spec: PostgresClusterSpec) -> None:
        self.objects.create_backup(action.name)

    def _do_UpdateBackup(self, action: act.UpdateBackup, spec: PostgresClusterSpec) -> None:
        fields: dict[str, Any] = {
            "phase": action.phase,
            "sourceMember": action.source_member,
            "error": action.error,
        }
        if action.phase in ("Completed", "Failed"):
            fields["completedAt"] = now_iso()
            summary = self.jobs.job(JobKind.SNAPSHOT, action.name).stdout_json() or {}
            if summary:
                fields.update(status_from_summary(summary, self.state.store_url))
                if action.phase == "Completed" and summary.get("id"):
                    # `verified` means what it says: every object re-read and checked, by a verify task.
                    command = [self.agent, "verify", *self._store_flags(), str(summary["id"])]
                    self.jobs.start_task(f"verify-{action.name}", command, self.env())
        self.objects.update_status("Backup", action.name, **fields)

    def _do_UpdateRestore(self, action: act.UpdateRestore, spec: PostgresClusterSpec) -> None:
        fields: dict[str, Any] = {
            "phase": action.phase,
            "error": action.error,
            "restoredTimeline": action.restored_timeline,
        }
        if action.phase in ("Completed", "Failed"):
            fields["completedAt"] = now_iso()
            meta = self.jobs.job(JobKind.RESTORE, action.name).meta
            kept = self.kept_aside_since(float(meta.get("started_at", 0))) if meta else []
            if kept:
                fields["keptData"] = kept
        self.objects.update_status("Restore", action.name, **fields)

    def _do_Prune(self, action: act.Prune, spec: PostgresClusterSpec) -> None:
        command = [self.agent, "prune", *self._store_flags()]
        if action.keep_last is not None:
            command += ["--keep-last", str(action.keep_last)]
        if action.keep_within is not None:
            command += ["--keep-within", action.keep_within]
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        retention = retention_text(action.keep_last, action.keep_within)
        after = action.reason.removeprefix("after ") if action.reason.startswith("after ") else None
        self.jobs.start_task(f"{PRUNE_TASK}{stamp}", command, self.env(), retention=retention, after=after)

    # --- the supervisor's tick -----------------------------------------------------------------------------
    def advance_verifications(self) -> None:
        """Record the outcome of each verify task on its Backup (verified true/false)."""
        for item in self.objects.backups():
            status = item.get("status") or {}
            if status.get("phase") != "Completed" or status.get("verified") is not None:
                continue
            task = self.jobs.task(f"verify-{item['metadata']['name']}")
            if task.rc is None:
                continue
            if task.rc == 0:
                self.objects.update_status("Backup", item["metadata"]["name"], verified=True)
            else:
                self.objects.update_status(
                    "Backup",
                    item["metadata"]["name"],
                    verified=False,
                    error=f"verify failed: {task.error_text()}",
                )

    def advance_retention(self) -> None:
        """Each Backup whose snapshot a finished prune task deleted becomes Expired, with when (the task's
        end) and which retention did it: never restored again, never `latest`. Each task is read once."""
        for task in self.jobs.tasks(PRUNE_TASK):
            meta = task.meta
            if task.rc is None or meta.get("expired"):
                continue
            deleted = (
                set((task.stdout_json() or {}).get("deleted_snapshots") or []) if task.rc == 0 else set()
            )
            at = _iso(datetime.fromtimestamp((task.folder / "rc").stat().st_mtime, UTC))
            for item in self.objects.backups():
                status = item.get("status") or {}
                snapshot = status.get("backupId")
                if status.get("phase") != "Completed" or snapshot not in deleted:
                    continue
                name = item["metadata"]["name"]
                fields = expired_status(
                    str(snapshot), at, str(meta.get("retention") or "retention"), meta.get("after")
                )
                self.objects.update_status("Backup", name, **fields)
                log.info("Backup %s expired: %s", name, fields["message"])
            task.set_meta(expired=True)

    def advance_restores(self) -> None:
        """Restore.status.progress (bytes written of the snapshot's size) and the snapshot it resolved,
        from the agent's actionProgress."""
        for job in self.jobs.all():
            member = job.meta.get("member")
            if job.kind is not JobKind.RESTORE or job.rc is not None or not member:
                continue
            status = self.members.status(member)
            progress = status.action_progress if status is not None else None
            if progress is None or progress.request_id != job.name:
                continue
            fields: dict[str, Any] = {}
            if progress.bytes_total is not None:
                done = {"bytesDone": progress.bytes_done or 0, "bytesTotal": progress.bytes_total}
                if self._restore_progress.get(job.name) != done:
                    self._restore_progress[job.name] = done
                    fields["progress"] = done
            if progress.snapshot and progress.snapshot != job.meta.get("snapshot"):
                job.set_meta(snapshot=progress.snapshot)
                fields["snapshotId"] = progress.snapshot
            if fields:
                self.objects.update_status("Restore", job.name, **fields)

    # --- helpers ---------------------------------------------------------------------------------------------
    def snapshot_id(self, backup: str | None, snapshot_id: str | None) -> str:
        """The snapshot a Backup name (or `latest`) stands for; ValueError for a Backup without one, or
        an Expired one (its snapshot deleted by retention)."""

        def backup_status_of(name: str) -> dict[str, Any] | None:
            found = self.objects.backup(name)
            return None if found is None else dict(found.get("status") or {})

        return restore_snapshot(backup, snapshot_id, backup_status_of)

    def kept_aside_since(self, since: float) -> list[str]:
        """Data directories kept aside on the members' volumes since `since` (by a restore or a
        re-clone: the agents name them by their UTC time)."""
        if not self.paths.members.is_dir():
            return []
        kept = [str(path) for path in sorted(self.paths.members.glob("*/kept/*"))]
        return kept_aside_since(kept, datetime.fromtimestamp(since, UTC))


def _iso(at: datetime) -> str:
    return rfc3339(at)
