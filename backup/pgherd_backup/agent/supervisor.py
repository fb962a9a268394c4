"""PostgreSQL as the agent's child: started directly (`postgres -D`), reaped by a watcher thread, and
reported as crashed when it exits without having been asked to.

The gate: `start(may_start)` evaluates `may_start` under the same lock that `stop` takes, so an order
that forbids starting (a fence) and then stops the child can never be overtaken by a start decided
before it: either the start sees the fence and refuses, or the stop that follows the fence finds the
child and stops it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

from pgherd_backup.errors import PostgresError
from pgherd_backup.postgres import postmaster
from pgherd_backup.postgres.binaries import PgBinaries
from pgherd_backup.postgres.process import child_processes, give_to_pg, pg_popen

log = logging.getLogger("pgherd.agent")

# postmaster.pid's 8th line (PM_STATUS): what pg_ctl -w waits for
_PID_STATUS_LINE = 7
_ACCEPTING = ("ready", "standby")
_START_POLL = 0.05  # how often a start looks at postmaster.pid
_SIGNALS = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}


class PostmasterState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"  # spawned, not yet accepting connections (recovery to consistency)
    RUNNING = "running"
    CRASHED = "crashed"  # exited without being asked; the agent restarts it read-only


class StartRefused(Exception):
    """The gate said no (fenced, shutting down): nothing was started."""


def pid_file_status(pgdata: Path, pid: int) -> str | None:
    """The postmaster's status in postmaster.pid, if the file is `pid`'s (a killed postmaster leaves its
    own behind, saying "ready", until the new one replaces it)."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().split("\n")
    except OSError:
        return None
    if len(lines) <= _PID_STATUS_LINE or lines[0].strip() != str(pid):
        return None
    return lines[_PID_STATUS_LINE].strip()


def last_fatal(path: Path, since: int = 0) -> str | None:
    """Why PostgreSQL stopped or did not start, from what it wrote to its log after byte `since`: its
    last FATAL (or PANIC) line without the line's prefix, and for a configuration file "contains
    errors" the parameters it complained about; None when there is no such line."""
    try:
        with path.open("rb") as handle:
            handle.seek(since)
            lines = handle.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for index in range(len(lines) - 1, -1, -1):
        for level in ("PANIC:", "FATAL:"):
            if level not in lines[index]:
                continue
            reason = f"{level} {lines[index].split(level, 1)[1].strip()}"
            if "contains errors" in reason:
                details = [
                    line.split("LOG:", 1)[1].strip()
                    for line in lines[:index]
                    if "LOG:" in line and "parameter" in line
                ]
                if details:
                    reason += " (" + "; ".join(details[-3:]) + ")"
            return reason
    return None


class StartFailed(PostgresError):
    """PostgreSQL exited while starting; `reason`: its last FATAL line (see last_fatal), if any."""

    def __init__(self, message: str, reason: str | None) -> None:
        super().__init__(message)
        self.reason = reason


def _log_tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return " | ".join(text.strip().splitlines()[-lines:])


@dataclass
class _Child:
    proc: subprocess.Popen[bytes]
    exited: threading.Event = field(default_factory=threading.Event)
    asked_to_stop: bool = False
    # While `start` waits for it, an exit is that start's failure (it raises), not a crash to report:
    # a crash restart that fails must not spawn another restart.
    starter_waiting: bool = True
    # It accepted connections (its postmaster.pid said so): the start succeeded, and an exit from then on
    # is a crash, also when it comes before the waiting start looked (a client may connect first).
    accepted: bool = False
    # False while an action watches it to its end itself (a restore's replay): its exit is that
    # action's failure, reported by it, and must not bring a crash restart.
    report_exit: bool = True
    log_offset: int = 0  # where its log lines begin in the log file


class PostmasterChild:
    """One data directory's postmaster, as a child of this process."""

    def __init__(
        self,
        pgdata: Path,
        *,
        bins: PgBinaries,
        log_file: Path,
        env: Callable[[], Mapping[str, str]],
        on_crash: Callable[[int], None],
        socket_dirs: Sequence[Path] = (),
    ) -> None:
        self.pgdata = pgdata
        self.socket_dirs = tuple(socket_dirs)
        self.bins = bins
        self.log_file = log_file
        self._env = env
        self._on_crash = on_crash
        self._lock = threading.RLock()
        self._child: _Child | None = None
        self._state = PostmasterState.STOPPED
        self.since = datetime.now(UTC)
        self.last_exit: int | None = None
        # Whether its last exit goes to on_crash (not a failed start, a stop, or an action's own child).
        self.exit_is_crash = False

    # -- observation --------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        with self._lock:
            return self._child.proc.pid if self._child is not None else None

    @property
    def alive(self) -> bool:
        with self._lock:
            return self._child is not None and not self._child.exited.is_set()

    @property
    def state(self) -> PostmasterState:
        """Its state; a start that stopped waiting (a long recovery) becomes running once it accepts."""
        with self._lock:
            child = self._child
            if (
                self._state is PostmasterState.STARTING
                and child is not None
                and not child.starter_waiting
                and pid_file_status(self.pgdata, child.proc.pid) in _ACCEPTING
            ):
                child.accepted = True
                self._set(PostmasterState.RUNNING)
            return self._state

    def failure_reason(self) -> str | None:
        """The last FATAL (or PANIC) line the current (or last) child wrote to the log."""
        with self._lock:
            child = self._child
        return last_fatal(self.log_file, child.log_offset) if child is not None else None

    def report_exits(self) -> None:
        """From now on an exit of the running child is a crash again (see `start(report_exit=False)`)."""
        with self._lock:
            if self._child is not None:
                self._child.report_exit = True

    def _set(self, state: PostmasterState) -> None:
        if state is not self._state:
            self._state = state
            self.since = datetime.now(UTC)

    # -- start --------------------------------------------------------------------------------------
    def start(self, may_start: Callable[[], str | None], *, timeout: float, report_exit: bool = True) -> bool:
        """Start PostgreSQL as the data directory says (standby.signal...) unless it runs already;
        wait until it accepts connections. Returns False when it was running already.
        StartRefused when `may_start()` gives a reason; PostgresError when it does not come up (still
        recovering after `timeout` is not an error: the state stays `starting`). `report_exit=False`:
        the caller watches it and answers for its exit until `report_exits()`."""
        with self._lock:
            if self._child is not None and not self._child.exited.is_set():
                return False
            refusal = may_start()
            if refusal is not None:
                raise StartRefused(refusal)
            self._stop_stray()
            self._kill_leftovers()
            stale = postmaster.remove_stale_lock(self.pgdata)
            if stale is not None:
                log.warning(
                    "removed a stale postmaster.pid on %s (pid %d runs no PostgreSQL)", self.pgdata, stale
                )
            for lock in postmaster.remove_stale_socket_locks(self.pgdata, self.socket_dirs):
                log.warning("removed a stale socket lock %s (no PostgreSQL runs on %s)", lock, self.pgdata)
            child = self._spawn()
            child.report_exit = report_exit
        try:
            return self._wait_accepting(child, timeout)
        finally:
            with self._lock:
                child.starter_waiting = False

    def _wait_accepting(self, child: _Child, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if child.exited.is_set():
                if child.asked_to_stop:
                    raise StartRefused("it was stopped while starting")
                if child.accepted:
                    return True  # it started, then crashed before this wait looked: the crash is reported
                reason = last_fatal(self.log_file, child.log_offset)
                raise StartFailed(
                    f"PostgreSQL exited while starting on {self.pgdata} (exit {child.proc.returncode}): "
                    f"{reason or 'no FATAL line'}; last log lines: {_log_tail(self.log_file)}",
                    reason,
                )
            if pid_file_status(self.pgdata, child.proc.pid) in _ACCEPTING:
                with self._lock:
                    child.accepted = True
                    if child is self._child and self._state is PostmasterState.STARTING:
                        self._set(PostmasterState.RUNNING)
                return True
            time.sleep(_START_POLL)
        log.warning(
            "PostgreSQL on %s does not accept connections after %.0fs (still recovering?)",
            self.pgdata,
            timeout,
        )
        return True

    def _spawn(self) -> _Child:
        self.log_file.touch(exist_ok=True)
        give_to_pg(self.log_file)
        offset = self.log_file.stat().st_size
        with self.log_file.open("ab") as out:
            proc = pg_popen(
                [self.bins.postgres, "-D", str(self.pgdata)],
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # Its own session: a terminal's Ctrl-C reaches the agent only, which decides how to stop it.
                start_new_session=True,
            )
        child = _Child(proc, log_offset=offset)
        self._child = child
        self._set(PostmasterState.STARTING)
        log.info("PostgreSQL started on %s (pid %d)", self.pgdata, proc.pid)
        threading.Thread(target=self._watch, args=(child,), name="postmaster-watch", daemon=True).start()
        return child

    def _watch(self, child: _Child) -> None:
        code = child.proc.wait()
        with self._lock:
            # A killed postmaster leaves its postmaster.pid as it was: one that said it accepted connections
            # had started, whether or not its start looked in time.
            if pid_file_status(self.pgdata, child.proc.pid) in _ACCEPTING:
                child.accepted = True
            crashed = not child.asked_to_stop
            report = crashed and (child.accepted or not child.starter_waiting) and child.report_exit
            if child is self._child:
                self.last_exit = code
                self.exit_is_crash = report
                self._set(PostmasterState.CRASHED if crashed else PostmasterState.STOPPED)
            child.exited.set()
        if report:
            self._on_crash(code)

    def _stop_stray(self) -> None:
        """A postmaster this agent did not start (a previous agent's, killed without its child) runs on
        the data directory: stop it, so that the start below decides the role."""
        stray = postmaster.postmaster_pid(self.pgdata)
        if stray is None:
            return
        log.warning(
            "a PostgreSQL this agent did not start runs on %s (pid %d): stopping it", self.pgdata, stray
        )
        try:
            postmaster.stop(self.pgdata, bins=self.bins, mode="fast", timeout=30)
        except PostgresError:
            postmaster.kill(self.pgdata)

    def _kill_leftovers(self) -> None:
        """Processes of a dead postmaster still running on the data directory (its backends outlive a
        postmaster killed alone until they notice): they hold its shared memory, and PostgreSQL would
        refuse to start until they are gone. Being orphans of a dead server, they only do harm: kill them."""
        killed = postmaster.kill_leftovers(self.pgdata)
        if killed:
            log.warning(
                "killed %d process(es) a dead PostgreSQL left running on %s, which would keep it from "
                "starting: %s",
                len(killed),
                self.pgdata,
                "; ".join(f"pid {pid} ({title})" for pid, title in killed.items()),
            )

    # -- stop ---------------------------------------------------------------------------------------
    def stop(self, mode: str = "fast", *, timeout: float) -> bool:
        """Ask the child to stop (`smart`, `fast`, `immediate`); True once it is gone (also when it was
        not running), False if it is still there after `timeout`."""
        with self._lock:
            child = self._child
            if child is None or child.exited.is_set():
                return True
            child.asked_to_stop = True
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(_SIGNALS[mode])
        return child.exited.wait(timeout)

    def shutdown(self, *, stop_timeout: float) -> None:
        """Fast shutdown (clean: connected standbys receive everything), immediate after
        `stop_timeout`, SIGKILL of the whole process group if even that hangs."""
        if self.stop("fast", timeout=stop_timeout):
            return
        log.warning(
            "fast shutdown of %s did not finish in %.0fs: immediate shutdown", self.pgdata, stop_timeout
        )
        if self.stop("immediate", timeout=stop_timeout):
            return
        with self._lock:
            child = self._child
        if child is not None and not child.exited.is_set():
            log.error("PostgreSQL on %s ignores immediate shutdown: killing it", self.pgdata)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGKILL)
            child.exited.wait(10)


class OrphanReaper:
    """As PID 1 of a container the agent inherits every orphan (the backends of a killed postmaster, the
    shell of an archive_command whose parent died) and must reap them, or they stay zombies. Only zombies
    seen on two passes are reaped: the agent's own children (subprocess, the postmaster's watcher) are
    waited for at once by their owner, never left that long."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def reap(self, keep: int | None = None) -> int:
        zombies = {pid for pid, state in child_processes(os.getpid()).items() if state == "Z"}
        reaped = 0
        for pid in (zombies & self._seen) - {keep}:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
                reaped += 1
        self._seen = zombies
        return reaped


def stop_children(timeout: float = 10.0) -> list[int]:
    """SIGTERM this process's remaining children (a pg_basebackup or pg_rewind of an action cut short by
    the agent's exit) and wait for them, so that none outlives the agent writing into the data
    directory the next agent will find. Returns the pids signalled."""
    me = os.getpid()
    children = [pid for pid, state in child_processes(me).items() if state not in ("Z", "X")]
    for pid in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
        child_processes(me).get(pid) not in (None, "Z", "X") for pid in children
    ):
        time.sleep(0.05)
    return children
