"""The engine's whole vocabulary towards the adapters: small, explicit, idempotent.

The adapter applies a Decision's actions in order, after writing the Decision's status. Each action
must be harmless to repeat (the engine re-issues a step until it observes its effect: promoting a
primary, fencing a fenced member, starting a job that already runs are no-ops). Every action carries a
``reason``, for events and logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pgherd.engine.quorum import SyncConfig


class Seed(StrEnum):
    INITDB = "initdb"  # the first member of a new cluster
    BASEBACKUP = "basebackup"  # pg_basebackup from ``source`` (the primary)
    SNAPSHOT = "snapshot"  # restore ``source`` (a Backup name or snapshot id), then follow the primary


@dataclass(frozen=True)
class CreateMember:
    """Create the member's pod/process and data; start it (as a replica of ``upstream`` when given).

    ``source``: the member to clone (Seed.BASEBACKUP), or the Backup whose snapshot to restore
    (Seed.SNAPSHOT; or ``snapshot_id``, a snapshot named in the store; neither: the newest). With
    Seed.SNAPSHOT and no upstream (bootstrap.fromBackup), replay to ``target`` and promote.
    """

    member: str
    ordinal: int
    seed: Seed
    revision: str
    source: str | None = None
    upstream: str | None = None
    target: str | None = None  # recovery target, as text: "time:<iso>", "lsn:<lsn>", "immediate"
    reason: str = ""
    snapshot_id: str | None = None


@dataclass(frozen=True)
class DeleteMember:
    """Delete the member's pod/process; drop its data volume only when ``keep_data`` is False."""

    member: str
    keep_data: bool = True
    reason: str = ""


@dataclass(frozen=True)
class RestartMember:
    """Restart PostgreSQL on the member with the spec of ``revision`` (image, parameters, resources).

    On kube: delete the pod (StatefulSet OnDelete recreates it at the new revision). It comes back
    read-only (a standby of its upstream), unless ``primary`` is set: the engine's explicit order to
    start this member, the recorded primary, read-write again (a planned in-place restart). A member
    never starts read-write on the platform's own initiative.
    """

    member: str
    revision: str
    primary: bool = False
    reason: str = ""


@dataclass(frozen=True)
class Fence:
    """Stop the member serving writes: remove it from the rw endpoint, stop PostgreSQL (a clean fast
    shutdown when reachable, so connected replicas receive all WAL; else kill/delete the pod) and
    keep it stopped until a Rejoin. Report ``fenced`` and, when readable, the final WAL end."""

    member: str
    reason: str = ""


@dataclass(frozen=True)
class Demote:
    """Start a fenced member read-only, as a standby with no upstream (standby.signal, no
    primary_conninfo), still fenced: it keeps its WAL and can be counted and chosen by a failover
    while no primary is available. No-op when it already runs as a standby."""

    member: str
    reason: str = ""


@dataclass(frozen=True)
class Unfence:
    """Start a fenced member again in the role it had (and its rw endpoint when it is the primary):
    resumes a primary whose switchover was abandoned before anything was promoted."""

    member: str
    reason: str = ""


@dataclass(frozen=True)
class Promote:
    """pg_promote() on a replica (a no-op when it is already primary); clears ``fenced``."""

    member: str
    reason: str = ""


@dataclass(frozen=True)
class SetPrimary:
    """Point the rw endpoint at the member (label pgherd.io/role=primary; remove it from the others)."""

    member: str
    reason: str = ""


@dataclass(frozen=True)
class SetSynchronousStandbys:
    """ALTER SYSTEM SET synchronous_standby_names = config.render(); reload. Applied to a replica right
    before its promotion, so that the new primary never acknowledges a commit alone."""

    member: str
    config: SyncConfig
    reason: str = ""


@dataclass(frozen=True)
class Rejoin:
    """Make the member a streaming replica of ``upstream``: re-point primary_conninfo; when its history
    diverged, pg_rewind, or re-clone when rewind fails or ``reclone`` is set. Data replaced by a
    re-clone is kept aside (moved, never deleted). Clears ``fenced``. ``ahead_of_promotion``: the
    upstream is about to be promoted (its agent skips the archive in the replica's timeline switch)."""

    member: str
    upstream: str
    reclone: bool = False
    reason: str = ""
    ahead_of_promotion: bool = False


@dataclass(frozen=True)
class DropReplicationSlot:
    """pg_drop_replication_slot(slot) on the primary ``member`` (slots are named after members)."""

    member: str
    slot: str
    reason: str = ""


@dataclass(frozen=True)
class StartSnapshot:
    """Start the snapshot Job of Backup ``backup`` over the replication protocol from ``member``."""

    backup: str
    member: str
    reason: str = ""


@dataclass(frozen=True)
class StartRestore:
    """Start the restore Job of ``restore`` into ``member`` (fenced): move its data directory aside
    (never delete it), fetch and verify ``snapshot`` (a Backup name, or ``snapshot_id``), replay archived
    WAL up to ``target`` and promote at the end, onto a new timeline."""

    restore: str
    member: str
    backup: str | None
    snapshot_id: str | None
    target: str | None
    reason: str = ""


@dataclass(frozen=True)
class CheckUpgrade:
    """The preflight of a major upgrade on the running primary ``member``: the new major's
    ``pg_upgrade --check`` against it and the room on its volume. Its agent reports how it ended under
    ``request_id`` (a repeated order with the same id starts nothing new)."""

    member: str
    major: int
    request_id: str
    reason: str = ""


@dataclass(frozen=True)
class UpgradeMember:
    """``pg_upgrade --link`` of the fenced, cleanly stopped primary ``member`` to ``major``, then its
    start read-write on the new major and the checks; reported under ``request_id``."""

    member: str
    major: int
    request_id: str
    reason: str = ""


@dataclass(frozen=True)
class CreateBackup:
    """Create a Backup object (scheduled backups); the engine then drives it like any other."""

    name: str
    reason: str = ""


@dataclass(frozen=True)
class UpdateBackup:
    """Write a Backup's status phase (and source member / error)."""

    name: str
    phase: str
    source_member: str | None = None
    error: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class UpdateRestore:
    """Write a Restore's status phase (and error, restored timeline, kept-aside data)."""

    name: str
    phase: str
    error: str | None = None
    restored_timeline: int | None = None
    reason: str = ""


@dataclass(frozen=True)
class Prune:
    """Apply retention to the store: delete snapshots beyond keep_last / older than keep_within, and
    the WAL older than the oldest kept snapshot."""

    keep_last: int | None
    keep_within: str | None
    reason: str = ""


@dataclass(frozen=True)
class RecordEvent:
    """A Kubernetes Event (or a local log line) on the cluster object."""

    reason: str
    message: str
    warning: bool = False


Action = (
    CreateMember
    | DeleteMember
    | RestartMember
    | Fence
    | Demote
    | Unfence
    | Promote
    | SetPrimary
    | SetSynchronousStandbys
    | Rejoin
    | DropReplicationSlot
    | StartSnapshot
    | StartRestore
    | CheckUpgrade
    | UpgradeMember
    | CreateBackup
    | UpdateBackup
    | UpdateRestore
    | Prune
    | RecordEvent
)
