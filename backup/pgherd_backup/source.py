"""What we ask the source server before a snapshot: its system id, timeline and version.

A replication connection (`replication=database`) and the simple query protocol, so the same
DSN and the same privileges as pg_basebackup suffice, on a primary or a standby.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pgherd_backup.errors import PostgresError


@dataclass(frozen=True)
class SourceInfo:
    system_id: str
    timeline: int
    xlogpos: str
    server_version: str
    in_recovery: bool | None = None  # reported by servers from 14 on (in_hot_standby)

    @property
    def major(self) -> int:
        """The server's major version (0 when unknown)."""
        match = re.match(r"\s*(\d+)", self.server_version)  # "15.8 (Debian ...)", "18devel", "17beta1"
        return int(match.group(1)) if match else 0


def replication_conninfo(dsn: str) -> str:
    from psycopg.conninfo import make_conninfo

    return make_conninfo(dsn, replication="database")


def identify(dsn: str, connect_timeout: int = 10) -> SourceInfo:
    from psycopg import pq

    conninfo = replication_conninfo(dsn)
    if "connect_timeout" not in conninfo:
        conninfo += f" connect_timeout={connect_timeout}"
    conn = pq.PGconn.connect(conninfo.encode())
    try:
        if conn.status != pq.ConnStatus.OK:
            message = conn.error_message.decode(errors="replace").strip().replace("\n", " ")
            raise PostgresError(f"cannot connect to the source server for a replication session: {message}")
        res = conn.exec_(b"IDENTIFY_SYSTEM")
        if res.status != pq.ExecStatus.TUPLES_OK:
            message = (res.error_message or b"").decode(errors="replace").strip()
            raise PostgresError(f"IDENTIFY_SYSTEM failed on the source server: {message}")
        values = [(res.get_value(0, i) or b"").decode() for i in range(3)]
        version_res = conn.exec_(b"SHOW server_version")
        version = (
            (version_res.get_value(0, 0) or b"").decode()
            if version_res.status == pq.ExecStatus.TUPLES_OK
            else ""
        )
        standby = conn.parameter_status(b"in_hot_standby")
        in_recovery = None if standby is None else standby == b"on"
        return SourceInfo(values[0], int(values[1]), values[2], version, in_recovery)
    finally:
        conn.finish()
