"""Rejoin a member whose timeline diverged (an old primary after a failover) as a standby:
pg_rewind, or when that fails a fresh clone, the old directory kept aside (never deleted)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from pgherd_backup.errors import PostgresError
from pgherd_backup.postgres import postmaster
from pgherd_backup.postgres.binaries import PgBinaries
from pgherd_backup.postgres.config import read_pgherd_conf, write_pgherd_conf, write_standby_config
from pgherd_backup.postgres.process import pg_run
from pgherd_backup.postgres.seed import basebackup_seed

log = logging.getLogger(__name__)


class SourceUnreachable(PostgresError):
    """No connection to the primary to rewind from (down, refusing, or refusing us): a re-clone from it
    would fail the same way, after moving this member's data aside. The data stays in place."""


@dataclass(frozen=True)
class RejoinResult:
    method: str  # "rewind", "none" (nothing to rewind) or "reclone"
    kept_aside: Path | None = None
    detail: str = ""


def aside_path(pgdata: Path) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    candidate = pgdata.with_name(f"{pgdata.name}.pgherd-old-{stamp}")
    suffix = 1
    while candidate.exists():
        suffix += 1
        candidate = pgdata.with_name(f"{pgdata.name}.pgherd-old-{stamp}-{suffix}")
    return candidate


def _rename_aside(pgdata: Path) -> Path:
    kept = aside_path(pgdata)
    os.rename(pgdata, kept)
    return kept


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def connect_source(primary_dsn: str) -> psycopg.Connection[Any]:
    """A connection to the primary a rewind or a re-clone reads from; SourceUnreachable without one."""
    try:
        return psycopg.connect(primary_dsn, autocommit=True, connect_timeout=10)
    except psycopg.Error as exc:
        raise SourceUnreachable(f"no connection to the primary ({_first_line(exc)})") from None


def checkpoint_source(primary_dsn: str) -> None:
    """A freshly promoted primary records its new timeline in pg_control only at its next
    checkpoint; until then pg_rewind sees one timeline and wrongly says no rewind is required: without
    that CHECKPOINT no rewind is tried (PostgresError: the caller re-clones instead)."""
    conn = connect_source(primary_dsn)
    try:
        with conn:
            conn.execute("CHECKPOINT")
    except psycopg.Error as exc:
        raise PostgresError(
            f"could not run CHECKPOINT on the primary before pg_rewind: {_first_line(exc)}"
        ) from None


def rewind(pgdata: Path, primary_dsn: str, *, bins: PgBinaries, use_archive: bool) -> str:
    """Run pg_rewind (the target must be stopped); returns "rewind" or "none"; raises on failure."""
    checkpoint_source(primary_dsn)
    args = [bins.pg_rewind, f"--target-pgdata={pgdata}", f"--source-server={primary_dsn}", "--progress"]
    if use_archive:
        args.append("--restore-target-wal")
    result = pg_run(args, what="pg_rewind", timeout=3600)
    return "none" if "no rewind required" in (result.stdout + result.stderr) else "rewind"


def rejoin_as_standby(
    pgdata: Path | str,
    primary_dsn: str,
    *,
    bins: PgBinaries | None = None,
    primary_conninfo: str | None = None,
    slot: str | None = None,
    restore_command: str | None = None,
    allow_reclone: bool = True,
    keep_aside: Callable[[Path], Path] | None = None,
) -> RejoinResult:
    """Make `pgdata` a standby of `primary_dsn` again, keeping this member's own settings.

    `keep_aside(pgdata)` moves the data a re-clone replaces out of the way and returns where it went
    (default: beside `pgdata`); a platform passes its own to keep it where deleting the member's volume
    cannot reach it."""
    pgdata = Path(pgdata)
    bins = bins or PgBinaries.find()
    own = read_pgherd_conf(pgdata)  # pg_rewind and a clone both bring the primary's copy
    if postmaster.is_running(pgdata):
        try:
            postmaster.stop(pgdata, bins=bins, mode="fast", timeout=60)
        except PostgresError:
            postmaster.kill(pgdata)
    restore = restore_command or own.get("restore_command") or None
    conninfo = primary_conninfo or primary_dsn
    try:
        method = rewind(pgdata, primary_dsn, bins=bins, use_archive=bool(own.get("restore_command")))
    except SourceUnreachable:
        raise
    except PostgresError as exc:
        if not allow_reclone:
            raise
        connect_source(primary_dsn).close()  # gone since the rewind began: the data stays in place
        kept = keep_aside(pgdata) if keep_aside is not None else _rename_aside(pgdata)
        log.warning("pg_rewind failed (%s): cloning the primary again, old data kept in %s", exc, kept)
        basebackup_seed(
            pgdata,
            primary_dsn,
            bins=bins,
            settings=own,
            primary_conninfo=conninfo,
            slot=slot,
            restore_command=restore,
        )
        return RejoinResult("reclone", kept, str(exc))
    write_pgherd_conf(pgdata, own)
    write_standby_config(pgdata, conninfo, slot=slot, restore_command=restore)
    return RejoinResult(method)
