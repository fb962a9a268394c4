"""Observe a local member directly over psycopg, with short timeouts (never through readiness)."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from pgherd.agentview import parse_sync_standby_names
from pgherd.engine.lsn import parse_lsn
from pgherd.engine.quorum import SyncConfig

CONNECT_TIMEOUT = 1
STATEMENT_TIMEOUT_MS = 1500

_QUERY = """
SELECT pg_is_in_recovery(),
       CASE WHEN pg_is_in_recovery() THEN pg_last_wal_receive_lsn()::text
            ELSE pg_current_wal_lsn()::text END,
       CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()::text
            ELSE pg_current_wal_lsn()::text END,
       CASE WHEN pg_is_in_recovery() THEN NULL
            ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int END,
       (SELECT timeline_id FROM pg_control_checkpoint()),
       (SELECT status FROM pg_stat_wal_receiver),
       (SELECT received_tli FROM pg_stat_wal_receiver),
       (SELECT sender_port FROM pg_stat_wal_receiver),
       current_setting('synchronous_standby_names'),
       (SELECT coalesce(last_failed_time < last_archived_time, last_failed_time IS NULL)
          FROM pg_stat_archiver),
       (SELECT max(('x' || substr(name, 1, 8))::bit(32)::int) FROM pg_ls_waldir()
         WHERE name ~ '^[0-9A-F]{24}$')
"""


@dataclass(frozen=True)
class Observation:
    reachable: bool
    in_recovery: bool = False
    received_lsn: int | None = None
    replayed_lsn: int | None = None
    timeline: int | None = None
    receiver_streaming: bool = False
    sender_port: int | None = None
    sync: SyncConfig | None = None
    archiving_healthy: bool | None = None
    error: str = ""


def observe(dsn: str) -> Observation:
    """One round trip to one member; unreachable (with the reason) when it does not answer in time."""
    try:
        with psycopg.connect(
            dsn,
            connect_timeout=CONNECT_TIMEOUT,
            autocommit=True,
            options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS}",
        ) as conn:
            row = conn.execute(_QUERY).fetchone()
    except psycopg.Error as exc:
        return Observation(
            reachable=False, error=str(exc).strip().splitlines()[0] if str(exc) else type(exc).__name__
        )
    assert row is not None
    (
        in_recovery,
        received,
        replayed,
        wal_tli,
        checkpoint_tli,
        receiver,
        received_tli,
        sender_port,
        sync,
        archiving,
        waldir_tli,
    ) = row
    replayed_lsn = parse_lsn(replayed) if replayed else None
    received_lsn = parse_lsn(received) if received else replayed_lsn
    if in_recovery:
        # The newest timeline the replica holds WAL for: its receiver's, else the newest of its WAL
        # segments. Its last restartpoint (pg_control) may still be on an older one long after it followed
        # a promotion, and its receiver is gone when the primary is: exactly when the engine must know
        # which history it is on. Segments only: a history file of a newer timeline (fetched by its
        # walreceiver, or from the archive) is no evidence of being on it; a replica ahead of that
        # timeline's fork point stays on its own.
        timeline = max(t for t in (received_tli, checkpoint_tli, waldir_tli) if t is not None)
    else:
        timeline = wal_tli or checkpoint_tli
    return Observation(
        reachable=True,
        in_recovery=bool(in_recovery),
        received_lsn=received_lsn,
        replayed_lsn=replayed_lsn,
        timeline=timeline,
        receiver_streaming=receiver == "streaming",
        sender_port=sender_port,
        sync=parse_sync_standby_names(sync or ""),
        archiving_healthy=None if in_recovery else archiving,
    )
