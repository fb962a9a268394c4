"""The pgherd-owned settings file.

Settings the operator owns (port, listen_addresses, archiving, recovery, replication...) live in
`postgresql.pgherd.conf`, included at the end of postgresql.conf; user parameters stay in
postgresql.conf / postgresql.auto.conf. The file is rewritten whole and atomically.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path

from pgherd_backup.postgres.process import give_to_pg

PGHERD_CONF = "postgresql.pgherd.conf"
_INCLUDE = f"include_if_exists = '{PGHERD_CONF}'"
_HEADER = (
    "# Written by pgherd: operator-owned settings. Do not edit; user parameters go to postgresql.conf.\n"
)

Setting = str | int | float | bool

_RECOVERY_TARGETS = (
    "recovery_target",
    "recovery_target_time",
    "recovery_target_lsn",
    "recovery_target_xid",
    "recovery_target_name",
    "recovery_target_action",
    "recovery_target_inclusive",
)


def quote(value: Setting) -> str:
    """A value in postgresql.conf's syntax, where a backslash inside quotes starts an escape."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int | float):
        return str(value)
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == "'" and text[-1] == "'":
        return re.sub(r"''|\\(.)", lambda m: "'" if m.group(0) == "''" else m.group(1), text[1:-1])
    return text


def read_pgherd_conf(pgdata: Path | str) -> dict[str, str]:
    path = Path(pgdata) / PGHERD_CONF
    settings: dict[str, str] = {}
    if not path.exists():
        return settings
    for line in path.read_text().split("\n"):
        match = re.match(r"\s*([A-Za-z_.]+)\s*=\s*(.*?)\s*$", line)
        if match and not line.lstrip().startswith("#"):
            settings[match.group(1)] = _unquote(match.group(2))
    return settings


def _ensure_included(pgdata: Path) -> None:
    conf = pgdata / "postgresql.conf"
    text = conf.read_text() if conf.exists() else ""
    if _INCLUDE not in text:
        with conf.open("a") as handle:
            handle.write(f"\n# pgherd: operator-owned settings (keep this line last)\n{_INCLUDE}\n")
        give_to_pg(conf)


def write_pgherd_conf(pgdata: Path | str, settings: Mapping[str, Setting]) -> None:
    """Replace the pgherd settings of `pgdata` with `settings` (values as Python types)."""
    pgdata = Path(pgdata)
    body = _HEADER + "".join(f"{key} = {quote(value)}\n" for key, value in sorted(settings.items()))
    tmp = pgdata / (PGHERD_CONF + ".tmp")
    tmp.write_text(body)
    os.chmod(tmp, 0o600)
    give_to_pg(tmp)
    os.replace(tmp, pgdata / PGHERD_CONF)
    _ensure_included(pgdata)


def update_pgherd_conf(pgdata: Path | str, changes: Mapping[str, Setting | None]) -> dict[str, str]:
    """Set (or, with None, remove) some pgherd settings; returns the resulting settings."""
    current: dict[str, Setting] = dict(read_pgherd_conf(pgdata))
    for key, value in changes.items():
        if value is None:
            current.pop(key, None)
        else:
            current[key] = value
    write_pgherd_conf(pgdata, current)
    return read_pgherd_conf(pgdata)


def member_settings(
    port: int,
    *,
    listen_addresses: str = "127.0.0.1",
    socket_dir: str = "",
    archive_command: str | None = None,
    wal_keep_size: str = "512MB",
    extra: Mapping[str, Setting] | None = None,
) -> dict[str, Setting]:
    """The settings every pgherd member carries (replication-ready, rewind-ready)."""
    settings: dict[str, Setting] = dict(extra or {})  # what pgherd owns below wins
    settings |= {
        "port": port,
        "listen_addresses": listen_addresses,
        "unix_socket_directories": socket_dir,
        "wal_level": "replica",
        "hot_standby": True,
        "wal_log_hints": True,
        "max_wal_senders": 10,
        "max_replication_slots": 10,
        "wal_keep_size": wal_keep_size,
        "archive_mode": archive_command is not None,
    }
    if archive_command is not None:
        settings["archive_command"] = archive_command
    return settings


# PostgreSQL's placeholders in archive_command / restore_command: left bare, as whole arguments.
PLACEHOLDERS = frozenset({"%p", "%f", "%r"})


def shell_argument(value: str) -> str:
    """`value` as one argument of a command PostgreSQL runs: quoted for the shell, and every `%` doubled
    so that PostgreSQL's substitution gives back `value` exactly (a store path is a cluster editor's)."""
    return shlex.quote(value).replace("%", "%%")


def agent_command(executable: str, *args: str) -> str:
    """A shell command line invoking pgherd-backup, for archive_command / restore_command."""
    return " ".join(shell_argument(a) if a not in PLACEHOLDERS else a for a in (executable, *args))


def _store_flags(store: str | None, cluster: str | None) -> list[str]:
    """wal-push's and wal-fetch's flags; without them, $PGHERD_STORE and $PGHERD_CLUSTER."""
    return [*(["--store", store] if store else []), *(["--cluster", cluster] if cluster else [])]


def _service_answer(wal_service: str, route: str, curl_options: str) -> str:
    """The shell expansion of the WAL service's HTTP status for `/<route>/%f` of this data directory
    (empty when it does not answer). `%%` is PostgreSQL's escape for curl's literal `%{http_code}`."""
    return (
        f"$(curl -s -o /dev/null -w '%%{{http_code}}' {curl_options} --unix-socket "
        f'{shell_argument(wal_service)} "http://pgherd/{route}/%f?pgdata=$PWD" 2>/dev/null)'
    )


def archive_command(
    executable: str,
    store: str | None = None,
    cluster: str | None = None,
    *,
    wal_service: str | None = None,
) -> str:
    """`archive_command` through wal-push; store and cluster default to $PGHERD_STORE/$PGHERD_CLUSTER.

    With `wal_service` (pgherd_backup.walservice's Unix socket) the service pushes the file first, with
    its warm S3 connection: a primary's shutdown waits for the archiver, and wal-push's start-up alone
    was 0.1-0.2 s of every switchover. Only its 200 counts as archived; anything else (no service, no
    curl, a refusal) runs wal-push, which pushes or reports the problem as without the service.
    """
    push = agent_command(executable, "wal-push", *_store_flags(store, cluster), "%p")
    if not wal_service:
        return push
    return (
        f'test "{_service_answer(wal_service, "archive", "--max-time 60 -X POST")}" = 200 && exit 0; {push}'
    )


def restore_command(
    executable: str,
    store: str | None = None,
    cluster: str | None = None,
    *,
    wal_service: str | None = None,
    skip_archive: str | None = None,
) -> str:
    """`restore_command` through wal-fetch, with three shortcuts taken by the shell.

    - At every timeline switch a standby asks for the new timeline's history file several times,
      inside the write outage of a failover or switchover. Streaming replication has already written
      it into pg_wal, and a history file never changes (timeline ids are chosen so that the archive
      does not hold them yet): the local copy is used without starting the agent.
    - While the file `skip_archive` exists (a standby's only, for a moment: Instance.skip_archive),
      anything else is "not archived" without asking: a standby following a member's promotion gets
      the new timeline by streaming, and every question to the archive delays its switch.
    - With `wal_service` (the Unix socket of pgherd_backup.walservice), the service is asked first
      whether the archive holds the file at all; only its 404 answers "not archived" without starting
      the agent. Anything else (archived, no answer, no curl) runs wal-fetch as without the service.

    `%%` is PostgreSQL's escape for a literal `%` (curl's `%{http_code}`).
    """
    fetch = agent_command(executable, "wal-fetch", *_store_flags(store, cluster), "%f", "%p")
    steps = ['case %f in *.history) test -f pg_wal/%f && exec cp pg_wal/%f "%p";; esac']
    if skip_archive:
        steps.append(f"test -e {shell_argument(skip_archive)} && exit 1")
    if wal_service:
        steps.append(f'test "{_service_answer(wal_service, "wal", "--max-time 2")}" = 404 && exit 1')
    steps.append(fetch)
    return "; ".join(steps)


def _touch(path: Path) -> None:
    path.touch(mode=0o600)
    give_to_pg(path)


def write_standby_config(
    pgdata: Path | str,
    primary_conninfo: str,
    slot: str | None = None,
    restore_command: str | None = None,
) -> None:
    """Make `pgdata` start as a standby following `primary_conninfo` (standby.signal + settings)."""
    pgdata = Path(pgdata)
    changes: dict[str, Setting | None] = {
        "primary_conninfo": primary_conninfo,
        "primary_slot_name": slot,
        "recovery_target_timeline": "latest",
        **dict.fromkeys(_RECOVERY_TARGETS),
    }
    if restore_command is not None:
        changes["restore_command"] = restore_command
    update_pgherd_conf(pgdata, changes)
    (pgdata / "recovery.signal").unlink(missing_ok=True)
    _touch(pgdata / "standby.signal")


def clear_standby_config(pgdata: Path | str) -> None:
    """Forget the primary (the member will start as a primary: only the operator decides that)."""
    pgdata = Path(pgdata)
    update_pgherd_conf(pgdata, {"primary_conninfo": None, "primary_slot_name": None})
    (pgdata / "standby.signal").unlink(missing_ok=True)


def write_recovery_config(
    pgdata: Path | str,
    *,
    restore_command: str,
    target: Mapping[str, Setting] | None = None,
) -> None:
    """Targeted recovery from the archive, promoting at the end (recovery.signal + settings)."""
    pgdata = Path(pgdata)
    changes: dict[str, Setting | None] = {
        "restore_command": restore_command,
        "primary_conninfo": None,
        "primary_slot_name": None,
        "recovery_target_timeline": "latest",
        **dict.fromkeys(_RECOVERY_TARGETS),
    }
    if target:
        changes.update(target)
        changes["recovery_target_action"] = "promote"
    update_pgherd_conf(pgdata, changes)
    (pgdata / "standby.signal").unlink(missing_ok=True)
    _touch(pgdata / "recovery.signal")
