"""What the sandbox's status file shows of a member: its agent's /status in the few fields `pgherd
sandbox status` prints (role, LSNs, lag, streaming, server version). The engine's own view of a member is
``pgherd.agentview.member_view`` of the same /status."""

from __future__ import annotations

from dataclasses import dataclass

from pgherd.agentview import parse_sync_standby_names
from pgherd.engine.quorum import SyncConfig
from pgherd_backup.agent.wire import Status, lsn_value


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
    archive_error: str | None = None  # while archiving fails: why wal-push last failed
    server_version: str | None = None  # MAJOR.MINOR of the running server, e.g. "16.15"


def observation(status: Status | None) -> Observation:
    """A member's Observation from its agent's /status (None: the agent did not answer)."""
    if status is None or status.role not in ("primary", "replica"):
        return Observation(False)
    sender_port = None
    if status.wal_receiver is not None and status.wal_receiver.upstream:
        _, _, port = status.wal_receiver.upstream.rpartition(":")
        sender_port = int(port) if port.isdigit() else None
    return Observation(
        reachable=True,
        in_recovery=status.role == "replica",
        received_lsn=lsn_value(status.received_lsn),
        replayed_lsn=lsn_value(status.replayed_lsn),
        timeline=status.timeline,
        receiver_streaming=status.streaming,
        sender_port=sender_port,
        sync=parse_sync_standby_names(status.synchronous_standby_names or ""),
        archiving_healthy=status.archiving_healthy,
        archive_error=status.archive_error,
        server_version=status.server_version,
    )
