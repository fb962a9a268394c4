"""The member as its agent holds it: the data directory, the PostgreSQL child, the orders received.

Three rules live here, so that no action can break them:
- A start is gated (`start`): refused once a fence came after the order that asked for it, or when the
  member is fenced and the order may not start a fenced member, or once the agent shuts down.
- An existing data directory starts read-only unless an order says `StartRole.PRIMARY` (promote, a
  restart or unfence of the primary, a new cluster's initdb); a crash restarts it read-only.
- One action at a time (`action()`), except fence and SIGTERM, which never wait for one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgherd_backup import __version__
from pgherd_backup.agent.credentials import Credentials
from pgherd_backup.agent.isolation import Isolation
from pgherd_backup.agent.options import AgentOptions, read_parameters
from pgherd_backup.agent.pgtls import PgTls, PgTlsFiles, hba_lines, speaks_tls, write_hba
from pgherd_backup.agent.state import AgentState
from pgherd_backup.agent.supervisor import (
    PostmasterChild,
    PostmasterState,
    StartFailed,
    StartRefused,
    stop_children,
)
from pgherd_backup.agent.wire import ActionOutcome, ActionProgress
from pgherd_backup.errors import BackupError, PostgresError
from pgherd_backup.postgres.binaries import PgBinaries, data_major
from pgherd_backup.postgres.config import (
    Setting,
    archive_command,
    clear_standby_config,
    member_settings,
    read_pgherd_conf,
    restore_command,
    update_pgherd_conf,
    write_standby_config,
)
from pgherd_backup.postgres.control import read_controldata
from pgherd_backup.postgres.process import give_to_pg, grant_traverse, make_pg_dir
from pgherd_backup.postgres.seed import is_empty
from pgherd_backup.postgres.walend import WalEndReader
from pgherd_backup.restore import agent_executable
from pgherd_backup.wal import ARCHIVE_FAILURE_VARIABLE

if TYPE_CHECKING:
    from pgherd_backup.agent.upstream import Heard

log = logging.getLogger("pgherd.agent")

VERSION = __version__
_CRASH_BACKOFF = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# How long the liveness probe holds while the agent's restarts of a crashed PostgreSQL keep failing.
CRASH_RESTART_LIVENESS_BUDGET = 300.0
# From PostgreSQL's exit to the agent's decision to restart it (the crash is recorded first).
CRASH_NOTICE = 2.0
# A primary fenced while terminating stays (PostgreSQL stopped) until the operator's Rejoin says another
# member is primary, then ROUTE_SETTLE for kube-proxy to apply the -rw endpoint (its minimum sync period
# is 1 s); at most LINGER after the shutdown, when no Rejoin comes.
ROUTE_SETTLE = 2.0
LINGER = 15.0


class Busy(BackupError):
    """Another action holds the member (409 busy)."""


class Refused(BackupError):
    """The member's state forbids the action now; nothing was changed unless the message says what was
    (409 refused)."""


class StartRole(StrEnum):
    PRIMARY = "primary"  # no standby.signal: read-write (an explicit order only)
    STANDBY = "standby"  # standby.signal, following the upstream given (or none)
    AS_IS = "as-is"  # as the data directory says (a restored snapshot's targeted recovery)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass
class LongAction:
    """An action going on in its own thread after its request was answered (a restore): what /status
    shows as `actionProgress`. `key`: what a repeated request must match to be the same order."""

    name: str
    key: tuple[str | None, ...]
    request_id: str | None = None
    snapshot: str | None = None
    target: str | None = None
    stage: str | None = None
    bytes_done: int | None = None
    bytes_total: int | None = None
    kept_aside: str | None = None
    started_at: str = field(default_factory=now_iso)

    def outcome(
        self, *, ok: bool, detail: str, error: str | None = None, timeline: int | None = None
    ) -> ActionOutcome:
        """How it ended, as /status shows it (`lastAction`) and the agent's state keeps it."""
        return ActionOutcome(
            self.name,
            ok=ok,
            request_id=self.request_id,
            snapshot=self.snapshot,
            target=self.target,
            error=error,
            detail=detail,
            timeline=timeline,
            kept_aside=self.kept_aside,
            started_at=self.started_at,
            finished_at=now_iso(),
        )

    def wire(self) -> ActionProgress:
        return ActionProgress(
            name=self.name,
            stage=self.stage,
            request_id=self.request_id,
            snapshot=self.snapshot,
            target=self.target,
            bytes_done=self.bytes_done,
            bytes_total=self.bytes_total,
            started_at=self.started_at,
        )


def upstream_params(upstream: str) -> tuple[dict[str, Any], bool]:
    """libpq parameters of an upstream given as a conninfo / URI (explicit: used as it is) or as
    `host[:port]` (the agent adds its users)."""
    text = upstream.strip()
    if "=" in text or text.startswith(("postgres://", "postgresql://")):
        try:
            return dict(conninfo_to_dict(text)), True
        except psycopg.ProgrammingError as exc:
            raise Refused(f"invalid upstream conninfo: {exc}") from None
    host, sep, port = text.rpartition(":") if text.count(":") == 1 else (text, "", "")
    if not sep:
        host, port = text, "5432"
    if not host or not port.isdigit():
        raise Refused(f"invalid upstream {upstream!r}: expected host:port or a libpq conninfo")
    return {"host": host, "port": port}, False


def describe_upstream(upstream: str | None) -> str | None:
    """The upstream as /status shows it: never a password."""
    if upstream is None:
        return None
    try:
        params, explicit = upstream_params(upstream)
    except Refused:
        return "(invalid)"
    if not explicit:
        return upstream.strip()
    params.pop("password", None)
    return make_conninfo(**{k: str(v) for k, v in params.items()})


def _pg_tls(options: AgentOptions) -> PgTls | None:
    if not options.pg_tls:
        return None
    assert options.tls_cert and options.tls_key and options.tls_ca
    assert options.replication_cert and options.replication_key
    sources = PgTlsFiles(
        server_cert=options.pg_tls_cert or options.tls_cert,
        server_key=options.pg_tls_key or options.tls_key,
        server_ca=options.pg_tls_ca or options.tls_ca,
        client_ca=options.pg_client_ca or options.tls_ca,
        client_cert=options.replication_cert,
        client_key=options.replication_key,
    )
    return PgTls(options.tls_dir, sources, options.pg_tls_min_version)


def _pgpass_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace(":", "\\:")


def _binaries_for(pgdata: Path) -> PgBinaries:
    """The programs of the data directory's major when it holds one (and they are here), else the
    default ones (a new member's)."""
    major = data_major(pgdata)
    if major is not None:
        try:
            return PgBinaries.for_major(major)
        except BackupError as exc:
            log.error("%s", exc)
    return PgBinaries.find()


class Instance:
    def __init__(
        self, options: AgentOptions, credentials: Credentials, bins: PgBinaries | None = None
    ) -> None:
        self.options = options
        self.credentials = credentials
        self.pgdata = options.pgdata
        self.bins = bins or _binaries_for(self.pgdata)
        self.state = AgentState.load(options.state_file)
        if options.revision is not None:
            self.state.revision = options.revision
        if options.upstream is not None and not self.state.fenced:
            self.state.upstream = options.upstream
        self.agent_executable = agent_executable()
        self.wal = WalEndReader(self.bins)
        self._major: int | None = None  # PostgreSQL's major version, asked once
        self.epoch = 0  # bumped by every fence and by the shutdown: orders given before may not start it
        self.terminating = False
        self.shutting_down = False
        self.handed_over = threading.Event()  # while terminating: the operator's Rejoin arrived
        self.last_error: str | None = None
        self.start_failed = False
        # Set from a crash until the agent's restarts of PostgreSQL end (started, refused or given up).
        self.restarting_after_crash = threading.Event()
        self.crashed_at = 0.0
        self.pg_tls = _pg_tls(options)
        self.start_error: str | None = None  # why the last start failed (its FATAL line); None once started
        self.action_name: str | None = None
        self.long_action: LongAction | None = None  # the action going on after its answer (restore)
        self.analyzing = False  # statistics being rebuilt after a major upgrade (upgrading.py)
        # When its upstream last said anything, and which upstream: kept after the WAL receiver gives
        # up on a silent one. Written by the agent's watch on its receiver alone (upstream.py).
        self.upstream_heard: Heard | None = None
        self.isolation = Isolation()  # the operator's last word and order (isolation.py)
        self.boot_done = threading.Event()
        self._state_lock = threading.RLock()
        self._skip_lock = threading.Lock()
        self._skip_until = 0.0  # time.monotonic() at which skip_archive ends
        self._action_lock = threading.Lock()
        self.fence_lock = threading.Lock()
        self.postmaster = PostmasterChild(
            self.pgdata,
            bins=self.bins,
            log_file=options.log_file,
            env=self.pg_env,
            on_crash=self._on_crash,
            socket_dirs=(options.socket_dir,),
        )

    # -- the programs ---------------------------------------------------------------------------------
    def use_binaries(self, bins: PgBinaries) -> None:
        """Run another major's programs from now on (PostgreSQL stopped): the data directory became
        that major's (an upgrade, a clone of an upstream on it, a restored snapshot of it)."""
        if bins.bindir == self.bins.bindir:
            return
        log.info("PostgreSQL programs: %s", bins.bindir)
        self.bins = bins
        self.wal = WalEndReader(bins)
        self.postmaster.bins = bins
        self._major = None

    def use_binaries_of_data(self) -> None:
        """The programs of the data directory's own major (after its files were replaced)."""
        major = data_major(self.pgdata)
        if major is not None:
            self.use_binaries(PgBinaries.for_major(major))

    def use_binaries_of(self, upstream: str) -> None:
        """The programs of the major `upstream` runs, before cloning it: a clone is its major's data."""
        try:
            with psycopg.connect(self.conninfo(upstream, superuser=True), connect_timeout=5) as conn:
                number = conn.info.server_version
        except psycopg.Error:
            return  # the clone itself will say why the upstream does not answer
        if self.shutting_down:
            raise Refused("the agent is shutting down: nothing was copied")
        self.use_binaries(PgBinaries.for_major(number // 10000))

    # -- the volume ---------------------------------------------------------------------------------
    def prepare_volume(self) -> None:
        """Directories the PostgreSQL account must own or reach, and the password file its clients use."""
        make_pg_dir(self.options.agent_dir, mode=0o700)
        make_pg_dir(self.options.socket_dir, mode=0o700)
        self.use_archive()  # a marker left by an agent that died inside skip_archive's moment
        # archive_command / restore_command run pgherd-backup as the PostgreSQL account
        grant_traverse(sys.executable, self.agent_executable, self.options.volume)
        self.write_passfile()
        os.environ["PGPASSFILE"] = str(self.options.passfile)
        self.save()

    def write_passfile(self) -> None:
        lines = []
        pairs = [
            (self.options.superuser, self.credentials.superuser_password),
            (self.options.replication_role, self.credentials.replication_password),
        ]
        for user, secret in pairs:
            if secret is not None:
                lines.append(f"*:*:*:{_pgpass_escape(user)}:{_pgpass_escape(secret.value())}\n")
        path = self.options.passfile
        tmp = path.with_name(".pgpass.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.writelines(lines)
        give_to_pg(tmp)
        os.replace(tmp, path)

    def data_present(self) -> bool:
        return (self.pgdata / "PG_VERSION").exists()

    def keep_aside(self, pgdata: Path) -> Path:
        """Move a data directory a re-clone replaces to `<volume>/kept/<stamp>` (same volume: a rename,
        no copy; never deleted) and remember it."""
        kept_root = self.options.kept
        kept_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        target = kept_root / stamp
        os.rename(pgdata, target)
        with self._state_lock:
            self.state.kept_aside.append(str(target))
            self.save()
        log.warning("the data directory %s was replaced; the old one is kept in %s", pgdata, target)
        return target

    def save(self) -> None:
        with self._state_lock:
            self.state.save(self.options.state_file)

    # -- PostgreSQL's settings and environment ----------------------------------------------------------
    def pg_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PGPASSFILE"] = str(self.options.passfile)
        env["PATH"] = f"{Path(self.agent_executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
        libdir = self.bins.libdir
        if libdir is not None and str(libdir) not in env.get("LD_LIBRARY_PATH", "").split(":"):
            before = env.get("LD_LIBRARY_PATH")
            env["LD_LIBRARY_PATH"] = f"{libdir}:{before}" if before else str(libdir)
        if self.options.store:
            env["PGHERD_STORE"] = self.options.store
            env["PGHERD_CLUSTER"] = self.options.cluster
            env[ARCHIVE_FAILURE_VARIABLE] = str(self.options.archive_failure_file)
        return env

    def settings(self) -> dict[str, Setting]:
        """The member's pgherd-owned settings, and its parameters (the file is read again each time:
        a restart at a new revision takes the parameters of that revision)."""
        options = self.options
        extra: dict[str, Setting] = {"cluster_name": options.member, **self.default_parameters()}
        extra.update(options.parameters)
        if options.parameters_file is not None:
            extra.update(read_parameters(options.parameters_file))
        if self.pg_tls is not None:
            self.pg_tls.install()
            extra.update(self.pg_tls.settings())
        command = (
            archive_command(
                self.agent_executable, options.store, options.cluster, wal_service=str(options.wal_socket)
            )
            if options.store
            else None
        )
        return member_settings(
            options.pg_port,
            listen_addresses=options.pg_listen,
            socket_dir=str(options.socket_dir),
            archive_command=command,
            extra=extra,
        )

    def default_parameters(self) -> dict[str, Setting]:
        """Parameters the agent sets unless the user's say otherwise: `recovery_init_sync_method =
        syncfs` (PostgreSQL 14+, Linux): a crashed PostgreSQL otherwise fsyncs its data directory file by
        file before its crash recovery, seconds on a big one; one syncfs() per file system is as durable."""
        if self._major is None:
            try:
                self._major = self.bins.major
            except BackupError:
                self._major = 0
        if sys.platform.startswith("linux") and self._major >= 14:
            return {"recovery_init_sync_method": "syncfs"}
        return {}

    def restore_command(self, *, standby: bool = False) -> str | None:
        """`standby`: a standby's, which skip_archive may short-cut; never an archive recovery's (a
        restore, whose first "not archived" ends it)."""
        if not self.options.store:
            return None
        return restore_command(
            self.agent_executable,
            self.options.store,
            self.options.cluster,
            wal_service=str(self.options.wal_socket),
            skip_archive=str(self.options.skip_archive_file) if standby else None,
        )

    def skip_archive(self, seconds: float) -> None:
        """For `seconds`, the standby's restore_command answers "not archived" without asking, but for a
        history file already in pg_wal. A replica re-pointed at a member about to be promoted gets the
        new timeline's history and WAL by streaming; each question to the archive inside its timeline
        switch (a process, the WAL service, S3 for the next history file) delays the new primary's
        first quorum commit, which waits for it. use_archive() ends it at once."""
        marker = self.options.skip_archive_file
        with self._skip_lock:
            self._skip_until = time.monotonic() + seconds
            marker.touch()
        timer = threading.Timer(seconds, self._skip_ends)
        timer.daemon = True
        timer.start()

    def _skip_ends(self) -> None:
        with self._skip_lock:
            if time.monotonic() >= self._skip_until:
                self.options.skip_archive_file.unlink(missing_ok=True)

    def use_archive(self) -> None:
        """restore_command asks the archive again: before any start, and before a promotion, whose new
        timeline is one the archive does not hold (a skipped question would answer "free" wrongly)."""
        with self._skip_lock:
            self._skip_until = 0.0
            self.options.skip_archive_file.unlink(missing_ok=True)

    def conninfo(self, upstream: str, *, superuser: bool = False) -> str:
        """A conninfo to `upstream`: as given when explicit; else with the replication account (or the
        superuser, which pg_rewind needs). The password comes from the passfile, never from here."""
        params, explicit = upstream_params(upstream)
        if not explicit and self.pg_tls is not None and self._speaks_tls(params):
            # The replication account's certificate, pg_rewind's reads included: no password at all.
            params.update(
                user=self.options.replication_role, dbname="postgres", **self.pg_tls.client_params()
            )
        elif not explicit:
            params["user"] = self.options.superuser if superuser else self.options.replication_role
            params["dbname"] = "postgres"
        params.setdefault("application_name", self.options.member)
        params.setdefault("connect_timeout", "10")
        if "password" not in params:
            params.setdefault("passfile", str(self.options.passfile))
        return make_conninfo(**{k: str(v) for k, v in params.items()})

    def _speaks_tls(self, params: Mapping[str, Any]) -> bool:
        """Whether to reach this upstream by TLS: yes unless it answers that it has none (a member still
        on a pgherd from before TLS, during the rollout that brings it); an upstream that does not
        answer at all gets TLS, the way it will have to be reached."""
        answer = speaks_tls(str(params["host"]), int(params["port"]))
        if answer is False:
            log.warning(
                "%s:%s does not speak TLS (a member not moved to TLS yet): reaching it by password",
                params["host"],
                params["port"],
            )
        return answer is not False

    def refresh_tls(self) -> None:
        """Periodic (run.py): renewed certificates (the mounted Secret changed) are reloaded by
        PostgreSQL without a restart; a replica that follows its upstream by password because the
        upstream had no TLS moves to TLS once the upstream has it."""
        if self.pg_tls is None:
            return
        reload = False
        if self.pg_tls.install():
            log.info("PostgreSQL's certificates changed: reloading them")
            reload = True
        reload = self._upstream_to_tls() or reload
        if reload and self.postmaster.alive:
            try:
                with self.connect(timeout=2) as conn:
                    conn.execute("SELECT pg_reload_conf()")
            except psycopg.Error as exc:
                log.warning("could not reload PostgreSQL's configuration: %s", exc)

    def _upstream_to_tls(self) -> bool:
        with self._state_lock:
            upstream = self.state.upstream
        if not upstream or not self.postmaster.alive:
            return False
        try:
            self.hold("tls", wait=0)
        except Busy:
            return False  # an action may be re-pointing it: next time
        try:
            current = read_pgherd_conf(self.pgdata).get("primary_conninfo") or ""
            if not current or "sslcert=" in current:
                return False
            wanted = self.conninfo(upstream)
            if "sslcert=" not in wanted:
                return False
            update_pgherd_conf(self.pgdata, {"primary_conninfo": wanted})
            log.info("%s speaks TLS now: following it by TLS", describe_upstream(upstream))
            return True
        finally:
            self.release()

    # -- SQL on the member itself --------------------------------------------------------------------
    def local_dsn(self, user: str | None = None, application: str = "pgherd-agent") -> str:
        """The Unix socket, as `user` (default: the superuser)."""
        return make_conninfo(
            host=str(self.options.socket_dir),
            port=str(self.options.pg_port),
            user=user or self.options.superuser,
            dbname="postgres",
            application_name=application,
        )

    def open_local(
        self,
        timeout: float = 2.0,
        statement_timeout: float | None = None,
        user: str | None = None,
        application: str = "pgherd-agent",
    ) -> psycopg.Connection[Any]:
        """A connection on the Unix socket, autocommit; the caller closes it."""
        options = f"-c statement_timeout={int((statement_timeout or timeout) * 1000)}"
        return psycopg.connect(
            self.local_dsn(user, application),
            autocommit=True,
            connect_timeout=max(1, int(timeout)),
            options=options,
        )

    @contextlib.contextmanager
    def connect(
        self, timeout: float = 2.0, statement_timeout: float | None = None
    ) -> Iterator[psycopg.Connection[Any]]:
        with self.open_local(timeout, statement_timeout) as conn:
            yield conn

    def role(self) -> str | None:
        """primary | replica from SQL; None when PostgreSQL does not answer."""
        if not self.postmaster.alive:
            return None
        try:
            with self.connect(timeout=2) as conn:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        except psycopg.Error:
            return None
        return None if row is None else ("replica" if row[0] else "primary")

    def wait_accepting(self, timeout: float) -> str:
        """Wait until PostgreSQL answers SQL; its role. Refused when it does not in time."""
        deadline = time.monotonic() + timeout
        while True:
            role = self.role()
            if role is not None:
                return role
            if not self.postmaster.alive:
                raise Refused("PostgreSQL is not running")
            if time.monotonic() >= deadline:
                raise Refused(
                    f"PostgreSQL does not accept connections after {timeout:.0f}s (still recovering?)"
                )
            time.sleep(0.1)

    def role_on_disk(self) -> str | None:
        """The role pg_control records (a stopped member): `in production` or `shut down` is a primary's."""
        try:
            return "replica" if read_controldata(self.pgdata, self.bins).in_recovery else "primary"
        except BackupError:
            return None

    # -- the gate -------------------------------------------------------------------------------------
    def order(self) -> int:
        """The token of an order received now: a later fence invalidates it."""
        with self._state_lock:
            return self.epoch

    def refusal(self, token: int, *, may_start_fenced: bool = False) -> str | None:
        with self._state_lock:
            if self.shutting_down:
                return "the agent is shutting down"
            if token != self.epoch:
                return "fenced after this order was given"
            if self.state.fenced and not may_start_fenced:
                return "the member is fenced (unfence, demote, rejoin or promote it first)"
        return None

    def check(self, token: int, *, may_start_fenced: bool = False) -> None:
        reason = self.refusal(token, may_start_fenced=may_start_fenced)
        if reason is not None:
            raise Refused(f"not started: {reason}")

    def start(
        self,
        role: StartRole,
        token: int,
        *,
        upstream: str | None = None,
        may_start_fenced: bool = False,
        report_exit: bool = True,
        local_only: bool = False,
    ) -> bool:
        """Configure the data directory for `role` and start PostgreSQL (no-op when it runs); gated.
        `report_exit=False`: the caller watches it (a restore's replay), see PostmasterChild.start.
        `local_only`: on its Unix socket alone (no client reaches it: an upgrade's checks)."""
        if not self.data_present():
            raise Refused(f"{self.pgdata} holds no data: seed it first (POST /actions/seed)")
        self.check(token, may_start_fenced=may_start_fenced)
        if not self.postmaster.alive:
            self.use_archive()
            self.configure(role, upstream)
            if local_only:
                update_pgherd_conf(self.pgdata, {"listen_addresses": ""})
        try:
            started = self.postmaster.start(
                lambda: self.refusal(token, may_start_fenced=may_start_fenced),
                timeout=self.options.start_timeout,
                report_exit=report_exit,
            )
        except StartRefused as exc:
            raise Refused(f"not started: {exc}") from None
        except PostgresError as exc:
            self.start_failed = True
            self.last_error = self.credentials.redact(exc.message)
            reason = exc.reason if isinstance(exc, StartFailed) and exc.reason else exc.message
            self.start_error = self.credentials.redact(reason)
            raise
        self.start_failed = False
        self.start_error = None
        if started:
            log.info(
                "PostgreSQL runs as %s%s",
                role.value,
                f" following {describe_upstream(upstream)}" if upstream else "",
            )
        return started

    def configure(self, role: StartRole, upstream: str | None) -> None:
        """The settings files for a start in `role` (PostgreSQL stopped)."""
        self.write_passfile()
        update_pgherd_conf(self.pgdata, self.settings())
        if self.pg_tls is not None:
            options = self.options
            write_hba(
                self.pgdata,
                hba_lines(
                    superuser=options.superuser,
                    replication=options.replication_role,
                    superuser_network=options.superuser_network_access,
                    extra=options.hba,
                ),
            )
        if role is StartRole.PRIMARY:
            clear_standby_config(self.pgdata)
            (self.pgdata / "recovery.signal").unlink(missing_ok=True)
        elif role is StartRole.STANDBY:
            if upstream is not None:
                write_standby_config(
                    self.pgdata, self.conninfo(upstream), restore_command=self.restore_command(standby=True)
                )
            else:
                # Its own WAL only: no upstream and no archive, so that it cannot wander onto another
                # member's timeline before the operator decides.
                write_standby_config(self.pgdata, "")
                update_pgherd_conf(self.pgdata, {"restore_command": None, "primary_conninfo": None})

    def stop(self, *, checkpoint: bool, role: str | None = None) -> None:
        """CHECKPOINT first when asked and it is a primary (the shutdown checkpoint then has little left
        to write), then fast shutdown, immediate after --stop-timeout. `role`: as just read, if it was."""
        if not self.postmaster.alive:
            return
        running = self.postmaster.state is PostmasterState.RUNNING  # not starting: it would not answer
        if checkpoint and running and (role or self.role()) == "primary":
            try:
                with self.connect(timeout=1, statement_timeout=self.options.stop_timeout) as conn:
                    conn.execute("CHECKPOINT")
            except psycopg.Error as exc:
                log.warning("CHECKPOINT before the shutdown failed: %s", str(exc).strip())
        self.postmaster.shutdown(stop_timeout=self.options.stop_timeout)

    # -- actions: one at a time ------------------------------------------------------------------------
    @contextlib.contextmanager
    def action(self, name: str, wait: float = 0.5) -> Iterator[None]:
        self.hold(name, wait)
        try:
            yield
        finally:
            self.release()

    def hold(self, name: str, wait: float = 0.5) -> None:
        """Take the one action slot (Busy when another action keeps it past `wait`); `release()` gives
        it back, also from another thread: a long action answers first and goes on in its own."""
        if self.shutting_down:
            if name == "rejoin":  # the operator recorded the new primary: the hand-over is done
                self.handed_over.set()
            raise Refused("the agent is shutting down (its pod is being deleted): nothing was done")
        if not self._action_lock.acquire(timeout=wait):
            raise Busy(f"busy: {self.action_name or 'an action'} is in progress; ask again when it is done")
        self.action_name = name

    def release(self) -> None:
        self.action_name = None
        self._action_lock.release()

    def record(self, token: int | None = None, **fields: Any) -> None:
        """Record state fields (fenced, upstream, revision...); with `token`, only if no fence came since
        the order (Refused otherwise, and nothing is recorded)."""
        with self._state_lock:
            if token is not None and token != self.epoch:
                raise Refused("fenced after this order was given: nothing more was done")
            for key, value in fields.items():
                setattr(self.state, key, value)
            self.save()

    def fence_now(self) -> tuple[bool, bool]:
        """Fence: forbid every start decided before, then stop PostgreSQL (CHECKPOINT if primary, fast,
        immediate after --stop-timeout). Returns (newly fenced, was running)."""
        with self.fence_lock:
            with self._state_lock:  # first of all: no start decided before this line happens any more
                self.epoch += 1
                was_fenced, was_demoted = self.state.fenced, self.state.demoted
                self.state.fenced, self.state.demoted = True, False
                self.save()
            running = self.postmaster.alive
            role = self.role() if self.postmaster.state is PostmasterState.RUNNING else None
            if not was_fenced:
                # The role it had before any fence: a demoted member runs read-only, but Unfence resumes
                # what it was before the first fence (a switchover abandoned).
                self.record(role_at_fence=role or self.role_on_disk())
            self.stop(checkpoint=role == "primary", role=role)
            return not was_fenced or was_demoted, running

    # -- crashes ---------------------------------------------------------------------------------------
    def _on_crash(self, code: int) -> None:
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        with self._state_lock:
            # Restarting from now on (before the crash is saved): the probes see no gap.
            crashed_at = self.crashed_at = time.monotonic()
            self.restarting_after_crash.set()
            self.state.crashes += 1
            self.state.last_crash_at = now_iso()
            self.last_error = f"PostgreSQL exited unexpectedly ({how}) at {self.state.last_crash_at}"
            self.save()
            token = self.epoch
            demoted = self.state.demoted
            upstream = None if demoted else self.state.upstream
        log.error("%s: starting it again read-only", self.last_error)
        threading.Thread(
            target=self._restart_read_only,
            args=(crashed_at, token, upstream, demoted),
            name="crash-restart",
            daemon=True,
        ).start()

    def _restart_read_only(self, crashed_at: float, token: int, upstream: str | None, demoted: bool) -> None:
        try:
            self._try_restarts(token, upstream, demoted)
        finally:
            with self._state_lock:
                if self.crashed_at == crashed_at:  # not a later crash, whose restart goes on
                    self.restarting_after_crash.clear()

    def _try_restarts(self, token: int, upstream: str | None, demoted: bool) -> None:
        for attempt in range(10_000):
            time.sleep(_CRASH_BACKOFF[min(attempt, len(_CRASH_BACKOFF) - 1)])
            if self.refusal(token, may_start_fenced=demoted) is not None:
                log.info(
                    "not restarting PostgreSQL after the crash: %s",
                    self.refusal(token, may_start_fenced=demoted),
                )
                return
            try:
                with self.action("restart after a crash", wait=5.0):
                    if self.postmaster.alive:
                        return  # an order started it meanwhile
                    self.start(StartRole.STANDBY, token, upstream=upstream, may_start_fenced=demoted)
                    return
            except Busy:
                continue
            except Refused as exc:
                log.info("not restarting PostgreSQL after the crash: %s", exc)
                return
            except (BackupError, OSError) as exc:
                log.error("restarting PostgreSQL after the crash failed (attempt %d): %s", attempt + 1, exc)

    # -- boot -----------------------------------------------------------------------------------------
    def boot(self) -> None:
        """What a starting agent does with its data directory (see seeding.py for an empty one, and
        restoring.py for a restore the previous agent left in progress)."""
        handed_over = False
        try:
            self.hold("boot", wait=60)
            try:
                handed_over = self._boot(self.order())
            finally:
                if not handed_over:
                    self.release()
        except (BackupError, OSError) as exc:
            self.start_failed = True
            self.last_error = self.credentials.redact(str(exc))
            if (
                self.start_error is None
            ):  # not PostgreSQL's own refusal (set by start): why it was not started
                self.start_error = self.last_error
            log.error("the first start failed: %s", self.start_error)
        finally:
            self.boot_done.set()

    def _boot(self, token: int) -> bool:
        """The first start, holding the action slot; True when a restore's thread took the slot over."""
        from pgherd_backup.agent import restoring, upgrading
        from pgherd_backup.agent.seeding import seed_and_start

        upgrading.on_boot(self)  # an upgrade cut short: reported, never started here
        self.use_binaries_of_data()

        if restoring.on_boot(self):
            # A restore's replay the previous agent left running: a thread of its own goes on with it.
            restoring.resume(self, token)
            return True
        if is_empty(self.pgdata):
            if self.options.seed == "none":
                log.info("%s is empty: waiting for an order to seed it (POST /actions/seed)", self.pgdata)
                return False
            options = self.options
            seed_and_start(
                self, options.seed, options.upstream, options.snapshot, options.recovery_target, token
            )
            return False
        if not self.data_present():
            raise Refused(
                f"{self.pgdata} holds files but no PostgreSQL data (no PG_VERSION): move them aside; "
                "the agent then waits for a seed order"
            )
        with self._state_lock:
            fenced, demoted, upstream = self.state.fenced, self.state.demoted, self.state.upstream
        if fenced and not demoted:
            log.warning(
                "the member is fenced: PostgreSQL stays stopped until unfence, demote, rejoin or promote"
            )
            return False
        if (self.pgdata / "recovery.signal").exists():
            # A restored snapshot's targeted recovery, as ordered: it ends with its promotion.
            self.start(StartRole.AS_IS, token)
            return False
        self.start(StartRole.STANDBY, token, upstream=None if demoted else upstream, may_start_fenced=demoted)
        return False

    # -- SIGTERM -------------------------------------------------------------------------------------------
    def terminate(self) -> None:
        """A primary not fenced waits (bounded) for the operator to switch over; then everything stops.
        Fenced as the primary, meanwhile or before the SIGTERM, it stays until the operator says the
        hand-over is done (see linger)."""
        wait = self.options.wait_for_switchover
        deadline = time.monotonic() + wait
        if self.role() == "primary" and not self.state.fenced and wait > 0:
            self.terminating = True
            log.warning(
                "SIGTERM on the primary: waiting up to %.0fs for the operator to switch over (fence or demote)",
                wait,
            )
            while time.monotonic() < deadline and not self.state.fenced and self.postmaster.alive:
                time.sleep(0.1)
        with self._state_lock:
            self.shutting_down = True
            self.epoch += 1
        with self.fence_lock:
            # Fenced as the primary, while waiting or before the SIGTERM came (the operator switches over
            # on the pod's deletion, whose watch event may reach it first): the -rw Service may still
            # route here. Read under the lock: a fence records the role only after `fenced`.
            handing_over = self.state.fenced and self.state.role_at_fence == "primary"
            log.info("shutting PostgreSQL down")
            self.stop(checkpoint=True)
        if handing_over:
            self._linger(min(deadline, time.monotonic() + LINGER))
        self.terminating = False
        log.info("PostgreSQL is stopped (%s)", self.postmaster.state.value)
        action = self.action_name
        if action is not None:
            # An action cut short (a clone in progress): stop its programs and let it clean up (a
            # half copy is removed) before the agent exits.
            stopped = stop_children()
            log.warning("stopped %d program(s) of the action in progress (%s)", len(stopped), action)
            if self._action_lock.acquire(timeout=15):
                self._action_lock.release()

    def _linger(self, until: float) -> None:
        """The -rw Service routes to this pod until the operator has promoted another member and
        kube-proxy has applied the new endpoint. Until then its clients must be refused at once, as a
        live pod with a stopped PostgreSQL refuses them; the address of a pod gone would leave their
        connections waiting for a timeout (seconds of write outage on localkube, 2026-12-05). The
        operator's Rejoin, sent once it records the new primary, ends it (after ROUTE_SETTLE); else
        `until`. Every action is refused meanwhile (see hold)."""
        log.info("fenced while terminating: staying until the operator has handed the primary over")
        if self.handed_over.wait(max(0.0, until - time.monotonic())):
            time.sleep(max(0.0, min(ROUTE_SETTLE, until - time.monotonic())))

    # -- the probes' view ------------------------------------------------------------------------------
    def healthy(self) -> tuple[bool, str]:
        with self._state_lock:
            stopped_on_purpose = self.state.fenced and not self.state.demoted
        if stopped_on_purpose and not self.postmaster.alive:
            return True, "fenced: stopped on purpose"
        # Restarting a crashed PostgreSQL is the agent doing its work: a kill by the kubelet would only
        # start it over. Its attempts failing for minutes is a wedged member, which a new container may cure.
        if (
            self.restarting_after_crash.is_set()
            and not self.postmaster.alive
            and time.monotonic() - self.crashed_at < CRASH_RESTART_LIVENESS_BUDGET
        ):
            return True, f"restarting PostgreSQL after a crash ({self.last_error})"
        state = self.postmaster.state
        if state is PostmasterState.CRASHED:
            just_now = (datetime.now(UTC) - self.postmaster.since).total_seconds() < CRASH_NOTICE
            if self.postmaster.exit_is_crash and just_now:
                return True, "PostgreSQL just exited: the agent is about to start it again"
            return False, f"PostgreSQL crashed and is not running again yet ({self.last_error})"
        if self.start_failed and not self.postmaster.alive and self.action_name is None:
            return False, f"PostgreSQL should run and does not: {self.start_error or self.last_error}"
        return True, state.value

    def settings_snapshot(self) -> Mapping[str, Any]:
        with self._state_lock:
            return dict(vars(self.state))
