"""Seed an empty data directory: initdb (a new cluster's first member), pg_basebackup from the
primary, or a snapshot from the object store."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from pgherd_backup.errors import UsageError
from pgherd_backup.manifest import Manifest
from pgherd_backup.postgres.binaries import PgBinaries
from pgherd_backup.postgres.config import (
    Setting,
    restore_command,
    update_pgherd_conf,
    write_pgherd_conf,
    write_recovery_config,
    write_standby_config,
)
from pgherd_backup.postgres.process import give_to_pg, make_pg_dir, pg_run
from pgherd_backup.store import Store


def is_empty(pgdata: Path) -> bool:
    return not pgdata.exists() or (pgdata.is_dir() and not any(pgdata.iterdir()))


def _require_empty(pgdata: Path, what: str) -> None:
    if not is_empty(pgdata):
        raise UsageError(
            f"cannot {what} into {pgdata}: the directory is not empty (move its content aside first)"
        )


def initdb(
    pgdata: Path | str,
    *,
    bins: PgBinaries | None = None,
    settings: Mapping[str, Setting] | None = None,
    superuser: str = "postgres",
    password: str | None = None,
    auth_local: str = "trust",
    auth_host: str = "trust",
    data_checksums: bool = True,
    locale: str = "C",
    encoding: str = "UTF8",
    hba_lines: Sequence[str] = (),
    wal_segsize_mb: int | None = None,
) -> None:
    """Create a new cluster in `pgdata` (the first member of a new cluster, or an upgrade's target)."""
    pgdata = Path(pgdata)
    bins = bins or PgBinaries.find()
    _require_empty(pgdata, "run initdb")
    make_pg_dir(pgdata)
    args = [
        bins.initdb,
        "-D",
        str(pgdata),
        "-U",
        superuser,
        "-E",
        encoding,
        f"--locale={locale}",
        f"--auth-local={auth_local}",
        f"--auth-host={auth_host}",
        "--no-instructions",
    ]
    if data_checksums:
        args.append("--data-checksums")
    if wal_segsize_mb is not None:
        args.append(f"--wal-segsize={wal_segsize_mb}")
    pwfile: str | None = None
    try:
        if password is not None:
            fd, pwfile = tempfile.mkstemp(prefix="pgherd-pw-", dir=str(pgdata.parent))
            with os.fdopen(fd, "w") as handle:
                handle.write(password + "\n")
            give_to_pg(Path(pwfile))
            args.append(f"--pwfile={pwfile}")
        pg_run(args, what="initdb", timeout=300)
    finally:
        if pwfile:
            with contextlib.suppress(OSError):
                os.unlink(pwfile)
    if hba_lines:
        with (pgdata / "pg_hba.conf").open("a") as handle:
            handle.write("\n# pgherd\n" + "".join(line + "\n" for line in hba_lines))
    write_pgherd_conf(pgdata, settings or {})


def basebackup_seed(
    pgdata: Path | str,
    primary_dsn: str,
    *,
    bins: PgBinaries | None = None,
    settings: Mapping[str, Setting] | None = None,
    primary_conninfo: str | None = None,
    slot: str | None = None,
    restore_command: str | None = None,
    timeout: float = 3600,
) -> None:
    """Clone the primary with pg_basebackup (WAL streamed alongside) and make the copy a standby of it.

    `settings` are this member's own pgherd settings (port...): the clone carries the primary's.
    """
    pgdata = Path(pgdata)
    bins = bins or PgBinaries.find()
    _require_empty(pgdata, "clone the primary")
    make_pg_dir(pgdata)
    args = [bins.pg_basebackup, "-d", primary_dsn, "-D", str(pgdata), "-X", "stream", "-c", "fast", "-w"]
    try:
        pg_run(args, what="pg_basebackup", timeout=timeout)
    except BaseException:
        for child in pgdata.iterdir():  # leave an empty directory, never a half copy
            if child.is_dir() and not child.is_symlink():
                import shutil

                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        raise
    if settings is not None:
        write_pgherd_conf(pgdata, settings)
    write_standby_config(pgdata, primary_conninfo or primary_dsn, slot=slot, restore_command=restore_command)


def snapshot_seed(
    pgdata: Path | str,
    store: Store,
    *,
    snapshot: str = "latest",
    system_id: str | None = None,
    settings: Mapping[str, Setting] | None = None,
    primary_conninfo: str | None = None,
    slot: str | None = None,
    agent: str | None = None,
) -> Manifest:
    """Restore a snapshot into `pgdata`; with `primary_conninfo` the member then starts as a standby
    (catching up from the archive, then streaming), otherwise it recovers the archive and promotes."""
    from pgherd_backup.catalog import find_snapshot
    from pgherd_backup.restore import agent_executable, restore_files

    pgdata = Path(pgdata)
    _require_empty(pgdata, "restore a snapshot")
    store.check()
    manifest = find_snapshot(store, snapshot, system_id=system_id)
    restore_files(store, manifest, pgdata)
    command = restore_command(agent or agent_executable(), store.location.url(), store.location.cluster)
    if settings is not None:
        write_pgherd_conf(pgdata, settings)
    if primary_conninfo:
        write_standby_config(pgdata, primary_conninfo, slot=slot, restore_command=command)
    else:
        write_recovery_config(pgdata, restore_command=command)
        update_pgherd_conf(pgdata, {"primary_conninfo": None})
    return manifest
