"""Run PostgreSQL programs as the account that owns the data: PostgreSQL refuses to run as root,
so when we are root everything runs as $PGHERD_PG_USER (default `postgres`) and the data
directories are chowned to it."""

from __future__ import annotations

import os
import pwd
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from pgherd_backup.errors import PostgresError


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    home: str


def pg_account() -> Account | None:
    """The account to switch to, or None when we already are unprivileged."""
    if os.geteuid() != 0:
        return None
    name = os.environ.get("PGHERD_PG_USER", "postgres")
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise PostgresError(
            f"running as root and the account {name!r} does not exist: PostgreSQL refuses to run as root; "
            "create it (scripts/ensure-postgres.sh) or set PGHERD_PG_USER"
        ) from None
    return Account(name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def owner_ids() -> tuple[int | None, int | None]:
    account = pg_account()
    return (account.uid, account.gid) if account else (None, None)


def give_to_pg(path: Path, *, recursive: bool = False) -> None:
    """chown `path` (and its tree) to the PostgreSQL account when we are root."""
    account = pg_account()
    if account is None:
        return
    os.chown(path, account.uid, account.gid)
    if recursive:
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                os.lchown(os.path.join(root, name), account.uid, account.gid)


def make_pg_dir(path: Path, mode: int = 0o700) -> None:
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    try:
        os.chmod(path, mode)
    except PermissionError:
        # A folder this process does not own keeps its mode as long as it lets us in: a Kubernetes
        # volume's mount point is root's, made writable for the pod by its fsGroup.
        if not os.access(path, os.W_OK | os.X_OK):
            raise
    give_to_pg(path)


def _environment(env: Mapping[str, str] | None, account: Account | None) -> dict[str, str]:
    merged = dict(os.environ)
    if account is not None:
        merged.update({"HOME": account.home or "/", "USER": account.name, "LOGNAME": account.name})
    if env:
        merged.update(env)
    return merged


def pg_run(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    check: bool = True,
    what: str | None = None,
    cwd: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL program as the PostgreSQL account; raise PostgresError on failure."""
    account = pg_account()
    try:
        result = subprocess.run(
            list(args),
            env=_environment(env, account),
            cwd=cwd or "/",
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            user=account.uid if account else None,
            group=account.gid if account else None,
            extra_groups=[] if account else None,
        )
    except subprocess.TimeoutExpired:
        raise PostgresError(f"{what or Path(args[0]).name} did not finish within {timeout:.0f}s") from None
    if check and result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()[-8:]
        raise PostgresError(
            f"{what or Path(args[0]).name} failed (exit {result.returncode}): " + " | ".join(detail)
        )
    return result


def pg_popen(
    args: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: object
) -> subprocess.Popen[bytes]:
    account = pg_account()
    if account is not None:
        kwargs.update({"user": account.uid, "group": account.gid, "extra_groups": []})
    kwargs.setdefault("cwd", "/")
    return subprocess.Popen(list(args), env=_environment(env, account), **kwargs)  # type: ignore[call-overload,no-any-return]


def grant_traverse(*paths: Path | str) -> list[Path]:
    """Let the PostgreSQL account reach `paths` (e.g. the Python running pgherd-backup, which
    archive_command and restore_command execute): add search permission (o+x, never read) to
    the directories above them that lack it. Only as root; returns the directories changed."""
    if pg_account() is None:
        return []
    changed: list[Path] = []
    for path in paths:
        for target in {Path(path).absolute(), Path(path).resolve()}:
            for directory in reversed(target.parents):
                mode = directory.stat().st_mode
                if not mode & 0o001:
                    os.chmod(directory, (mode & 0o7777) | 0o001)
                    changed.append(directory)
    return changed


class ProcessEntry(NamedTuple):
    ppid: int
    state: str  # the state letter (Z: a zombie)
    start: str  # start time in clock ticks since boot: with the pid, one process for sure
    command: str  # the executable's name (`postgres` for every server process, whatever its title)


def process_table() -> dict[int, ProcessEntry]:
    """Every process, from /proc: pid -> its parent, state, start time and command."""
    table: dict[int, ProcessEntry] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        command, rest = text[text.index("(") + 1 :].rsplit(")", 1)
        fields = rest.split()
        table[int(entry)] = ProcessEntry(int(fields[1]), fields[0], fields[19], command)
    return table


def child_processes(parent: int) -> dict[int, str]:
    """The processes whose parent is ``parent``, with their state letter (Z: a zombie), from /proc."""
    return {pid: p.state for pid, p in process_table().items() if p.ppid == parent}
