"""What the adapters observed: the engine's only input besides the spec and its own recorded status.

Both adapters (kube, local) build the same ClusterView. Everything is plain, frozen data; LSNs are
integers (see ``pgherd.engine.lsn``) and time comes in as ``now`` so that the engine never reads a
clock. A field the adapter could not observe is None (unknown), never a guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from pgherd.engine.quorum import SyncConfig


class Role(StrEnum):
    PRIMARY = "primary"  # pg_is_in_recovery() = false
    REPLICA = "replica"  # pg_is_in_recovery() = true
    UNKNOWN = "unknown"  # not reachable, or not running


def member_name(cluster: str, ordinal: int) -> str:
    """Members are named like StatefulSet pods: ``<cluster>-<ordinal>``."""
    return f"{cluster}-{ordinal}"


@dataclass(frozen=True)
class ActionEnd:
    """How a member's last long action ended, as its agent reports it (``lastAction``)."""

    name: str
    request_id: str | None
    ok: bool
    error: str | None = None
    detail: str = ""


@dataclass(frozen=True)
class MemberView:
    """One member (pod / local PostgreSQL instance) as observed just now.

    ``exists``: the pod or process (and its data volume) exists at the platform level.
    ``reachable``: the operator could query PostgreSQL on it (psycopg, short timeout).
    ``received_lsn``: on a replica, the WAL received (pg_last_wal_receive_lsn, or the replay LSN when
    it has no receiver yet); on a primary, pg_current_wal_lsn; on a fenced member, its final WAL end
    when the adapter could read it (pg_controldata after a clean stop), else None.
    ``wal_receiver_streaming``: pg_stat_wal_receiver.status = 'streaming' (from ``upstream``).
    ``upstream_silence``: seconds since its upstream last said anything (kept by its agent after the
    receiver gave up on it); and ``upstream_heartbeat``: while streaming, the longest silence a live
    upstream allows (wal_receiver_timeout / 2, when the receiver asks it). A longer silence is a
    partition or a hung upstream: the receiver still says streaming until wal_receiver_timeout, yet
    nothing arrives. None: unknown (or never asked).
    ``revision``: the spec revision the member runs (see ``pgherd.engine.revision``).
    ``sync``: synchronous_standby_names in force on this member (meaningful on the primary).
    ``fenced``: the adapter was asked to fence it (out of the rw endpoint, being stopped); cleared by
    Rejoin. Not evidence by itself that it stopped: see ``stopped``.
    ``stopped``: the platform confirms that PostgreSQL does not run on the member (its process or pod
    is gone, or its agent reports the postmaster stopped). Never inferred from unreachability: an
    operator cut off from a member knows nothing of it.
    ``shutdown_clean``: for a stopped member, whether its last shutdown was clean (pg_control says
    "shut down" / "shut down in recovery"); None when unknown.
    ``held_lsn``: the most WAL the member provably holds on its ``timeline`` (the end of the last valid
    record in its pg_wal, at least its received and replayed LSN); for a stopped member its final WAL
    end. None when the adapter could not establish it: such a member never counts for a promotion's
    majority, and ranks only by what it provably received or replayed.
    ``data_present``: False only when the platform positively knows the member's data is gone (volume
    lost, data directory missing or empty). Unreachability is never evidence of lost data.
    ``kept_aside``: how many replaced data directories are kept aside on the member's volume.
    ``terminating``: its agent received SIGTERM (pod deletion, drain, eviction) and, being the primary,
    waits (bounded by the grace period) for the engine to switch over before it stops PostgreSQL.
    ``busy``: an action is being carried out on the member (its agent reports one in progress, or the
    platform awaits one it sent): its agent takes no other order until it ends.
    ``absent``: the platform knows that nothing of the member runs: no agent process, its pod deleted,
    not scheduled (its node gone, no room) or not started yet. Such a member cannot write, and may
    never come back: a recovery does not wait for it. An agent that is starting is not absent.
    """

    name: str
    ordinal: int
    exists: bool = True
    reachable: bool = False
    role: Role = Role.UNKNOWN
    timeline: int | None = None
    received_lsn: int | None = None
    replayed_lsn: int | None = None
    wal_receiver_streaming: bool = False
    upstream: str | None = None
    upstream_silence: float | None = None
    upstream_heartbeat: float | None = None
    ready: bool = False
    # The platform's own word on readiness (Kubernetes: the kubelet's Ready condition, which decides the
    # Services' endpoints); None where the platform has none (the sandbox routes at once).
    platform_ready: bool | None = None
    revision: str | None = None
    data_present: bool = True
    fenced: bool = False
    sync: SyncConfig | None = None
    stopped: bool = False
    shutdown_clean: bool | None = None
    held_lsn: int | None = None
    kept_aside: int = 0
    terminating: bool = False
    absent: bool = False
    busy: bool = False
    data_major: int | None = None  # the major of its data directory (PG_VERSION), also while stopped
    analyzing: bool = False  # statistics being rebuilt after a major upgrade
    # How its last long action ended (a restore, an upgrade check, an upgrade): its request id and error
    last_action: ActionEnd | None = None

    @property
    def most_wal(self) -> int | None:
        """The WAL position used to rank candidates: ``held_lsn`` when known, else the best of the
        received and replayed LSN (a floor: a restarted replica under-reports its received LSN)."""
        known = [lsn for lsn in (self.held_lsn, self.received_lsn, self.replayed_lsn) if lsn is not None]
        return max(known) if known else None

    @property
    def is_primary(self) -> bool:
        return self.reachable and self.role is Role.PRIMARY and not self.fenced

    def streams_from(self, primary: str) -> bool:
        return (
            self.reachable
            and self.role is Role.REPLICA
            and self.wal_receiver_streaming
            and (self.upstream == primary)
        )


class JobState(StrEnum):
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class JobKind(StrEnum):
    SNAPSHOT = "snapshot"  # named after its Backup
    RESTORE = "restore"  # named after its Restore (or the automatic recovery, see status.operation)


@dataclass(frozen=True)
class JobView:
    """A snapshot or restore Job (kube Job / local subprocess), keyed by kind and the name it serves.

    ``stage``: what a restore job reports it is doing: ``restoring`` (fetching the snapshot) or
    ``replaying`` (archived WAL up to the target).
    ``waiting_since``: for a running job none of whose current attempt has started (its pod not
    scheduled, its image not pulled, a Secret it needs missing, or still being created), since when it
    waits: that pod's creation, or the job's own when it has no pod at all; None once it started, and
    when the adapter cannot tell. ``waiting_reason``: why, as the platform says it (``pod X:
    CreateContainerConfigError: secret "s3" not found``).
    """

    kind: JobKind
    name: str
    state: JobState
    member: str | None = None
    stage: str | None = None
    message: str = ""
    backup_id: str | None = None
    timeline: int | None = None
    waiting_since: datetime | None = None
    waiting_reason: str = ""


@dataclass(frozen=True)
class BackupView:
    """A Backup object of this cluster: its recorded phase and, when started, its snapshot job.

    ``expired_at``: when retention deleted its snapshot (phase Expired: never restored, never ``latest``).
    """

    name: str
    phase: str = "Pending"  # pgherd.api.backup.BackupPhase value
    target: str = "preferStandby"  # pgherd.api.backup.BackupTarget value
    created_at: datetime | None = None
    completed_at: datetime | None = None
    backup_id: str | None = None
    source_member: str | None = None
    expired_at: datetime | None = None
    major: int | None = None  # the major the snapshot was taken from (status.postgresVersion)
    timeline: int | None = None  # the timeline it was taken on

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> BackupView:
        """The view of a Backup object (metadata, spec, status as the API server holds them)."""
        meta, status = obj.get("metadata") or {}, obj.get("status") or {}
        major = str(status.get("postgresVersion") or "").split(".", 1)[0]
        timeline = status.get("timeline")
        return cls(
            name=str(meta.get("name")),
            phase=status.get("phase") or "Pending",
            target=(obj.get("spec") or {}).get("target") or "preferStandby",
            created_at=parse_time(meta.get("creationTimestamp")),
            completed_at=parse_time(status.get("completedAt")),
            backup_id=status.get("backupId"),
            source_member=status.get("sourceMember"),
            expired_at=parse_time(status.get("expiredAt")),
            major=int(major) if major.isdigit() else None,
            timeline=timeline if isinstance(timeline, int) else None,
        )


def parse_time(value: Any) -> datetime | None:
    """A time as the API server writes it (RFC 3339, `Z`); None when absent or unreadable."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


@dataclass(frozen=True)
class RestoreView:
    """A Restore object of this cluster: what it asks for, its recorded phase and its job."""

    name: str
    backup: str | None = None
    snapshot_id: str | None = None
    target_time: str | None = None
    target_lsn: str | None = None
    target_immediate: bool = False
    phase: str = "Pending"  # pgherd.api.restore.RestorePhase value
    created_at: datetime | None = None


@dataclass(frozen=True)
class ClusterView:
    """Everything observed about one cluster at ``now``."""

    cluster: str
    now: datetime
    members: tuple[MemberView, ...] = ()
    backups: tuple[BackupView, ...] = ()
    restores: tuple[RestoreView, ...] = ()
    jobs: tuple[JobView, ...] = ()
    archiving_healthy: bool | None = None  # pg_stat_archiver on the primary: None when unknown
    archiving_error: str | None = None  # while it fails: why wal-push last failed, as the primary says
    deleting: bool = False
    generation: int | None = None
    switchover_to: str | None = None  # a user's request (annotation pgherd.io/switchover-to)
    # The member the rw endpoint selects now (the pod labelled pgherd.io/role=primary; the sandbox's
    # last SetPrimary); None when it selects none. Upkeep re-points it whenever it is not the primary:
    # an operator that crashed between recording a new primary and applying SetPrimary repairs it.
    rw_member: str | None = None
    # The members the rw endpoint routes to now (Kubernetes: the ready addresses of the -rw Service's
    # EndpointSlices); None where routing follows rw_member at once (the sandbox). Until it is the
    # primary alone the cluster is not Running: a client following the status would connect into nothing.
    rw_routes: frozenset[str] | None = None
    # The image the platform runs the members on for this spec (None: no image, the sandbox): part of
    # the spec revision (see pgherd.engine.revision).
    image: str | None = None
    # A person's word on a major upgrade (annotations pgherd.io/confirm-upgrade, rollback-upgrade,
    # retry-upgrade): the first two name the major the upgrade went to; the last is any new value.
    confirm_upgrade: str | None = None
    rollback_upgrade: str | None = None
    retry_upgrade: str | None = None
    # A person's request for a rolling restart (annotation pgherd.io/restart): part of the spec revision.
    restart: str | None = None
    _by_name: dict[str, MemberView] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {member.name: member for member in self.members})

    def member(self, name: str | None) -> MemberView | None:
        return None if name is None else self._by_name.get(name)

    def existing(self) -> list[MemberView]:
        return sorted((m for m in self.members if m.exists), key=lambda m: m.ordinal)

    def backup(self, name: str) -> BackupView | None:
        return next((b for b in self.backups if b.name == name), None)

    def job(self, kind: JobKind, name: str) -> JobView | None:
        return next((j for j in self.jobs if j.kind is kind and j.name == name), None)


def ordinal_of(name: str) -> int:
    """The ordinal of a member name (``<cluster>-<ordinal>``)."""
    return int(name.rsplit("-", 1)[1])
