"""The engine's memory: what it recorded in the cluster status, handed back to it on the next call.

The engine keeps nothing between calls (no globals, no clock): timings such as when the primary was
first seen unreachable, the voters and the sync configuration of the quorum, and the multi-step
operation in progress all live here. The adapter writes the returned EngineStatus *before* applying
the actions (so an operation is recorded before its first step) and passes it back; a restarted
operator resumes from it and the next observation.

``to_dict``/``from_dict`` give the JSON form: ``operation`` maps to ``status.operation`` of the
PostgresCluster, the rest to ``status.engine`` (see docs/engine.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from enum import StrEnum
from typing import Any

from pgherd.engine.quorum import SyncConfig


class OperationKind(StrEnum):
    FAILOVER = "Failover"
    SWITCHOVER = "Switchover"
    ROLLOUT = "Rollout"
    SCALE_DOWN = "ScaleDown"
    RECOVERY = "Recovery"  # automatic, on quorum loss
    RESTORE = "Restore"  # asked by a Restore object
    MAJOR_UPGRADE = "MajorUpgrade"  # spec.postgresVersion rose (engine/upgrade.py)


@dataclass(frozen=True)
class Operation:
    """A multi-step operation: its plan, the steps done and where it stands.

    ``step`` names the step in progress (module-specific, e.g. "fence", "promote"), ``plan`` the ordered
    work (members to update or remove), ``done`` what is finished. ``failed`` is set when it was
    aborted: the record stays (and the phase is Failed) until the cause goes away (e.g. a new spec
    revision for a rollout).
    """

    kind: OperationKind
    started_at: datetime
    step: str = ""
    step_started_at: datetime | None = None
    source: str | None = None  # the primary when the operation began
    target: str | None = None  # the member to promote / restore into
    revision: str | None = None  # rollout: the revision rolled out
    plan: tuple[str, ...] = ()
    done: tuple[str, ...] = ()
    restore: str | None = None  # Restore object name
    backup: str | None = None  # Backup name to restore from
    snapshot_id: str | None = None
    recovery_target: str | None = None
    final_lsn: int | None = None  # switchover: the old primary's WAL end after its clean stop
    from_major: int | None = None  # major upgrade: the major the data is on, and the one it goes to
    to_major: int | None = None
    kept: str | None = None  # major upgrade: the replica kept on the old major, the way back
    retry: str | None = None  # major upgrade: the pgherd.io/retry-upgrade value it started under
    rollback: str | None = None  # major upgrade: why it is rolled back to ``kept``
    writes_stopped_at: datetime | None = None  # major upgrade: when the primary was told to stop
    reason: str = ""
    failed: str | None = None

    def at(self, step: str, now: datetime) -> Operation:
        """The same operation, moved to ``step`` (the step's clock starts now)."""
        if step == self.step:
            return self
        return replace(self, step=step, step_started_at=now)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if value is None or value == () or value == "":
                continue
            if isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, StrEnum):
                value = str(value)
            out[_camel(item.name)] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Operation:
        kwargs: dict[str, Any] = {}
        for item in fields(cls):
            key = _camel(item.name)
            if key not in data:
                continue
            value = data[key]
            if item.name in ("started_at", "step_started_at", "writes_stopped_at"):
                value = datetime.fromisoformat(value)
            elif item.name in ("plan", "done"):
                value = tuple(value)
            elif item.name == "kind":
                value = OperationKind(value)
            kwargs[item.name] = value
        return cls(**kwargs)


@dataclass(frozen=True)
class OldMajorKept:
    """After a major upgrade: ``member`` stays fenced on ``major``, untouched, the way back, until the
    upgrade to ``to_major`` is confirmed (or ``upgrade.keepOldMajorFor`` after ``since``)."""

    member: str
    major: int
    to_major: int
    since: datetime

    def to_dict(self) -> dict[str, Any]:
        return {
            "member": self.member,
            "major": self.major,
            "toMajor": self.to_major,
            "since": self.since.isoformat(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OldMajorKept:
        return cls(
            str(data["member"]),
            int(data["major"]),
            int(data["toMajor"]),
            datetime.fromisoformat(data["since"]),
        )


@dataclass(frozen=True)
class EngineStatus:
    """Everything the engine remembers about one cluster between two decisions."""

    initialized: bool = False  # the first primary came up (bootstrap done)
    complete: bool = False  # all the initial members were ready once (Creating is over)
    current_primary: str | None = None
    timeline: int | None = None
    voters: frozenset[str] = field(default_factory=frozenset)
    sync: SyncConfig | None = None  # last confirmed on the primary
    sync_pending: SyncConfig | None = None  # asked for, not yet observed
    # The primary's WAL position when ``sync`` was first observed in force: every commit acknowledged
    # under an earlier configuration lies below it. A member counts as a voter only once it has
    # received that much (see membership._quorum).
    sync_since_lsn: int | None = None
    primary_lost_since: datetime | None = None
    # Replicas voting that the primary failed, each since when it has reported at every observation
    # that it lost its WAL stream (see failover._votes).
    votes_since: dict[str, datetime] = field(default_factory=dict)
    quorum_lost_since: datetime | None = None
    last_scheduled_backup: datetime | None = None
    operation: Operation | None = None
    aborted: Operation | None = None  # the last aborted operation, reported until its cause is gone
    # Members a restore could not rebuild because they were absent (their pod not running, not
    # scheduled): they may hold data of the history the restore replaced, so each is re-cloned from the
    # primary (its data kept aside, never rewound) once it returns, and leaves this set once it streams.
    rebuild_pending: frozenset[str] = field(default_factory=frozenset)
    # The PostgreSQL major the cluster's data is on (the primary's data directory), once observed.
    major: int | None = None
    kept: OldMajorKept | None = None  # a replica kept on the old major after an upgrade
    # The pgherd.io/confirm-upgrade value that confirmed the last upgrade: it confirms no later one (a
    # new upgrade to the same major, after a restore brought the old one back) until it changes.
    confirmed: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "initialized": self.initialized,
            "complete": self.complete,
            "voters": sorted(self.voters),
        }
        for name in ("current_primary", "timeline", "sync_since_lsn", "major"):
            value = getattr(self, name)
            if value is not None:
                out[_camel(name)] = value
        for name in ("sync", "sync_pending"):
            config = getattr(self, name)
            if config is not None:
                out[_camel(name)] = config.to_dict()
        for name in ("primary_lost_since", "quorum_lost_since", "last_scheduled_backup"):
            moment = getattr(self, name)
            if moment is not None:
                out[_camel(name)] = moment.isoformat()
        if self.votes_since:
            out["votesSince"] = {
                name: self.votes_since[name].isoformat() for name in sorted(self.votes_since)
            }
        if self.operation is not None:
            out["operation"] = self.operation.to_dict()
        if self.aborted is not None:
            out["aborted"] = self.aborted.to_dict()
        if self.rebuild_pending:
            out["rebuildPending"] = sorted(self.rebuild_pending)
        if self.kept is not None:
            out["kept"] = self.kept.to_dict()
        if self.confirmed is not None:
            out["confirmed"] = self.confirmed
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineStatus:
        def moment(key: str) -> datetime | None:
            value = data.get(key)
            return None if value is None else datetime.fromisoformat(value)

        def config(key: str) -> SyncConfig | None:
            value = data.get(key)
            return None if value is None else SyncConfig.from_dict(value)

        operation = data.get("operation")
        aborted = data.get("aborted")
        return cls(
            initialized=bool(data.get("initialized", False)),
            complete=bool(data.get("complete", False)),
            current_primary=data.get("currentPrimary"),
            timeline=data.get("timeline"),
            voters=frozenset(data.get("voters", ())),
            sync=config("sync"),
            sync_pending=config("syncPending"),
            sync_since_lsn=data.get("syncSinceLsn"),
            primary_lost_since=moment("primaryLostSince"),
            votes_since={
                str(name): datetime.fromisoformat(when)
                for name, when in (data.get("votesSince") or {}).items()
            },
            quorum_lost_since=moment("quorumLostSince"),
            last_scheduled_backup=moment("lastScheduledBackup"),
            operation=None if operation is None else Operation.from_dict(operation),
            aborted=None if aborted is None else Operation.from_dict(aborted),
            rebuild_pending=frozenset(data.get("rebuildPending", ())),
            major=data.get("major"),
            kept=None if data.get("kept") is None else OldMajorKept.from_dict(data["kept"]),
            confirmed=data.get("confirmed"),
        )

    def possible_sync_configs(self) -> list[SyncConfig]:
        """The sync configurations that may be in force on the primary right now."""
        return [config for config in (self.sync, self.sync_pending) if config is not None]


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)
