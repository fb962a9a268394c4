"""The agent-based sandbox: every member is its own `pgherd instance run` process (its pod).

The supervisor acts on a member only through its agent's API (AgentClient), as the Kubernetes adapter
does; what stays here is the platform's work: starting, restarting (after ``restart_delay``, as the
kubelet does) and stopping the agent processes, their directories and ports, the rw endpoint record,
and the snapshot jobs; a restore is the member's agent's own action, followed in its /status. Observation is every agent's /status at once, mapped to MemberView by
``pgherd.agentview`` — the one mapping the Kubernetes adapter will use too.

Each engine action is one agent call. Calls that answer at once or must keep their order (Fence,
Promote, SetSynchronousStandbys, DropReplicationSlot) are made in the tick; calls that may take long
(Rejoin, RestartMember, Demote, Unfence) run in the member's worker thread, so that observation and
failover never wait for them; an action for a busy member is skipped and the engine re-issues it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from datetime import UTC, datetime
from typing import Any

from pgherd.agentview import fetch_statuses, member_view, parse_sync_standby_names, port_resolver
from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import actions as act
from pgherd.engine.view import JobKind, JobState, JobView, MemberView
from pgherd.local.jobs import Job
from pgherd.local.layout import SandboxPaths
from pgherd.local.objects import ObjectStore, now_iso
from pgherd.local.observe import Observation
from pgherd.local.platform import _FAST_SETTINGS, LocalPlatform
from pgherd.local.pods import Credentials, Pods
from pgherd.local.state import MemberState, SandboxState
from pgherd_backup.agent.client import AgentActionError, AgentClient, AgentError, AgentUnreachable
from pgherd_backup.agent.wire import ActionResult, FenceRequest, Status, lsn_value
from pgherd_backup.postgres.config import OWNED_SETTINGS
from pgherd_backup.postgres.seed import is_empty

log = logging.getLogger("pgherd.sandbox")

# The kubelet's liveness probe: a pod whose /healthz fails this many times in a row, this far apart,
# is killed (then restarted after the restart delay). An agent whose PostgreSQL should run and does not
# (its first start failed) says so there and waits for exactly this.
LIVENESS_PERIOD = 2.0
LIVENESS_FAILURES = 3
FENCE_TIMEOUT = 30.0  # a fence answers once PostgreSQL stopped: CHECKPOINT + fast shutdown, bounded
# A crashed PostgreSQL fsyncs its whole data directory, file by file, before its crash recovery: 2.6 s
# here, most of what a crashed primary's restart costs. One syncfs() per file system is as durable on
# Linux and takes milliseconds.
_AFTER_CRASH = {"recovery_init_sync_method": "syncfs"}
# Settings the agent sets itself (its member name as cluster_name) besides those pgherd owns.
_AGENT_SETTINGS = frozenset({"cluster_name"})


def _render(value: object) -> str:
    if isinstance(value, bool):
        value = "on" if value else "off"
    return "'" + str(value).replace("'", "''") + "'"


def observation(status: Status | None) -> Observation:
    """The inline platform's Observation of a /status (the sandbox's status file and job views)."""
    if status is None or status.role not in ("primary", "replica"):
        return Observation(False)
    sender_port = None
    if status.wal_receiver is not None and status.wal_receiver.upstream:
        _, _, port = status.wal_receiver.upstream.rpartition(":")
        sender_port = int(port) if port.isdigit() else None
    return Observation(
        reachable=True,
        in_recovery=status.role == "replica",
        received_lsn=lsn_value(status.received_lsn),
        replayed_lsn=lsn_value(status.replayed_lsn),
        timeline=status.timeline,
        receiver_streaming=status.streaming,
        sender_port=sender_port,
        sync=parse_sync_standby_names(status.synchronous_standby_names or ""),
        archiving_healthy=status.archiving_healthy,
    )


class AgentPlatform(LocalPlatform):
    def __init__(self, paths: SandboxPaths, state: SandboxState, objects: ObjectStore) -> None:
        super().__init__(paths, state, objects)
        self.credentials = Credentials(paths, state)
        self.credentials.ensure()
        self.pods = Pods(paths, state, self.credentials)
        self._statuses: dict[str, Status | None] = {}
        self._liveness_due = 0.0
        self._liveness_failures: dict[str, int] = {}
        self._restore_stages: dict[str, str] = {}  # the last stage each restore was seen in
        self._restore_progress: dict[str, dict[str, int]] = {}

    def agent_url(self, name: str) -> str | None:
        member = self.members.get(name)
        return None if member is None else self.pods.url(member.ordinal)

    def _address(self, name: str) -> str:
        return f"127.0.0.1:{self._port(name)}"

    def _client(self, name: str) -> AgentClient:
        return self.pods.client(name, self.members[name].ordinal)

    def _write_parameters(self, name: str, spec: PostgresClusterSpec) -> None:
        """The member's PostgreSQL parameters, read again by its agent at every start."""
        values = {**_FAST_SETTINGS, **_AFTER_CRASH, **(spec.parameters or {})}
        lines = [
            f"{key} = {_render(value)}\n"
            for key, value in sorted(values.items())
            if key not in OWNED_SETTINGS and key not in _AGENT_SETTINGS
        ]
        path = self.pods.parameters_file(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(lines))
        os.replace(tmp, path)

    def _start_pod(self, member: MemberState, spec: PostgresClusterSpec | None = None) -> None:
        if spec is not None:
            self._write_parameters(member.name, spec)
        pid = self.pods.start(member.name, member.ordinal, member.revision, member.seed, self.state.s3.env())
        log.info(
            "started the agent of %s (pid %d%s)",
            member.name,
            pid,
            f", {' '.join(member.seed)}" * bool(member.seed),
        )

    # --- the kubelet's part ---------------------------------------------------------------------------
    def keep_running(self, spec: PostgresClusterSpec) -> None:
        """Start a dead member's agent again after the restart delay (a lost pod); PostgreSQL inside it
        is the agent's: a crash is restarted read-only at once, a fence keeps it stopped."""
        self._check_liveness()
        now = time.time()
        for name, member in list(self.members.items()):
            if not member.wanted or self.busy(name):
                continue
            if self.pods.running(name):
                if member.restart_at is not None:
                    member.restart_at = None
                    member.save(self.paths)
                continue
            if member.restart_at is None:
                member.restart_at = now + self.state.restart_delay
                member.save(self.paths)
                log.info("the agent of %s is down: restarting it in %.0fs", name, self.state.restart_delay)
                continue
            if now >= member.restart_at:
                member.restart_at = None
                member.restarts += 1
                member.save(self.paths)
                self._start_pod(member, spec)

    def _check_liveness(self) -> None:
        """/healthz of the members whose PostgreSQL should run and does not (from the last /status):
        probing only those keeps the tick free of calls in the steady state."""
        now = time.monotonic()
        if now < self._liveness_due:
            return
        self._liveness_due = now + LIVENESS_PERIOD
        for name, status in self._statuses.items():
            suspect = (
                status is not None
                and name in self.members
                and status.postmaster in ("stopped", "crashed")
                and status.action is None
                and status.data_present
                and (not status.fenced or status.demoted)
            )
            if not suspect or self.busy(name):
                self._liveness_failures.pop(name, None)
                continue
            try:
                code = self._client(name).probe("healthz", timeout=1.0)
            except AgentError:
                continue  # no answer: the pod's process check decides
            if code < 500:
                self._liveness_failures.pop(name, None)
                continue
            failures = self._liveness_failures.get(name, 0) + 1
            self._liveness_failures[name] = failures
            if failures >= LIVENESS_FAILURES:
                log.warning("%s fails its liveness probe (%d times): killing its pod", name, failures)
                self._liveness_failures.pop(name, None)
                self.pods.kill(name)

    # --- observation ------------------------------------------------------------------------------------
    def observe_members(self) -> tuple[list[MemberView], dict[str, Observation]]:
        ordered = sorted(self.members.values(), key=lambda m: m.ordinal)
        alive = {m.name: self.pods.running(m.name) for m in ordered}
        statuses = fetch_statuses({m.name: self._client(m.name) for m in ordered if alive[m.name]})
        self._statuses = statuses
        ports = {m.port: m.name for m in ordered}
        resolve = port_resolver(ports)
        views: list[MemberView] = []
        seen: dict[str, Observation] = {}
        for member in ordered:
            status = statuses.get(member.name)
            views.append(
                member_view(
                    member.name,
                    member.ordinal,
                    status,
                    resolve_upstream=resolve,
                    process_gone=not alive[member.name],
                )
            )
            seen[member.name] = observation(status)
            if status is not None:
                self._remember(member, status)
        self._observed = seen
        return views, seen

    def _remember(self, member: MemberState, status: Status) -> None:
        """What the status file shows (fenced, revision), and the end of the member's seeding."""
        changed = False
        if status.revision is not None and status.revision != member.revision:
            member.revision, changed = status.revision, True
        if status.fenced != member.fenced or status.demoted != member.demoted:
            member.fenced, member.demoted, changed = status.fenced, status.demoted, True
        if member.seed and status.data_present and status.action is None:
            member.seed, changed = [], True  # seeded: a restarted pod never seeds again on its own
        if changed:
            member.save(self.paths)

    # --- the engine's actions ---------------------------------------------------------------------------
    def _do_CreateMember(self, action: act.CreateMember, spec: PostgresClusterSpec) -> None:
        name = action.member
        if name in self.members and self.pods.running(name):
            return
        member = self.members.get(name) or MemberState(
            name, action.ordinal, self.state.port_of(action.ordinal)
        )
        member.wanted, member.revision, member.restart_at = True, action.revision, None
        pgdata = self.paths.member_data(name)
        seed: list[str] = []
        if not pgdata.exists() or is_empty(pgdata):
            if action.seed is act.Seed.INITDB:
                seed = ["--seed", "initdb"]
            elif action.seed is act.Seed.BASEBACKUP:
                seed = [
                    "--seed",
                    "basebackup",
                    "--upstream",
                    self._address(action.source or action.upstream or ""),
                ]
            else:
                seed = ["--seed", "snapshot", "--snapshot", self._snapshot_id(action.source, None)]
                if action.upstream:
                    seed += ["--upstream", self._address(action.upstream)]
                elif action.target:
                    seed += ["--recovery-target", action.target]
        member.seed = seed
        self.members[name] = member
        self.paths.member_dir(name).mkdir(parents=True, exist_ok=True)
        member.save(self.paths)
        self._start_pod(member, spec)

    def _do_DeleteMember(self, action: act.DeleteMember, spec: PostgresClusterSpec) -> None:
        member = self.members.get(action.member)
        if member is None or self.busy(action.member):
            return
        member.wanted = False
        member.save(self.paths)
        self.pods.stop(action.member)
        del self.members[action.member]
        if self.rw_member == action.member:
            self._point_rw_endpoint(None)
        if not action.keep_data:
            shutil.rmtree(self.paths.member_dir(action.member), ignore_errors=True)

    def _do_RestartMember(self, action: act.RestartMember, spec: PostgresClusterSpec) -> None:
        name = action.member
        member = self.members.get(name)
        status = self._statuses.get(name)
        if member is None or self.busy(name) or (status is not None and status.fenced):
            return
        self._write_parameters(name, spec)  # the new revision's parameters, read at the restart
        client = self._client(name)

        def restart() -> None:
            client.restart(action.revision, primary=action.primary, reason=action.reason)
            member.revision = action.revision
            member.save(self.paths)

        self._spawn(name, "rolling restart of", restart)

    def _do_Fence(self, action: act.Fence, spec: PostgresClusterSpec) -> None:
        """Out of the rw endpoint, then the agent stops PostgreSQL and keeps it stopped. An agent that
        runs but does not answer is killed with its PostgreSQL, as a pod is deleted."""
        name = action.member
        if name not in self.members:
            return
        if self.rw_member == name:
            self._point_rw_endpoint(None)
        if not self.pods.running(name):
            return  # a lost pod: nothing runs; its agent will not start PostgreSQL read-write on its own
        try:
            result = self._client(name).act(FenceRequest(reason=action.reason), timeout=FENCE_TIMEOUT)
        except AgentUnreachable as exc:
            log.warning("fencing %s: its agent does not answer (%s): killing its pod", name, exc)
            self.pods.kill(name)
            return
        if result.changed:
            log.info("fenced %s (%s): %s", name, action.reason, result.detail)

    def _do_Demote(self, action: act.Demote, spec: PostgresClusterSpec) -> None:
        name = action.member
        if name not in self.members or self.busy(name) or not self.pods.running(name):
            return
        client = self._client(name)
        self._spawn(
            name, "read-only start of", lambda: _log_result(name, client.demote(reason=action.reason))
        )

    def _do_Unfence(self, action: act.Unfence, spec: PostgresClusterSpec) -> None:
        name = action.member
        if name not in self.members or self.busy(name) or not self.pods.running(name):
            return
        client = self._client(name)
        # Read-write only for the recorded primary (a switchover abandoned before any promotion).
        primary = name == self.current_primary
        self._spawn(
            name, "unfence", lambda: _log_result(name, client.unfence(primary=primary, reason=action.reason))
        )

    def _do_Promote(self, action: act.Promote, spec: PostgresClusterSpec) -> None:
        name = action.member
        if name not in self.members or self.busy(name):
            return
        result = self._client(name).promote(reason=action.reason)
        if result.changed:
            log.info("promoted %s (%s)", name, action.reason)
            self._follow_early(name)

    def _follow_early(self, promoted: str) -> None:
        """Point the replicas that lost their upstream at the member just promoted (one rejoin each, in
        its worker): their reconnection overlaps the engine's next observation, and in quorum mode the
        first commit on the new primary waits for one of them. A replica holding more WAL than the
        promoted member is left to the engine (it needs a rewind), and so is any fenced or busy one."""
        target = self._statuses.get(promoted)
        target_lsn = lsn_value(target.held_lsn) if target is not None else None
        if target_lsn is None:
            return
        upstream = self._address(promoted)
        for name, status in self._statuses.items():
            held = lsn_value(status.held_lsn) if status is not None else None
            if (
                name == promoted
                or status is None
                or name not in self.members
                or status.fenced
                or self.busy(name)
                or status.role != "replica"
                or status.streaming
                or held is None
                or held > target_lsn
            ):
                continue
            client = self._client(name)
            self._spawn(
                name,
                "early follow of",
                lambda c=client, n=name: _log_result(
                    n, c.rejoin(upstream, reason="follow the promoted member")
                ),  # type: ignore[misc]
            )

    def _do_SetSynchronousStandbys(
        self, action: act.SetSynchronousStandbys, spec: PostgresClusterSpec
    ) -> None:
        if action.member not in self.members or self.busy(action.member):
            return
        value = action.config.render()
        status = self._statuses.get(action.member)
        if status is not None and status.synchronous_standby_names == value:
            return  # in force: the engine repeats a step until it observes it
        self._client(action.member).set_sync(value, reason=action.reason)
        log.info("synchronous_standby_names on %s = %r", action.member, value)

    def _do_Rejoin(self, action: act.Rejoin, spec: PostgresClusterSpec) -> None:
        name = action.member
        if name not in self.members or action.upstream not in self.members or self.busy(name):
            return
        if name == action.upstream:
            log.error("refusing to rejoin %s to itself (%s)", name, action.reason)
            return
        if not self.pods.running(name):
            return  # its pod is being restarted: the engine asks again
        client = self._client(name)
        upstream = self._address(action.upstream)
        self._spawn(
            name,
            "rejoin",
            lambda: _log_result(name, client.rejoin(upstream, reclone=action.reclone, reason=action.reason)),
        )

    def _do_DropReplicationSlot(self, action: act.DropReplicationSlot, spec: PostgresClusterSpec) -> None:
        if action.member not in self.members:
            return
        with contextlib.suppress(AgentError):  # refused while a standby uses it: asked again
            self._client(action.member).drop_slot(action.slot.replace("-", "_"), reason=action.reason)

    # --- restore: one agent action, followed in its /status ------------------------------------------
    def _do_StartRestore(self, action: act.StartRestore, spec: PostgresClusterSpec) -> None:
        """Ask the member's agent to restore in place (it answers at once; the restore goes on there).
        The job is recorded once the agent took the order: its state is the agent's (see _restore_view);
        asked again under the same name the agent answers that restore's state, never starts another."""
        name = action.member
        job = self.jobs.job(JobKind.RESTORE, action.restore)
        if name not in self.members or (job.folder / "job.json").exists() or self.busy(name):
            return
        try:
            snapshot = self._snapshot_id(action.backup, action.snapshot_id)
        except ValueError as exc:
            self.jobs.fail(JobKind.RESTORE, action.restore, str(exc), member=name)
            return
        if not self.pods.running(name):
            return  # its pod is being restarted: the engine asks again
        started_at = time.time()
        try:
            result = self._client(name).restore(
                snapshot, action.target, request_id=action.restore, reason=action.reason
            )
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

    def _job_views(self, seen: dict[str, Observation]) -> list[JobView]:
        return [
            self.jobs.view(job) if job.kind is JobKind.SNAPSHOT else self._restore_view(job)
            for job in self.jobs.all()
        ]

    def _restore_view(self, job: Job) -> JobView:
        """A restore as its agent tells it: in progress (its stage), or how it ended (lastAction)."""
        member = job.meta.get("member")
        if job.rc is not None or not member:
            return self.jobs.view(job)  # failed before it reached the agent
        status = self._statuses.get(member)
        stage = self._restore_stages.get(job.name, "restoring")
        if status is None:  # no answer now: as it was last seen
            return JobView(JobKind.RESTORE, job.name, JobState.RUNNING, member, stage)
        progress = status.action_progress
        if status.action == "restore" and progress is not None and progress.request_id == job.name:
            stage = self._restore_stages[job.name] = progress.stage or stage
            return JobView(JobKind.RESTORE, job.name, JobState.RUNNING, member, stage)
        last = status.last_action
        if last is not None and last.name == "restore" and last.request_id == job.name:
            if last.ok:
                return JobView(
                    JobKind.RESTORE, job.name, JobState.SUCCEEDED, member, "replaying", timeline=last.timeline
                )
            return JobView(JobKind.RESTORE, job.name, JobState.FAILED, member, stage, last.error or "failed")
        return JobView(
            JobKind.RESTORE,
            job.name,
            JobState.FAILED,
            member,
            stage,
            f"the agent of {member} has no record of restore {job.name} (was its volume lost?)",
        )

    def advance_restores(self, spec: PostgresClusterSpec) -> None:
        """Restore.status.progress (bytes written of the snapshot's size) and the snapshot it resolved,
        from the agent's actionProgress."""
        for job in self.jobs.all():
            member = job.meta.get("member")
            if job.kind is not JobKind.RESTORE or job.rc is not None or not member:
                continue
            status = self._statuses.get(member)
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

    def kept_aside_since(self, since: float) -> list[str]:
        """Data directories kept aside since `since` on every member's volume: by a restore (here) or
        by the agents' re-clones (named by the same UTC stamp)."""
        found: list[str] = []
        if not self.paths.members.is_dir():
            return found
        for kept in sorted(self.paths.members.glob("*/kept/*")):
            try:
                at = datetime.strptime(kept.name, "%Y%m%dT%H%M%S%fZ").replace(tzinfo=UTC).timestamp()
            except ValueError:
                continue
            if at >= since:
                found.append(str(kept))
        return found

    def stop_all(self) -> None:
        for name in list(self.members):
            self.pods.stop(name)


def _log_result(name: str, result: ActionResult) -> None:
    if result.changed:
        log.info("%s: %s", name, result.detail)
