"""The local platform: members as PostgreSQL processes on 127.0.0.1, one port each.

It plays the part Kubernetes plays for the kube adapter: it keeps members running (a member whose
PostgreSQL dies is started again after ``restart_delay``, as the kubelet restarts a container), runs
its instance entrypoint (seed an empty data directory from the primary, bring an old primary back as a
standby), and carries out the engine's actions. It never decides a role: a member starts read-write
only on the engine's explicit order (Promote, RestartMember with ``primary``, Unfence of the primary
whose switchover was abandoned, a restore); a crashed member always comes back read-only, the
recorded primary included.

A fenced member is stopped at once, whatever its worker is doing, and stays stopped: no worker starts
it unless its order came after the last Fence (Demote starts it read-only, Rejoin as a standby).

Slow steps (seeding, rewinding, restarting) run in one worker thread per member so that observation
and failover never wait for them; an action for a busy member is skipped and the engine re-issues it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import actions as act
from pgherd.engine.view import (
    BackupView,
    ClusterView,
    JobKind,
    JobState,
    JobView,
    MemberView,
    RestoreView,
    Role,
    member_name,
)
from pgherd.local.jobs import LocalJobs, agent_executable
from pgherd.local.layout import SandboxPaths, read_json, write_json
from pgherd.local.objects import ObjectStore, now_iso
from pgherd.local.observe import Observation, observe
from pgherd.local.state import MemberState, SandboxState
from pgherd_backup.postgres import postmaster
from pgherd_backup.postgres.binaries import PgBinaries
from pgherd_backup.postgres.config import (
    Setting,
    archive_command,
    clear_standby_config,
    member_settings,
    restore_command,
    update_pgherd_conf,
    write_standby_config,
)
from pgherd_backup.postgres.process import give_to_pg, grant_traverse, make_pg_dir
from pgherd_backup.postgres.rewind import rejoin_as_standby
from pgherd_backup.postgres.seed import basebackup_seed, initdb, is_empty
from pgherd_backup.postgres.walend import WalEndReader

log = logging.getLogger("pgherd.sandbox")

# How long a running replica may take to follow a new primary on its own before a Rejoin rewinds it.
REJOIN_GRACE = 6.0

# Settings that make a local member fail over and catch up quickly.
_FAST_SETTINGS: dict[str, Setting] = {
    "wal_retrieve_retry_interval": "500ms",
    "wal_receiver_status_interval": "1s",
    "wal_receiver_timeout": "10s",
    "wal_sender_timeout": "10s",
    "archive_timeout": "60s",
    "checkpoint_timeout": "5min",
    "max_wal_size": "256MB",
    "shared_buffers": "32MB",
    "max_connections": "60",
    "fsync": "on",
    "log_line_prefix": "%m [%p] %q%a ",
}


@dataclass(frozen=True)
class _WalHeld:
    timeline: int | None
    held_lsn: int | None
    shutdown_clean: bool | None


class FencedError(RuntimeError):
    """A worker may not start a member fenced after its order was given: the newer order wins."""


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class LocalPlatform:
    def __init__(self, paths: SandboxPaths, state: SandboxState, objects: ObjectStore) -> None:
        self.paths = paths
        self.state = state
        self.objects = objects
        self.bins = PgBinaries.find(state.pg_bindir)
        self.agent = agent_executable()
        # archive_command and restore_command run as the postgres account: it must reach the venv's
        # interpreter (often under /root/.pyenv) and the sandbox directory.
        grant_traverse(self.agent, sys.executable, paths.root)
        self.jobs = LocalJobs(paths)
        self.members: dict[str, MemberState] = {}
        self.current_primary: str | None = None
        self._workers: dict[str, threading.Thread] = {}
        self._rejoin_asked: dict[str, float] = {}
        self._repointed: dict[str, str] = {}
        self._observed: dict[str, Observation] = {}
        # Each Fence bumps its member's epoch; a worker may start a fenced member only under the epoch
        # its order was given in (Demote, Rejoin), never under a later Fence.
        self._fence_epochs: dict[str, int] = {}
        self._start_epochs: dict[str, int | None] = {}
        self.wal = WalEndReader(self.bins)
        self._lock = threading.Lock()
        self.rw_member: str | None = (read_json(paths.rw_endpoint, {}) or {}).get("member")
        self._load_members()

    # --- names, DSNs, environment -------------------------------------------------------------------
    def _load_members(self) -> None:
        if not self.paths.members.is_dir():
            return
        for folder in sorted(self.paths.members.iterdir()):
            member = MemberState.load(self.paths, folder.name)
            if member is not None and member.wanted:
                self.members[member.name] = member

    def _dsn(self, ports: list[int], *, user: str, password: str, dbname: str, **extra: str) -> str:
        parts = {
            "host": ",".join("127.0.0.1" for _ in ports),
            "port": ",".join(str(p) for p in ports),
            "user": user,
            "password": password,
            "dbname": dbname,
            "connect_timeout": "2",
            **extra,
        }
        return " ".join(f"{key}={_quote(value)}" for key, value in parts.items())

    def superuser_dsn(self, name: str, dbname: str = "postgres") -> str:
        return self._dsn(
            [self.members[name].port], user="postgres", password=self.state.superuser_password, dbname=dbname
        )

    def agent_url(self, name: str) -> str | None:
        """The member's agent (agent mode only; inline members have none)."""
        return None

    def app_dsn(self, name: str) -> str:
        port = self.members[name].port if name in self.members else self._port(name)
        return self._dsn(
            [port], user=self.state.app_user, password=self.state.app_password, dbname=self.state.app_database
        )

    def _all_ports(self) -> list[int]:
        # Every ordinal the cluster may use: a replica's conninfo then never needs rewriting on scale-up.
        return [self.state.port_of(i) for i in range(16)]

    def rw_dsn(self) -> str:
        ports = sorted(m.port for m in self.members.values()) or [self.state.base_port]
        return self._dsn(
            ports,
            user=self.state.app_user,
            password=self.state.app_password,
            dbname=self.state.app_database,
            target_session_attrs="read-write",
        )

    def replica_conninfo(self, name: str, upstream: str) -> str:
        """primary_conninfo of a replica: exactly its upstream. (PostgreSQL's walreceiver does not fall
        through a multi-host list the way libpq clients do, so a replica is re-pointed explicitly by a
        Rejoin, as on Kubernetes it follows the -rw Service.)"""
        return self._dsn(
            [self._port(upstream)],
            user="postgres",
            password=self.state.superuser_password,
            dbname="postgres",
            application_name=name,
        )

    def _port(self, name: str) -> int:
        return self.state.port_of(int(name.rsplit("-", 1)[1]))

    def store_env(self) -> dict[str, str]:
        return {
            **self.state.s3.env(),
            "PGHERD_STORE": self.state.store_url,
            "PGHERD_CLUSTER": self.state.cluster,
        }

    def pg_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.store_env())
        env["PATH"] = f"{Path(self.agent).parent}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    def settings(self, name: str, spec: PostgresClusterSpec) -> dict[str, Setting]:
        archiving = spec.backup is not None and spec.backup.archiving_enabled
        extra: dict[str, Setting] = {**_FAST_SETTINGS, **(spec.parameters or {})}
        extra["cluster_name"] = name
        return member_settings(
            self._port(name),
            socket_dir="",
            archive_command=archive_command(self.agent) if archiving else None,
            wal_keep_size="256MB",
            extra=extra,
        )

    def restore_command(self) -> str:
        return restore_command(self.agent, wal_service=str(self.paths.wal_socket))

    # --- the kubelet's part -----------------------------------------------------------------------
    def busy(self, name: str) -> bool:
        worker = self._workers.get(name)
        return worker is not None and worker.is_alive()

    def _spawn(
        self, name: str, what: str, work: Callable[[], None], *, fenced_epoch: int | None = None
    ) -> bool:
        """Run slow work for one member in its worker; False when the member is busy already.

        ``fenced_epoch``: the fence epoch the order was given in, for work allowed to start the member
        although fenced (Demote, Rejoin); a later Fence takes that right away (see may_start).
        """
        with self._lock:
            if self.busy(name):
                return False

            def run() -> None:
                try:
                    work()
                except FencedError as exc:
                    log.info("%s %s stopped: %s", what, name, exc)
                except Exception as exc:
                    log.error("%s %s failed: %s", what, name, exc)
                    member = self.members.get(name)
                    if member is not None:
                        member.notes = [*member.notes[-4:], f"{now_iso()} {what} failed: {exc}"]
                        member.restart_at = time.time() + self.state.restart_delay
                        member.save(self.paths)

            thread = threading.Thread(target=run, name=f"{what}-{name}", daemon=True)
            self._workers[name] = thread
            self._start_epochs[name] = fenced_epoch
            thread.start()
            log.info("%s %s", what, name)
            return True

    def _fence_epoch(self, name: str) -> int:
        return self._fence_epochs.get(name, 0)

    def may_start(self, name: str) -> bool:
        """Whether a worker in flight may still start PostgreSQL on the member."""
        if not self.busy(name):
            return False
        member = self.members.get(name)
        if member is None or not member.fenced:
            return True
        return self._start_epochs.get(name) == self._fence_epoch(name)

    def _refuse_if_fenced(self, name: str, fenced_epoch: int | None) -> None:
        member = self.members[name]
        if member.fenced and (fenced_epoch is None or fenced_epoch != self._fence_epoch(name)):
            raise FencedError(f"{name} is fenced: not starting it")

    def running(self, name: str) -> bool:
        return postmaster.is_running(self.paths.member_data(name))

    def keep_running(self, spec: PostgresClusterSpec) -> None:
        """Restart dead members after the restart delay, through the instance entrypoint; keep fenced
        members stopped."""
        now = time.time()
        for name, member in list(self.members.items()):
            running = self.running(name)
            if running and member.restart_at is not None:
                member.restart_at = None
                member.save(self.paths)
            if member.fenced:
                if running and not member.demoted and not self.busy(name):
                    log.warning("%s is fenced but running: stopping it", name)
                    self._stop(name, fast_timeout=5)
                continue
            if not member.wanted or self.busy(name) or running:
                continue
            if member.restart_at is None:
                member.restart_at = now + self.state.restart_delay
                member.save(self.paths)
                log.info("%s is down: restarting it in %.0fs", name, self.state.restart_delay)
                continue
            if now >= member.restart_at:
                epoch = self._fence_epoch(name)
                self._spawn(name, "restart", lambda n=name, e=epoch: self._entrypoint(n, spec, e))  # type: ignore[misc]

    def _entrypoint(self, name: str, spec: PostgresClusterSpec, epoch: int) -> None:
        """What the instance entrypoint does when a pod starts: an existing data directory always starts
        read-only, following the engine's primary (with no upstream when that is the member itself or
        unknown: the engine promotes it explicitly); an old primary is rewound first when its successor
        answers."""
        member = self.members[name]
        pgdata = self.paths.member_data(name)
        primary = self.current_primary
        if not pgdata.exists() or is_empty(pgdata):
            if primary is None or primary == name or not self._reachable(primary):
                member.restart_at = time.time() + self.state.restart_delay
                member.save(self.paths)
                log.info("%s has no data and no primary to clone: waiting", name)
                return
            self._clone(name, primary, spec)
            self._start(name)
            return
        if (pgdata / "recovery.signal").exists():
            # A restore's targeted recovery, ordered by the engine: it ends with the promotion it was
            # told to make.
            self._start(name)
            return
        upstream = primary if primary is not None and primary != name else None
        was_primary = not (pgdata / "standby.signal").exists()
        if was_primary and upstream is not None and self._reachable(upstream):
            self._rejoin(name, upstream, reclone=False, spec=spec, epoch=epoch)
            return
        self._configure_standby(name, upstream)
        self._start(name)

    def _configure_standby(self, name: str, upstream: str | None) -> None:
        """standby.signal, following ``upstream``; with none, its own WAL only (no primary_conninfo, no
        archive: it cannot wander onto another member's timeline)."""
        pgdata = self.paths.member_data(name)
        if upstream is not None:
            write_standby_config(
                pgdata, self.replica_conninfo(name, upstream), restore_command=self.restore_command()
            )
            return
        write_standby_config(pgdata, "")
        update_pgherd_conf(pgdata, {"restore_command": None, "primary_conninfo": None})

    def _reachable(self, name: str) -> bool:
        return name in self.members and observe(self.superuser_dsn(name)).reachable

    def _start(self, name: str, *, fenced_epoch: int | None = None) -> None:
        """Start PostgreSQL as its data directory says. Refused for a fenced member unless the order
        came after its last Fence (``fenced_epoch``); a Fence that lands during the start stops it."""
        member = self.members[name]
        pgdata = self.paths.member_data(name)
        self._refuse_if_fenced(name, fenced_epoch)
        postmaster.start(
            pgdata, bins=self.bins, log_file=self.paths.member_log(name), env=self.pg_env(), timeout=120
        )
        try:
            self._refuse_if_fenced(name, fenced_epoch)
        except FencedError:
            self._stop(name, fast_timeout=5)
            raise
        member.restart_at = None
        member.restarts += 1
        member.save(self.paths)

    def _stop(self, name: str, *, fast_timeout: float = 15) -> None:
        pgdata = self.paths.member_data(name)
        if not postmaster.is_running(pgdata):
            return
        try:
            postmaster.stop(pgdata, bins=self.bins, mode="fast", timeout=fast_timeout)
        except Exception:
            postmaster.kill(pgdata)

    def _clone(self, name: str, source: str, spec: PostgresClusterSpec) -> None:
        pgdata = self.paths.member_data(name)
        basebackup_seed(
            pgdata,
            self.superuser_dsn(source),
            bins=self.bins,
            settings=self.settings(name, spec),
            primary_conninfo=self.replica_conninfo(name, source),
            restore_command=self.restore_command(),
        )

    def _rejoin(
        self, name: str, upstream: str, *, reclone: bool, spec: PostgresClusterSpec, epoch: int
    ) -> None:
        """Make the member a standby of ``upstream`` (rewind, or re-clone) and start it; its fence is
        lifted only if no Fence came after the order (``epoch``)."""
        member = self.members[name]
        pgdata = self.paths.member_data(name)
        self._stop(name)
        if not pgdata.exists() or is_empty(pgdata):
            self._clone(name, upstream, spec)
        elif reclone:
            kept = self._keep_aside(name)
            log.info("%s: re-cloning from %s, old data kept in %s", name, upstream, kept)
            self._clone(name, upstream, spec)
        else:
            result = rejoin_as_standby(
                pgdata,
                self.superuser_dsn(upstream),
                bins=self.bins,
                primary_conninfo=self.replica_conninfo(name, upstream),
                restore_command=self.restore_command(),
                keep_aside=lambda _pgdata: self._keep_aside(name),
            )
            log.info("%s rejoined %s by %s", name, upstream, result.method)
        update_pgherd_conf(pgdata, dict(self.settings(name, spec)))
        write_standby_config(
            pgdata, self.replica_conninfo(name, upstream), restore_command=self.restore_command()
        )
        with self._lock:
            if self._fence_epoch(name) != epoch:
                raise FencedError(f"fenced while it rejoined {upstream}")
            member.fenced = member.demoted = False
            member.wanted = True
        member.save(self.paths)
        self._start(name)

    def _keep_aside(self, name: str) -> Path:
        """Move a member's data directory aside (never delete it) and record where it went: under the
        sandbox's kept/ folder, which deleting the member does not touch."""
        pgdata = self.paths.member_data(name)
        folder = self.paths.kept_dir(name)
        folder.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
        kept = folder / f"data.aside-{stamp}"
        os.rename(pgdata, kept)
        with self._lock:
            record = read_json(self.paths.root / "kept-aside.json", []) or []
            record.append({"member": name, "path": str(kept), "at": time.time()})
            write_json(self.paths.root / "kept-aside.json", record)
        return kept

    def kept_aside_count(self, name: str) -> int:
        folder = self.paths.kept_dir(name)
        return sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0

    def kept_aside_since(self, since: float) -> list[str]:
        record = read_json(self.paths.root / "kept-aside.json", []) or []
        return [entry["path"] for entry in record if entry["at"] >= since]

    # --- observation --------------------------------------------------------------------------------
    def observe_members(self) -> tuple[list[MemberView], dict[str, Observation]]:
        by_port = {m.port: m.name for m in self.members.values()}
        restoring = self._restoring()
        views: list[MemberView] = []
        seen: dict[str, Observation] = {}
        for name, member in sorted(self.members.items(), key=lambda item: item[1].ordinal):
            pgdata = self.paths.member_data(name)
            busy = self.busy(name)
            running = self.running(name)
            # Stopped: no postmaster on its data directory, and nothing about to start one.
            stopped = not running and not self.may_start(name) and name not in restoring
            obs = observe(self.superuser_dsn(name)) if running and not busy else Observation(False)
            seen[name] = obs
            if obs.receiver_streaming:
                self._rejoin_asked.pop(name, None)
                self._repointed.pop(name, None)
            role = Role.UNKNOWN
            if obs.reachable:
                role = Role.REPLICA if obs.in_recovery else Role.PRIMARY
            wal = self._wal_held(name, obs, stopped)
            received = obs.received_lsn
            if member.fenced and stopped:
                received = wal.held_lsn  # its final WAL end (never pg_control's checkpoint location)
            views.append(
                MemberView(
                    name=name,
                    ordinal=member.ordinal,
                    exists=True,
                    reachable=obs.reachable,
                    role=role,
                    timeline=wal.timeline,
                    received_lsn=received,
                    replayed_lsn=obs.replayed_lsn,
                    wal_receiver_streaming=obs.receiver_streaming,
                    upstream=by_port.get(obs.sender_port) if obs.sender_port else None,
                    ready=obs.reachable,
                    revision=member.revision,
                    data_present=(pgdata / "PG_VERSION").exists() or busy or name in restoring,
                    fenced=member.fenced,
                    sync=obs.sync,
                    stopped=stopped,
                    shutdown_clean=wal.shutdown_clean,
                    held_lsn=wal.held_lsn,
                    kept_aside=self.kept_aside_count(name),
                )
            )
        self._observed = seen
        return views, seen

    def _restoring(self) -> set[str]:
        """Members a restore job is filling, or whose restored data waits to be started."""
        members: set[str] = set()
        for job in self.jobs.all():
            if job.kind is not JobKind.RESTORE:
                continue
            meta = job.meta
            filling = job.rc == 0 or (job.rc is None and job.running)
            if meta.get("member") and not meta.get("started") and filling:
                members.add(str(meta["member"]))
        return members

    def _wal_held(self, name: str, obs: Observation, stopped: bool) -> _WalHeld:
        """The WAL the member provably holds, on which timeline, and how a stopped member shut down."""
        pgdata = self.paths.member_data(name)
        if obs.reachable:
            known = [lsn for lsn in (obs.received_lsn, obs.replayed_lsn) if lsn is not None]
            held = max(known) if known else None
            if obs.in_recovery and not obs.receiver_streaming and obs.timeline is not None:
                # Not streaming (restarted, or its upstream is gone): its received position says little;
                # the valid WAL in its pg_wal says what it has.
                end = self.wal.end(pgdata, obs.timeline)
                if end is not None:
                    held = max(held or 0, end.lsn)
            return _WalHeld(obs.timeline, held, None)
        if stopped and (pgdata / "global" / "pg_control").exists():
            end = self.wal.end(pgdata)
            return _WalHeld(
                end.timeline if end else None, end.lsn if end else None, self.wal.shutdown_clean(pgdata)
            )
        return _WalHeld(None, None, None)

    def view(
        self, spec: PostgresClusterSpec, switchover_to: str | None
    ) -> tuple[ClusterView, dict[str, Observation]]:
        members, seen = self.observe_members()
        cluster = self.objects.cluster()
        primary_obs = next((seen[m.name] for m in members if m.role is Role.PRIMARY), None)
        view = ClusterView(
            cluster=self.state.cluster,
            now=datetime.now(UTC),
            members=tuple(members),
            backups=tuple(self._backup_views()),
            restores=tuple(self._restore_views()),
            jobs=tuple(self._job_views(seen)),
            archiving_healthy=primary_obs.archiving_healthy if primary_obs else None,
            generation=int(cluster["metadata"].get("generation", 1)),
            switchover_to=switchover_to,
            rw_member=self.rw_member,
        )
        return view, seen

    def _backup_views(self) -> list[BackupView]:
        views = []
        for item in self.objects.backups():
            status = item.get("status") or {}
            views.append(
                BackupView(
                    name=item["metadata"]["name"],
                    phase=status.get("phase", "Pending"),
                    target=item["spec"].get("target", "preferStandby"),
                    created_at=_parse_time(item["metadata"].get("creationTimestamp")),
                    completed_at=_parse_time(status.get("completedAt")),
                    backup_id=status.get("backupId"),
                    source_member=status.get("sourceMember"),
                )
            )
        return views

    def _restore_views(self) -> list[RestoreView]:
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
                    created_at=_parse_time(item["metadata"].get("creationTimestamp")),
                )
            )
        return views

    def _job_views(self, seen: dict[str, Observation]) -> list[JobView]:
        views = []
        for job in self.jobs.all():
            if job.kind is JobKind.SNAPSHOT:
                views.append(self.jobs.view(job))
                continue
            member = job.meta.get("member")
            started = bool(job.meta.get("started"))
            obs = seen.get(member) if member else None
            promoted = started and obs is not None and obs.reachable and not obs.in_recovery
            stage = "replaying" if started else "restoring"
            view = self.jobs.view(job, stage=stage, done=promoted)
            if started and view.state is JobState.RUNNING and obs is not None and obs.reachable:
                view = JobView(
                    view.kind,
                    view.name,
                    view.state,
                    view.member,
                    stage,
                    view.message,
                    view.backup_id,
                    obs.timeline,
                )
            views.append(view)
        return views

    # --- the engine's actions -----------------------------------------------------------------------
    def apply(self, action: act.Action, spec: PostgresClusterSpec) -> None:
        handler = getattr(self, f"_do_{type(action).__name__}")
        handler(action, spec)

    def _do_CreateMember(self, action: act.CreateMember, spec: PostgresClusterSpec) -> None:
        name = action.member
        if name in self.members and (self.busy(name) or self.running(name)):
            return
        member = self.members.get(name) or MemberState(
            name, action.ordinal, self.state.port_of(action.ordinal)
        )
        member.wanted, member.fenced, member.demoted, member.revision = True, False, False, action.revision
        self.members[name] = member
        self.paths.member_dir(name).mkdir(parents=True, exist_ok=True)
        member.save(self.paths)

        def create() -> None:
            pgdata = self.paths.member_data(name)
            if not pgdata.exists() or is_empty(pgdata):
                if action.seed is act.Seed.INITDB:
                    self._initdb(name, spec)
                elif action.seed is act.Seed.BASEBACKUP:
                    self._clone(name, action.source or action.upstream or "", spec)
                else:
                    self._seed_from_snapshot(name, action, spec)
            self._start(name)
            if action.seed is act.Seed.INITDB:
                self._create_owner(name, spec)

        self._spawn(name, "create", create)

    def _initdb(self, name: str, spec: PostgresClusterSpec) -> None:
        pgdata = self.paths.member_data(name)
        make_pg_dir(pgdata.parent, mode=0o755)
        initdb(
            pgdata,
            bins=self.bins,
            settings=self.settings(name, spec),
            password=self.state.superuser_password,
            auth_local="trust",
            auth_host="scram-sha-256",
            hba_lines=["host replication all 127.0.0.1/32 scram-sha-256"],
        )

    def _create_owner(self, name: str, spec: PostgresClusterSpec) -> None:
        user, database = self.state.app_user, self.state.app_database
        with psycopg.connect(self.superuser_dsn(name), autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (user,)).fetchone()
            if not exists:
                conn.execute(
                    psycopg.sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                        psycopg.sql.Identifier(user), psycopg.sql.Literal(self.state.app_password)
                    )
                )
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone():
                conn.execute(
                    psycopg.sql.SQL("CREATE DATABASE {} OWNER {}").format(
                        psycopg.sql.Identifier(database), psycopg.sql.Identifier(user)
                    )
                )

    def _snapshot_id(self, backup: str | None, snapshot_id: str | None) -> str:
        if snapshot_id:
            return snapshot_id
        if backup in (None, "latest"):
            return "latest"
        found = self.objects.backup(backup)
        backup_id = ((found or {}).get("status") or {}).get("backupId")
        if not backup_id:
            raise ValueError(f"Backup {backup!r} has no completed snapshot to restore")
        return str(backup_id)

    def _restore_command(self, pgdata: Path, snapshot: str, target: str | None) -> list[str]:
        command = [
            self.agent,
            "restore",
            "--store",
            self.state.store_url,
            "--cluster",
            self.state.cluster,
            "--snapshot",
            snapshot,
            "--pgdata",
            str(pgdata),
        ]
        if target:
            kind, _, value = target.partition(":")
            if kind == "time":
                command += ["--target-time", value]
            elif kind == "lsn":
                command += ["--target-lsn", value]
            elif kind == "immediate":
                command.append("--target-immediate")
        return command

    def _seed_from_snapshot(self, name: str, action: act.CreateMember, spec: PostgresClusterSpec) -> None:
        import subprocess

        pgdata = self.paths.member_data(name)
        snapshot = self._snapshot_id(action.source, None)
        result = subprocess.run(
            self._restore_command(pgdata, snapshot, action.target),
            env=self.pg_env(),
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError((result.stderr.strip().splitlines() or ["restore failed"])[-1])
        update_pgherd_conf(pgdata, dict(self.settings(name, spec)))
        if action.upstream:
            write_standby_config(
                pgdata, self.replica_conninfo(name, action.upstream), restore_command=self.restore_command()
            )
        give_to_pg(pgdata, recursive=True)

    def _do_DeleteMember(self, action: act.DeleteMember, spec: PostgresClusterSpec) -> None:
        member = self.members.get(action.member)
        if member is None or self.busy(action.member):
            return
        self._stop(action.member)
        member.wanted = False
        member.save(self.paths)
        del self.members[action.member]
        if self.rw_member == action.member:
            self._point_rw_endpoint(None)
        if not action.keep_data:
            shutil.rmtree(self.paths.member_dir(action.member), ignore_errors=True)

    def _do_RestartMember(self, action: act.RestartMember, spec: PostgresClusterSpec) -> None:
        """Restart with the new revision's settings: read-only (a standby of the engine's primary, or
        with no upstream when it is that primary), read-write only when the engine says ``primary``."""
        name = action.member
        member = self.members.get(name)
        if member is None or member.fenced:
            return

        def restart() -> None:
            pgdata = self.paths.member_data(name)
            self._stop(name)
            update_pgherd_conf(pgdata, dict(self.settings(name, spec)))
            if action.primary:
                clear_standby_config(pgdata)
            else:
                primary = self.current_primary
                self._configure_standby(name, primary if primary != name else None)
            member.revision = action.revision
            member.save(self.paths)
            self._start(name)

        self._spawn(name, "rolling restart of", restart)

    def _do_Fence(self, action: act.Fence, spec: PostgresClusterSpec) -> None:
        """Stop it now, whatever its worker does: the worker may no longer start it (see _start)."""
        name = action.member
        member = self.members.get(name)
        if member is None:
            return
        with self._lock:
            self._fence_epochs[name] = self._fence_epoch(name) + 1
            newly = not member.fenced
            member.fenced, member.demoted = True, False
        member.save(self.paths)
        if self.rw_member == name:
            self._point_rw_endpoint(None)  # out of the rw endpoint
        if newly:
            log.info("fencing %s (%s)", name, action.reason)
        if self.running(name):
            self._checkpoint_before_stop(name)
            self._stop(name, fast_timeout=5)

    def _checkpoint_before_stop(self, name: str) -> None:
        """A CHECKPOINT while the primary still takes writes, so that the shutdown checkpoint inside the
        write outage of a switchover has almost nothing left to flush. Only for a member that answered the
        last observation: a dead or cut-off one is stopped at once."""
        obs = self._observed.get(name)
        if obs is None or not obs.reachable or obs.in_recovery:
            return
        with (
            contextlib.suppress(psycopg.Error),
            psycopg.connect(self.superuser_dsn(name), autocommit=True, connect_timeout=1) as conn,
        ):
            conn.execute("SET statement_timeout = '10s'")
            conn.execute("CHECKPOINT")

    def _do_Demote(self, action: act.Demote, spec: PostgresClusterSpec) -> None:
        """Start a fenced member read-only with no upstream: its WAL can then be counted and chosen."""
        name = action.member
        member = self.members.get(name)
        pgdata = self.paths.member_data(name)
        if member is None or self.busy(name) or self.running(name) or not (pgdata / "PG_VERSION").exists():
            return
        epoch = self._fence_epoch(name)

        def demote() -> None:
            self._configure_standby(name, None)
            with self._lock:
                if self._fence_epoch(name) != epoch:
                    raise FencedError("fenced again before its read-only start")
                member.demoted = True  # a fenced member that may run (read-only)
            member.save(self.paths)
            self._start(name, fenced_epoch=epoch)

        self._spawn(name, "read-only start of", demote, fenced_epoch=epoch)

    def _do_Unfence(self, action: act.Unfence, spec: PostgresClusterSpec) -> None:
        """Start a fenced member again as it was (a switchover abandoned before any promotion)."""
        name = action.member
        member = self.members.get(name)
        if member is None or self.busy(name):
            return
        with self._lock:
            member.fenced = member.demoted = False
        member.save(self.paths)
        if not self.running(name):
            self._spawn(name, "unfence", lambda: self._start(name))

    def _do_Promote(self, action: act.Promote, spec: PostgresClusterSpec) -> None:
        if action.member not in self.members or self.busy(action.member):
            return
        member = self.members[action.member]
        if member.fenced:
            with self._lock:
                member.fenced = member.demoted = False  # a promoted member is the primary: never fenced
            member.save(self.paths)
        with psycopg.connect(self.superuser_dsn(action.member), autocommit=True, connect_timeout=2) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
            if row and row[0]:
                conn.execute("SELECT pg_promote(false)")  # the next observation confirms it
                log.info("promoted %s (%s)", action.member, action.reason)
                self._follow_early(action.member)

    def _follow_early(self, promoted: str) -> None:
        """Point the replicas that lost their upstream at the member being promoted, while it promotes.

        The engine re-points them (Rejoin) once it observes the promotion; doing it now overlaps their
        reconnection with the promotion, and in quorum mode the first commit on the new primary waits
        for one of them. A replica holding more WAL than the promoted member is left to the engine's
        Rejoin (it needs a rewind), and so is any member that is fenced, busy or not observed.
        """
        target = self._observed.get(promoted)
        if target is None or target.received_lsn is None:
            return
        for name, obs in self._observed.items():
            member = self.members.get(name)
            if (
                name == promoted
                or member is None
                or member.fenced
                or self.busy(name)
                or not (obs.reachable and obs.in_recovery)
                or obs.receiver_streaming
                or obs.received_lsn is None
                or obs.received_lsn > target.received_lsn
                or self._repointed.get(name) == promoted
            ):
                continue
            with contextlib.suppress(Exception):
                self._repoint(name, promoted)
                self._rejoin_asked[name] = time.time()

    def _do_SetPrimary(self, action: act.SetPrimary, spec: PostgresClusterSpec) -> None:
        # The rw DSN selects the only read-write member; what is recorded here is what a pod label
        # would say, for the engine to check (ClusterView.rw_member).
        if self.rw_member != action.member:
            log.info("primary is now %s", action.member)
        self._point_rw_endpoint(action.member)

    def _point_rw_endpoint(self, member: str | None) -> None:
        if self.rw_member != member or not self.paths.rw_endpoint.exists():
            write_json(self.paths.rw_endpoint, {"member": member})
        self.rw_member = member

    def _do_SetSynchronousStandbys(
        self, action: act.SetSynchronousStandbys, spec: PostgresClusterSpec
    ) -> None:
        if action.member not in self.members or self.busy(action.member):
            return
        value = action.config.render()
        with psycopg.connect(self.superuser_dsn(action.member), autocommit=True, connect_timeout=2) as conn:
            row = conn.execute("SELECT current_setting('synchronous_standby_names')").fetchone()
            if row is not None and row[0] == value:
                return  # already in force: the engine repeats a step until it observes it
            conn.execute(
                psycopg.sql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}").format(
                    psycopg.sql.Literal(value)
                )
            )
            conn.execute("SELECT pg_reload_conf()")
        log.info("synchronous_standby_names on %s = %r", action.member, value)

    def _do_Rejoin(self, action: act.Rejoin, spec: PostgresClusterSpec) -> None:
        if action.member not in self.members or action.upstream not in self.members:
            return
        if action.member == action.upstream:
            log.error("refusing to rejoin %s to itself (%s)", action.member, action.reason)
            return
        # A running replica follows a new primary by itself (its conninfo selects the read-write
        # member, and recovery_target_timeline=latest takes the new timeline): give it a moment
        # before stopping it for a rewind.
        obs = self._observed.get(action.member)
        member = self.members[action.member]
        upstream = self._observed.get(action.upstream)
        clone_key = f"{action.upstream}@{upstream.timeline if upstream else None}"
        reclone = action.reclone and member.cloned_from != clone_key
        if obs is not None and obs.reachable and obs.in_recovery and not member.fenced and not reclone:
            if self._repointed.get(action.member) != action.upstream:
                self._repoint(action.member, action.upstream)
                self._rejoin_asked[action.member] = time.time()
                return
            asked = self._rejoin_asked.setdefault(action.member, time.time())
            if time.time() - asked < REJOIN_GRACE:
                return
        self._rejoin_asked.pop(action.member, None)
        self._repointed.pop(action.member, None)
        epoch = self._fence_epoch(action.member)

        def rejoin() -> None:
            self._rejoin(action.member, action.upstream, reclone=reclone, spec=spec, epoch=epoch)
            if reclone:
                member.cloned_from = clone_key
                member.save(self.paths)

        self._spawn(action.member, "rejoin", rejoin, fenced_epoch=epoch)

    def _repoint(self, name: str, upstream: str) -> None:
        """Point a running replica at its new upstream: rewrite primary_conninfo and reload (the
        walreceiver restarts on the new value; a timeline switch follows recovery_target_timeline)."""
        pgdata = self.paths.member_data(name)
        # restore_command too: a member restarted with no upstream runs without the archive.
        update_pgherd_conf(
            pgdata,
            {
                "primary_conninfo": self.replica_conninfo(name, upstream),
                "restore_command": self.restore_command(),
            },
        )
        postmaster.reload(pgdata, bins=self.bins)
        self._repointed[name] = upstream
        log.info("re-pointed %s at %s", name, upstream)

    def _do_DropReplicationSlot(self, action: act.DropReplicationSlot, spec: PostgresClusterSpec) -> None:
        if action.member not in self.members:
            return
        with (
            contextlib.suppress(psycopg.Error),
            psycopg.connect(self.superuser_dsn(action.member), autocommit=True, connect_timeout=2) as conn,
        ):
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                (action.slot.replace("-", "_"),),
            )

    def _do_StartSnapshot(self, action: act.StartSnapshot, spec: PostgresClusterSpec) -> None:
        if action.member not in self.members:
            return
        compression = spec.backup.compression.value if spec.backup is not None else "zstd"
        command = [
            self.agent,
            "snapshot",
            "--store",
            self.state.store_url,
            "--cluster",
            self.state.cluster,
            "--source",
            self.superuser_dsn(action.member),
            "--compression",
            compression,
        ]
        self.jobs.start(JobKind.SNAPSHOT, action.backup, command, self.pg_env(), member=action.member)
        self.objects.update_status("Backup", action.backup, startedAt=now_iso())

    def _do_StartRestore(self, action: act.StartRestore, spec: PostgresClusterSpec) -> None:
        name = action.member
        job = self.jobs.job(JobKind.RESTORE, action.restore)
        if name not in self.members or (job.folder / "job.json").exists() or self.busy(name):
            return
        started_at = time.time()
        kept = self._clear_for_restore(name)
        pgdata = self.paths.member_data(name)
        try:
            snapshot = self._snapshot_id(action.backup, action.snapshot_id)
        except ValueError as exc:
            job.folder.mkdir(parents=True, exist_ok=True)
            (job.folder / "stderr").write_text(str(exc) + "\n")
            (job.folder / "rc").write_text("1\n")
            job.set_meta(member=name)
            return
        make_pg_dir(pgdata)
        self.jobs.start(
            JobKind.RESTORE,
            action.restore,
            self._restore_command(pgdata, snapshot, action.target),
            self.pg_env(),
            member=name,
            kept_aside=str(kept) if kept else None,
            started_at=started_at,
            snapshot=snapshot,
        )
        self.objects.update_status("Restore", action.restore, startedAt=now_iso(), snapshotId=snapshot)

    def _clear_for_restore(self, name: str) -> Path | None:
        """Stop the member and move its data aside for a restore; where it went, if anywhere."""
        self._stop(name, fast_timeout=5)
        return self._keep_aside(name) if self.paths.member_data(name).exists() else None

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
                fields.update(
                    backupId=summary.get("id"),
                    startLSN=summary.get("start_lsn"),
                    endLSN=summary.get("stop_lsn"),
                    timeline=summary.get("timeline"),
                    sizeBytes=summary.get("size"),
                    storedSizeBytes=summary.get("stored_size"),
                    size=_human(summary.get("size")),
                    storedSize=_human(summary.get("stored_size")),
                    storePath=f"{self.state.store_url}/{self.state.cluster}/{summary.get('system_id')}/snapshots/{summary.get('id')}/",
                )
                if action.phase == "Completed" and summary.get("id"):
                    # `verified` means what it says: every object re-read and checked, by a verify task.
                    command = [
                        self.agent,
                        "verify",
                        "--store",
                        self.state.store_url,
                        "--cluster",
                        self.state.cluster,
                    ]
                    self.jobs.start_task(
                        f"verify-{action.name}", [*command, str(summary["id"])], self.pg_env()
                    )
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
        command = [self.agent, "prune", "--store", self.state.store_url, "--cluster", self.state.cluster]
        if action.keep_last is not None:
            command += ["--keep-last", str(action.keep_last)]
        if action.keep_within is not None:
            command += ["--keep-within", action.keep_within]
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        self.jobs.start_task(f"prune-{stamp}", command, self.pg_env())

    def _do_RecordEvent(self, action: act.RecordEvent, spec: PostgresClusterSpec) -> None:
        kind = "Warning" if action.warning else "Normal"
        line = f"{now_iso()} {kind} {action.reason}: {action.message}\n"
        with self.paths.events_log.open("a") as handle:
            handle.write(line)
        log.info("event %s %s: %s", kind, action.reason, action.message)

    # --- restore jobs: the platform part (start PostgreSQL once the files are in place) ---------------
    def advance_restores(self, spec: PostgresClusterSpec) -> None:
        for job in self.jobs.all():
            if job.kind is not JobKind.RESTORE or job.rc != 0 or job.meta.get("started"):
                continue
            name = job.meta.get("member")
            if not name or name not in self.members:
                continue
            pgdata = self.paths.member_data(name)
            update_pgherd_conf(pgdata, dict(self.settings(name, spec)))
            member = self.members[name]
            with self._lock:
                member.fenced = member.demoted = False
                member.wanted = True
            member.save(self.paths)
            job.set_meta(started=True)
            self._spawn(name, "start restored", lambda n=name: self._start(n))  # type: ignore[misc]

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

    def stop_all(self) -> None:
        for name in list(self.members):
            self._stop(name, fast_timeout=10)


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _human(size: int | None) -> str | None:
    if size is None:
        return None
    amount = float(size)
    for unit in ("", "Ki", "Mi", "Gi", "Ti"):
        if amount < 1024 or unit == "Ti":
            return f"{amount:.0f}{unit}" if unit == "" else f"{amount:.1f}{unit}"
        amount /= 1024
    return None


def member_names(cluster: str, instances: int) -> list[str]:
    return [member_name(cluster, i) for i in range(instances)]
