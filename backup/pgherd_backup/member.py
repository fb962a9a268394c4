"""The instance entrypoint's decision: how to get a member's data directory ready to start.

empty + snapshot given      -> restore the snapshot (then standby of the primary, if given)
empty + primary given       -> pg_basebackup from the primary, standby of it
empty + new cluster         -> initdb (the first member of a brand-new cluster: the only one
                               that starts as a primary by itself)
existing + primary given    -> standby of it; an old primary (no standby.signal) is rewound
                               first, or re-cloned when pg_rewind fails
existing + no primary       -> start as it is (a standby stays a standby: a member never
                               promotes itself, the operator does)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pgherd_backup.errors import UsageError
from pgherd_backup.postgres.binaries import PgBinaries
from pgherd_backup.postgres.config import Setting, update_pgherd_conf, write_standby_config
from pgherd_backup.postgres.rewind import rejoin_as_standby
from pgherd_backup.postgres.seed import basebackup_seed, initdb, is_empty, snapshot_seed
from pgherd_backup.store import Store


@dataclass(frozen=True)
class SnapshotSource:
    store: Store
    snapshot: str = "latest"
    system_id: str | None = None


@dataclass(frozen=True)
class PreparedMember:
    action: str  # initdb | basebackup | snapshot | standby | rewind | reclone | none | existing
    pgdata: Path
    kept_aside: Path | None = None


def prepare_member(
    pgdata: Path | str,
    *,
    settings: Mapping[str, Setting],
    primary_dsn: str | None = None,
    primary_conninfo: str | None = None,
    new_cluster: bool = False,
    snapshot: SnapshotSource | None = None,
    slot: str | None = None,
    restore_command: str | None = None,
    bins: PgBinaries | None = None,
) -> PreparedMember:
    pgdata = Path(pgdata)
    bins = bins or PgBinaries.find()
    conninfo = primary_conninfo or primary_dsn
    if is_empty(pgdata):
        if snapshot is not None:
            snapshot_seed(
                pgdata,
                snapshot.store,
                snapshot=snapshot.snapshot,
                system_id=snapshot.system_id,
                settings=settings,
                primary_conninfo=conninfo,
                slot=slot,
            )
            return PreparedMember("snapshot", pgdata)
        if primary_dsn:
            basebackup_seed(
                pgdata,
                primary_dsn,
                bins=bins,
                settings=settings,
                primary_conninfo=conninfo,
                slot=slot,
                restore_command=restore_command,
            )
            return PreparedMember("basebackup", pgdata)
        if new_cluster:
            initdb(pgdata, bins=bins, settings=settings)
            return PreparedMember("initdb", pgdata)
        raise UsageError(
            f"{pgdata} is empty and there is nothing to seed it from: give a primary to clone, a snapshot, "
            "or --new-cluster for the first member of a new cluster"
        )
    update_pgherd_conf(pgdata, dict(settings))
    if not primary_dsn:
        return PreparedMember("existing", pgdata)
    if (pgdata / "standby.signal").exists():
        write_standby_config(pgdata, conninfo or primary_dsn, slot=slot, restore_command=restore_command)
        return PreparedMember("standby", pgdata)
    result = rejoin_as_standby(
        pgdata, primary_dsn, bins=bins, primary_conninfo=conninfo, slot=slot, restore_command=restore_command
    )
    return PreparedMember(result.method, pgdata, result.kept_aside)
