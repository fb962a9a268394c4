"""pg_control: the system identifier and the state of a data directory."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from pgherd_backup.errors import PostgresError
from pgherd_backup.postgres.binaries import PgBinaries
from pgherd_backup.postgres.process import pg_run


def system_id_from_control(raw: bytes) -> str:
    """The database system identifier: the first 8 bytes of global/pg_control (native order)."""
    if len(raw) < 8:
        raise PostgresError("global/pg_control is truncated")
    return str(struct.unpack("=Q", raw[:8])[0])


def read_system_id(pgdata: Path) -> str:
    try:
        raw = (Path(pgdata) / "global" / "pg_control").read_bytes()[:8]
    except OSError as exc:
        raise PostgresError(
            f"cannot read {pgdata}/global/pg_control ({exc.strerror}): is {pgdata} a PostgreSQL data directory?"
        ) from None
    return system_id_from_control(raw)


@dataclass(frozen=True)
class ControlData:
    system_id: str
    state: str
    timeline: int
    checkpoint_lsn: str
    min_recovery_end_lsn: str
    raw: dict[str, str] = field(repr=False)

    @property
    def in_recovery(self) -> bool:
        return "recovery" in self.state

    @property
    def cleanly_shut_down(self) -> bool:
        return self.state in ("shut down", "shut down in recovery")


def read_controldata(pgdata: Path | str, bins: PgBinaries | None = None) -> ControlData:
    bins = bins or PgBinaries.find()
    result = pg_run([bins.pg_controldata, "-D", str(pgdata)], what="pg_controldata", env={"LC_ALL": "C"})
    raw: dict[str, str] = {}
    for line in result.stdout.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            raw[key.strip()] = value.strip()
    try:
        return ControlData(
            system_id=raw["Database system identifier"],
            state=raw["Database cluster state"],
            timeline=int(raw["Latest checkpoint's TimeLineID"]),
            checkpoint_lsn=raw["Latest checkpoint location"],
            min_recovery_end_lsn=raw.get("Minimum recovery ending location", "0/0"),
            raw=raw,
        )
    except (KeyError, ValueError) as exc:
        raise PostgresError(f"unexpected pg_controldata output for {pgdata}: missing {exc}") from None
