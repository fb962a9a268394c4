"""The local platform: what Kubernetes does for the operator, on this machine.

Every member is its own `pgherd instance run` process (its pod, pods.py) on 127.0.0.1, and the
supervisor acts on a member only through its agent's API (AgentClient), as the Kubernetes adapter
does: PostgreSQL itself is the agent's (seeding, starts and stops, crashes restarted read-only, fences,
rewinds, restores). What is done here is the platform's work:

- the kubelet's part: start a member's pod with its flags and parameters (a new one's agent waits with
  an empty volume for the actuator's seed), start a dead one again after ``restart_delay``, kill one
  whose liveness probe fails, stop or delete one;
- observation: every agent's /status at once, mapped to MemberView by ``pgherd.agentview`` (the one
  mapping the Kubernetes adapter uses too);
- the engine's member actions: the agent calls, their guards and what is told of them are the
  actuator's (pgherd/actuator.py, shared with Kubernetes; local/acting.py is this platform's side), run
  in the tick, the slow ones (seeds, Rejoin, Demote, Unfence, upgrades, RestartMember) in the member's
  worker thread, so that observation and failover never wait for them; an action for a busy member is
  skipped and the engine re-issues it;
- the rw endpoint (the member the last SetPrimary named, as a pod label), events, and the backups and
  restores (backups.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime

from pgherd import actuator
from pgherd.agentview import fetch_statuses, member_view, port_resolver
from pgherd.api.annotations import restart_request, upgrade_requests
from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import actions as act
from pgherd.engine.view import ClusterView, MemberView
from pgherd.local.acting import SandboxMembers
from pgherd.local.backups import Backups
from pgherd.local.dsns import SandboxDsns
from pgherd.local.jobs import LocalJobs, agent_executable
from pgherd.local.layout import SandboxPaths, read_json, write_json
from pgherd.local.objects import ObjectStore, now_iso
from pgherd.local.observe import Observation, observation
from pgherd.local.pods import Credentials, Pods
from pgherd.local.state import MemberState, SandboxState, binaries_missing
from pgherd_backup.agent.client import AgentClient, AgentError
from pgherd_backup.agent.isolation import IsolationOrder
from pgherd_backup.agent.wire import Status
from pgherd_backup.postgres import parameters as user_parameters
from pgherd_backup.postgres.config import Setting
from pgherd_backup.postgres.process import grant_traverse
from pgherd_backup.postgres.seed import is_empty

log = logging.getLogger("pgherd.sandbox")

# The kubelet's liveness probe: a pod whose /healthz fails this many times in a row, this far apart,
# is killed (then restarted after the restart delay). An agent whose PostgreSQL should run and does not
# (its first start failed) says so there and waits for exactly this.
LIVENESS_PERIOD = 2.0
LIVENESS_FAILURES = 3

# Settings that make a local member fail over and catch up quickly (the spec's parameters win).
FAST_SETTINGS: dict[str, Setting] = {
    "archive_timeout": "60s",
    "checkpoint_timeout": "5min",
    "max_wal_size": "256MB",
    "shared_buffers": "32MB",
    "max_connections": "60",
    "fsync": "on",
    "log_line_prefix": "%m [%p] %q%a ",
}


class LocalPlatform:
    def __init__(self, paths: SandboxPaths, state: SandboxState, objects: ObjectStore) -> None:
        if state.members != "agent" or state.agent_base_port is None:
            raise RuntimeError(
                f"the sandbox in {paths.root} runs its members inline, a mode that was removed: remove it "
                f"(`pgherd sandbox down --dir {paths.root}`) and create it again"
            )
        self.paths = paths
        self.state = state
        self.objects = objects
        missing = binaries_missing(state)
        if missing is not None:
            raise RuntimeError(missing)
        # archive_command and restore_command run as the postgres account: it must reach the venv's
        # interpreter (often under /root/.pyenv) and the sandbox directory; PostgreSQL, its programs
        # (a fetched major's live in the user's cache).
        grant_traverse(agent_executable(), sys.executable, paths.root, *filter(None, [state.pg_bindir]))
        self.jobs = LocalJobs(paths)
        self.credentials = Credentials(paths, state)
        self.credentials.ensure()
        self.pods = Pods(paths, state, self.credentials)
        self.dsns = SandboxDsns(paths, state, self.credentials)
        self.backups = Backups(paths, state, objects, self.jobs, self)
        self.members: dict[str, MemberState] = {}
        self.current_primary: str | None = None
        self.isolation: IsolationOrder | None = None  # sent with every /status (agent/isolation.py)
        self.rw_member: str | None = (read_json(paths.rw_endpoint, {}) or {}).get("member")
        self._statuses: dict[str, Status | None] = {}
        self._workers: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self._liveness_due = 0.0
        self._liveness_failures: dict[str, int] = {}
        self._load_members()

    def _load_members(self) -> None:
        if not self.paths.members.is_dir():
            return
        for folder in sorted(self.paths.members.iterdir()):
            member = MemberState.load(self.paths, folder.name)
            if member is not None and member.wanted:
                self.members[member.name] = member

    # --- names, addresses, DSNs ------------------------------------------------------------------------
    def superuser_dsn(self, name: str, dbname: str = "postgres") -> str:
        return self.dsns.superuser([(name, self._port(name))], dbname)

    def replication_dsn(self, name: str) -> str:
        return self.dsns.replication(self._port(name))

    def app_dsn(self, name: str) -> str:
        return self.dsns.app([self._port(name)])

    def rw_dsn(self) -> str:
        ports = sorted(m.port for m in self.members.values()) or [self.state.base_port]
        return self.dsns.app(ports, target_session_attrs="read-write")

    def _port(self, name: str) -> int:
        member = self.members.get(name)
        return member.port if member is not None else self.state.port_of(int(name.rsplit("-", 1)[1]))

    def address(self, name: str) -> str:
        """A member's PostgreSQL as its agents name an upstream (host:port)."""
        return f"127.0.0.1:{self._port(name)}"

    def agent_url(self, name: str) -> str | None:
        member = self.members.get(name)
        return None if member is None else self.pods.url(member.ordinal)

    def metrics_url(self, name: str) -> str | None:
        member = self.members.get(name)
        return None if member is None else self.pods.metrics_url(member.ordinal)

    # --- what backups.py needs of the members (backups.Members) ----------------------------------------
    def has(self, name: str) -> bool:
        return name in self.members

    def pod_running(self, name: str) -> bool:
        return self.pods.running(name)

    def client(self, name: str) -> AgentClient:
        return self.pods.client(name, self.members[name].ordinal)

    def status(self, name: str) -> Status | None:
        """The member's /status as last observed (None: no answer)."""
        return self._statuses.get(name)

    def observed_statuses(self) -> dict[str, Status | None]:
        """The last observation's /status of each member it asked (None: no answer)."""
        return dict(self._statuses)

    # --- the members' workers -----------------------------------------------------------------------------
    def busy(self, name: str) -> bool:
        worker = self._workers.get(name)
        return worker is not None and worker.is_alive()

    def spawn(self, name: str, what: str, work: Callable[[], None]) -> bool:
        """Run a slow agent call for one member in its worker; False when the member is busy already."""
        with self._lock:
            if self.busy(name):
                return False

            def run() -> None:
                try:
                    work()
                except Exception as exc:
                    log.error("%s %s failed: %s", what, name, exc)
                    member = self.members.get(name)
                    if member is not None:
                        member.notes = [*member.notes[-4:], f"{now_iso()} {what} failed: {exc}"]
                        member.save(self.paths)

            thread = threading.Thread(target=run, name=f"{what}-{name}", daemon=True)
            self._workers[name] = thread
            thread.start()
            log.info("%s %s", what, name)
            return True

    # --- the kubelet's part ---------------------------------------------------------------------------
    def write_parameters(self, name: str, spec: PostgresClusterSpec) -> None:
        """The member's PostgreSQL parameters, read again by its agent at every start."""
        timing = user_parameters.replication_timing(spec.failover.detection_seconds)
        text = user_parameters.render({**timing, **FAST_SETTINGS, **(spec.parameters or {})})
        path = self.pods.parameters_file(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    def held(self, name: str) -> bool:
        """Its pod may not start (`sandbox kill --keep-down`): as a pod no node can take."""
        return self.paths.member_held(name).exists()

    def _start_pod(self, member: MemberState, spec: PostgresClusterSpec | None = None) -> None:
        if self.held(member.name):
            return
        if spec is not None:
            self.write_parameters(member.name, spec)
        pid = self.pods.start(member.name, member.ordinal, member.revision, self.state.s3.env())
        log.info("started the agent of %s (pid %d)", member.name, pid)

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
            if now >= member.restart_at and not self.held(name):
                member.restart_at = None
                member.restarts += 1
                member.save(self.paths)
                self._start_pod(member, spec)

    def rotate_certificates(self, request: str | None, spec: PostgresClusterSpec) -> None:
        """New certificates, as on Kubernetes: for a value of pgherd.io/rotate-certificates not seen
        before, once two thirds of their lifetime have passed, or for a shorter certificateLifetime."""
        why = self.credentials.renew(request, spec.tls.lifetime, datetime.now(UTC))
        if why is not None:
            self.record_event(
                act.RecordEvent(
                    "CertificatesRenewed",
                    f"issued the members' and the replication certificates again: {why}",
                )
            )

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
                code = self.client(name).probe("healthz", timeout=1.0)
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

    def advance_restores(self, spec: PostgresClusterSpec) -> None:
        self.backups.advance_restores()

    def advance_verifications(self) -> None:
        self.backups.advance_verifications()

    def advance_retention(self) -> None:
        self.backups.advance_retention()

    def kept_aside_since(self, since: float) -> list[str]:
        return self.backups.kept_aside_since(since)

    def stop_all(self) -> None:
        for name in list(self.members):
            self.pods.stop(name)

    # --- observation ------------------------------------------------------------------------------------
    def observe_members(self) -> tuple[list[MemberView], dict[str, Observation]]:
        ordered = sorted(self.members.values(), key=lambda m: m.ordinal)
        alive = {m.name: self.pods.running(m.name) for m in ordered}
        statuses = fetch_statuses(
            {m.name: self.client(m.name) for m in ordered if alive[m.name]}, isolation=self.isolation
        )
        self._statuses = statuses
        resolve = port_resolver({m.port: m.name for m in ordered})
        views: list[MemberView] = []
        seen: dict[str, Observation] = {}
        for member in ordered:
            status = statuses.get(member.name)
            view = member_view(
                member.name,
                member.ordinal,
                status,
                resolve_upstream=resolve,
                process_gone=not alive[member.name],
            )
            if not alive[member.name] and self._volume_lost(member.name):
                view = replace(view, data_present=False)  # the platform sees its volume gone
            if self.busy(member.name):
                view = replace(view, busy=True)  # sent, perhaps not begun by its agent yet
            views.append(view)
            seen[member.name] = observation(status)
            if status is not None:
                self._remember(member, status)
        return views, seen

    def _volume_lost(self, name: str) -> bool:
        """The member's data directory is gone or empty (a lost volume), seen while its pod is down."""
        pgdata = self.paths.member_data(name)
        return not pgdata.exists() or is_empty(pgdata)

    def _remember(self, member: MemberState, status: Status) -> None:
        """What the status file shows (fenced, revision)."""
        changed = False
        if status.revision is not None and status.revision != member.revision:
            member.revision, changed = status.revision, True
        if status.fenced != member.fenced or status.demoted != member.demoted:
            member.fenced, member.demoted, changed = status.fenced, status.demoted, True
        if changed:
            member.save(self.paths)

    def view(
        self, spec: PostgresClusterSpec, switchover_to: str | None
    ) -> tuple[ClusterView, dict[str, Observation]]:
        members, seen = self.observe_members()
        cluster = self.objects.cluster()
        primary_obs = next((seen[m.name] for m in members if m.is_primary), None)
        view = ClusterView(
            cluster=self.state.cluster,
            now=datetime.now(UTC),
            members=tuple(members),
            backups=tuple(self.backups.backup_views()),
            restores=tuple(self.backups.restore_views()),
            jobs=tuple(self.backups.job_views()),
            archiving_healthy=primary_obs.archiving_healthy if primary_obs else None,
            archiving_error=primary_obs.archive_error if primary_obs else None,
            generation=int(cluster["metadata"].get("generation", 1)),
            switchover_to=switchover_to,
            rw_member=self.rw_member,
            restart=restart_request(cluster["metadata"]),
            **upgrade_requests(cluster["metadata"]),
        )
        return view, seen

    # --- the engine's actions -----------------------------------------------------------------------
    def apply(self, action: act.Action, spec: PostgresClusterSpec) -> None:
        """The engine's action: a member's here, a backup's or restore's in backups.py."""
        if actuator.handles(action):
            asyncio.run(actuator.apply(SandboxMembers(self, spec), action))
            return
        name = f"_do_{type(action).__name__}"
        handler = getattr(self, name, None) or getattr(self.backups, name)
        handler(action, spec)

    def add_member(self, action: act.CreateMember, spec: PostgresClusterSpec) -> bool:
        """A new pod for the member: its record, and its agent started as any pod is, with no seed (it
        waits with an empty volume for the actuator's seed, and starts on the data it finds on a volume
        kept from before). False when the member is there already (a dead pod is keep_running's)."""
        name = action.member
        if name in self.members:
            return False
        member = MemberState(
            name, action.ordinal, self.state.port_of(action.ordinal), revision=action.revision
        )
        self.members[name] = member
        self.paths.member_dir(name).mkdir(parents=True, exist_ok=True)
        member.save(self.paths)
        self._start_pod(member, spec)
        return True

    def _do_DeleteMember(self, action: act.DeleteMember, spec: PostgresClusterSpec) -> None:
        """Delete the pod (SIGTERM: a clean shutdown), and its volume unless ``keep_data``."""
        member = self.members.get(action.member)
        if member is None or self.busy(action.member):
            return
        member.wanted = False
        member.save(self.paths)
        self.pods.stop(action.member)
        del self.members[action.member]
        if self.rw_member == action.member:
            self.point_rw_endpoint(None)
        if not action.keep_data:
            shutil.rmtree(self.paths.member_dir(action.member), ignore_errors=True)

    def record_event(self, event: act.RecordEvent) -> None:
        """An Event: a line of the sandbox's events log."""
        kind = "Warning" if event.warning else "Normal"
        line = f"{now_iso()} {kind} {event.reason}: {event.message}\n"
        with self.paths.events_log.open("a") as handle:
            handle.write(line)
        log.info("event %s %s: %s", kind, event.reason, event.message)

    def point_rw_endpoint(self, member: str | None) -> None:
        if self.rw_member != member or not self.paths.rw_endpoint.exists():
            write_json(self.paths.rw_endpoint, {"member": member})
        self.rw_member = member
