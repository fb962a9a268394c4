"""Start, stop, kill and promote a postmaster (pg_ctl, as the PostgreSQL account)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from pgherd_backup.errors import PostgresError
from pgherd_backup.postgres.binaries import PgBinaries
from pgherd_backup.postgres.process import child_processes, give_to_pg, pg_popen, pg_run, process_table


def default_log_file(pgdata: Path | str) -> Path:
    """The server log lives beside the data directory: never inside it, where snapshots would copy it."""
    pgdata = Path(pgdata)
    return pgdata.parent / f"{pgdata.name}.log"


def postmaster_pid(pgdata: Path | str) -> int | None:
    """The postmaster's pid when one is running on `pgdata`."""
    try:
        first = (Path(pgdata) / "postmaster.pid").read_text().split("\n", 1)[0]
        pid = int(first)
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def is_running(pgdata: Path | str) -> bool:
    return postmaster_pid(pgdata) is not None


def remove_stale_lock(pgdata: Path | str) -> int | None:
    """Remove postmaster.pid when no postmaster runs on `pgdata` (its pid is gone, or names another
    process: in a container made again, the old postmaster's pid is often a thread of the new agent,
    and PostgreSQL, which only asks whether that pid exists, then refuses to start: "lock file
    postmaster.pid already exists", at every restart). The pid it held, or None when there was none.
    Only for the member's own agent, which is the only process that starts PostgreSQL on this volume (a
    StatefulSet runs at most one pod of a member)."""
    lock = Path(pgdata) / "postmaster.pid"
    try:
        first = lock.read_text().split("\n", 1)[0]
    except OSError:
        return None
    if postmaster_pid(pgdata) is not None:
        return None
    lock.unlink(missing_ok=True)
    try:
        return int(first)
    except ValueError:
        return 0


def remove_stale_socket_locks(pgdata: Path | str, socket_dirs: Iterable[Path | str]) -> list[Path]:
    """Remove the lock files of PostgreSQL's Unix sockets (`.s.PGSQL.<port>.lock` in `socket_dirs`)
    that name `pgdata` while no postmaster runs on it: the same trap as postmaster.pid's (see
    remove_stale_lock), for a socket directory kept on the member's volume. A lock naming another data
    directory, or a pid that is a running postgres, is left alone. The locks removed."""
    if postmaster_pid(pgdata) is not None:
        return []
    ours = os.path.realpath(pgdata)
    removed = []
    for folder in socket_dirs:
        for lock in Path(folder).glob(".s.PGSQL.*.lock"):
            try:
                pid, data_dir = lock.read_text().split("\n")[:2]
            except (OSError, ValueError):
                continue
            if os.path.realpath(data_dir) != ours or (pid.strip().isdigit() and _alive(int(pid))):
                continue
            lock.unlink(missing_ok=True)
            removed.append(lock)
    return removed


def start(
    pgdata: Path | str,
    *,
    bins: PgBinaries | None = None,
    log_file: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
    wait: bool = True,
) -> None:
    """Start the postmaster; with `wait`, return once it accepts connections (standbys: once consistent)."""
    bins = bins or PgBinaries.find()
    log = Path(log_file) if log_file else default_log_file(pgdata)
    log.touch(exist_ok=True)
    give_to_pg(log)
    args = [bins.pg_ctl, "start", "-D", str(pgdata), "-l", str(log), "-t", str(int(timeout))]
    args.append("-w" if wait else "-W")
    result = pg_run(args, env=env, timeout=timeout + 15, check=False, what="pg_ctl start")
    if result.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-6:] if log.exists() else []
        raise PostgresError(
            f"PostgreSQL did not start on {pgdata} (pg_ctl exit {result.returncode}); last log lines: "
            + " | ".join(tail)
        )


def run_foreground(
    pgdata: Path | str, *, bins: PgBinaries | None = None, env: Mapping[str, str] | None = None
) -> int:
    """Run the postmaster in the foreground (container entrypoint); returns its exit status."""
    bins = bins or PgBinaries.find()
    proc = pg_popen([bins.postgres, "-D", str(pgdata)], env=env)

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, forward)
    return proc.wait()


def stop(
    pgdata: Path | str, *, bins: PgBinaries | None = None, mode: str = "fast", timeout: float = 60
) -> None:
    """Stop the postmaster (no-op when it is not running)."""
    if not is_running(pgdata):
        return
    bins = bins or PgBinaries.find()
    pg_run(
        [bins.pg_ctl, "stop", "-D", str(pgdata), "-m", mode, "-w", "-t", str(int(timeout))],
        timeout=timeout + 15,
        what="pg_ctl stop",
    )


def kill(pgdata: Path | str, *, timeout: float = 10) -> None:
    """SIGKILL the postmaster and its children: a crash (tests, fencing). Returns once they are gone."""
    pid = postmaster_pid(pgdata)
    if pid is None:
        return
    _kill_and_wait([pid, *child_processes(pid)], timeout)


def _kill_and_wait(pids: Iterable[int], timeout: float) -> None:
    """SIGKILL each of `pids`, then wait (at most `timeout`) until none of them runs."""
    victims = list(pids)
    for victim in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    for victim in victims:
        while _alive(victim) and time.monotonic() < deadline:
            time.sleep(0.02)


def leftovers(pgdata: Path | str) -> dict[int, str]:
    """The PostgreSQL processes still working in `pgdata` (their current directory, which every server
    process inherits from its postmaster) while no postmaster runs there: what a postmaster killed alone
    (SIGKILL, the OOM killer) leaves behind. Its backends notice its death only when they next wait, and
    one in a long query or a slow fsync runs on for seconds, keeping its shared memory attached: until
    they are gone, a new postmaster refuses to start ("pre-existing shared memory block ... is still in
    use"). pid -> its process title. Processes whose directory this process may not read are not seen."""
    if postmaster_pid(pgdata) is not None:
        return {}  # a running server's own processes
    try:
        data = os.stat(pgdata)
    except OSError:
        return {}
    found: dict[int, str] = {}
    for pid, entry in process_table().items():
        if entry.command not in ("postgres", "postmaster") or entry.state in ("Z", "X"):
            continue
        try:
            cwd = os.stat(f"/proc/{pid}/cwd")
            if (cwd.st_dev, cwd.st_ino) != (data.st_dev, data.st_ino):
                continue
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found[pid] = title.strip()
    return found


def kill_leftovers(pgdata: Path | str, *, timeout: float = 10) -> dict[int, str]:
    """SIGKILL the `leftovers` of a dead postmaster on `pgdata` and wait until they are gone (a process
    in uninterruptible I/O dies when the I/O ends; at most `timeout`). Returns the ones killed."""
    found = leftovers(pgdata)
    _kill_and_wait(found, timeout)
    return found


def _alive(pid: int) -> bool:
    """True while `pid` is a running postgres process: not a zombie waiting for its parent to reap it,
    not a thread of another process (/proc answers for thread ids too), not another program."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("Tgid", "").strip() != str(pid):
        return False  # a thread of another process
    command = stat[stat.index("(") + 1 : stat.rindex(")")]
    if command not in ("postgres", "postmaster"):
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] not in ("Z", "X")


def promote(pgdata: Path | str, *, bins: PgBinaries | None = None, timeout: float = 60) -> None:
    """Promote a standby (the operator's decision, never the member's own)."""
    bins = bins or PgBinaries.find()
    pg_run(
        [bins.pg_ctl, "promote", "-D", str(pgdata), "-w", "-t", str(int(timeout))],
        timeout=timeout + 15,
        what="pg_ctl promote",
    )


def reload(pgdata: Path | str, *, bins: PgBinaries | None = None) -> None:
    bins = bins or PgBinaries.find()
    pg_run([bins.pg_ctl, "reload", "-D", str(pgdata)], what="pg_ctl reload")
