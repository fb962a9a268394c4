"""The documents the agent and its client exchange: the one place both sides share.

Every document is a frozen dataclass with `to_dict()` / `from_dict()`; JSON keys are camelCase
(`received_lsn` -> `receivedLSN`). LSNs travel as PostgreSQL prints them ("0/3000060"): `lsn_value`
turns one into an integer. `from_dict` ignores keys it does not know (a newer agent may say more) and
refuses a known key of the wrong type with a message naming it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar, Self

from pgherd_backup.walnames import format_lsn, parse_lsn

__all__ = [
    "ACTIONS",
    "ActionOutcome",
    "ActionProgress",
    "ActionResult",
    "CheckpointRequest",
    "DemoteRequest",
    "DropSlotRequest",
    "ErrorBody",
    "FenceRequest",
    "PromoteRequest",
    "RejoinRequest",
    "RestartRequest",
    "RestoreRequest",
    "SeedRequest",
    "SetSyncRequest",
    "Status",
    "UnfenceRequest",
    "UpgradeRequest",
    "WalReceiver",
    "WireError",
    "format_lsn",
    "lsn_value",
    "parse_lsn",
]


class WireError(ValueError):
    """A document does not have the shape its type says."""


def camel(name: str) -> str:
    """`received_lsn` -> `receivedLSN`, `last_crash_at` -> `lastCrashAt`."""
    head, *rest = name.split("_")
    return head + "".join("LSN" if part == "lsn" else part.capitalize() for part in rest)


def lsn_value(text: str | None) -> int | None:
    """An LSN of a document as an integer (None stays None)."""
    return None if text is None else parse_lsn(text)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check(value: Any, hint: Any, where: str) -> Any:
    """`value` converted to `hint` (nested documents, tuples), or WireError."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check(value, option, where)
            except WireError as exc:
                errors.append(str(exc))
        raise WireError(errors[0] if errors else f"{where}: must not be null")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise WireError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(hint)[:1]
        return tuple(_check(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(hint, type) and issubclass(hint, Wire):
        if not isinstance(value, Mapping):
            raise WireError(f"{where}: expected an object, got {type(value).__name__}")
        return hint.from_dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise WireError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise WireError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise WireError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise WireError(f"{where}: expected a string, got {value!r}")
        return value
    raise WireError(f"{where}: unsupported type {hint!r}")  # a programming error in this module


def _plain(value: Any) -> Any:
    if isinstance(value, Wire):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


class Wire:
    """to_dict / from_dict for the dataclasses below."""

    def to_dict(self) -> dict[str, Any]:
        assert dataclasses.is_dataclass(self)
        return {camel(f.name): _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        if not isinstance(data, Mapping):
            raise WireError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
        assert dataclasses.is_dataclass(cls)
        hints = _hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = camel(f.name)
            if key in data:
                values[f.name] = _check(data[key], hints[f.name], key)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise WireError(f"{cls.__name__}: {key} is required")
        return cls(**values)


# -- /status -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WalReceiver(Wire):
    """pg_stat_wal_receiver: `status` (streaming, waiting, ...), `upstream` as host:port.

    `silentSeconds`: since the last message from the upstream (last_msg_receipt_time); a live upstream
    answers within `heartbeatSeconds` even when idle (the receiver asks it at wal_receiver_timeout / 2),
    so a longer silence means a silent upstream before the receiver gives up on it at the timeout."""

    status: str | None = None
    upstream: str | None = None
    received_timeline: int | None = None
    silent_seconds: float | None = None
    heartbeat_seconds: float | None = None  # null: wal_receiver_timeout is 0 (the receiver never asks)


@dataclass(frozen=True)
class ActionProgress(Wire):
    """A long action in progress (restore). `stage`: restoring (the snapshot's files are fetched, checked
    and written) or replaying (PostgreSQL recovers archived WAL up to the target); `bytesDone` /
    `bytesTotal`: the snapshot's files written so far, of its size (null until known)."""

    name: str
    stage: str | None = None
    request_id: str | None = None
    snapshot: str | None = None  # the snapshot's id once resolved ("latest" until then)
    target: str | None = None
    bytes_done: int | None = None
    bytes_total: int | None = None
    started_at: str | None = None


@dataclass(frozen=True)
class ActionOutcome(Wire):
    """How the last long action ended (kept across the agent's restarts): `ok`, or the `error`."""

    name: str
    ok: bool
    request_id: str | None = None
    snapshot: str | None = None
    target: str | None = None
    error: str | None = None
    detail: str = ""
    timeline: int | None = None
    kept_aside: str | None = None
    started_at: str | None = None
    finished_at: str | None = None


@dataclass(frozen=True)
class Status(Wire):
    """GET /status. Role and LSNs come from SQL while PostgreSQL runs; from pg_controldata and the end of
    valid WAL in pg_wal (`heldLSN`, `finalLSN`, `shutdownClean`) while it is stopped. None: unknown."""

    member: str
    cluster: str
    role: str = "unknown"  # primary | replica | unknown
    postmaster: str = "stopped"  # running | stopped | crashed | starting
    postmaster_since: str | None = None  # ISO 8601, UTC
    ready: bool = False  # accepting in its role, a replica streaming (/readyz also keeps a replica that lost its upstream a moment ago)
    timeline: int | None = None
    received_lsn: str | None = None
    replayed_lsn: str | None = None
    flushed_lsn: str | None = None
    held_lsn: str | None = None  # the most WAL provably held (end of valid WAL in pg_wal at least)
    wal_receiver: WalReceiver | None = None
    upstream: str | None = None  # the configured upstream (a conninfo never carries a password here)
    # Seconds since its upstream last said anything: the receiver's while it streams; after the receiver
    # gave up on a silent upstream (wal_receiver_timeout), kept from its last stream. Null: unknown.
    upstream_silent_seconds: float | None = None
    fenced: bool = False
    demoted: bool = False  # fenced, but running read-only with no upstream (a Demote)
    data_present: bool = False
    kept_aside: tuple[str, ...] = ()
    revision: str | None = None
    pending_restart: bool | None = None
    synchronous_standby_names: str | None = None
    final_lsn: str | None = None  # when stopped: where its WAL ends
    shutdown_clean: bool | None = None  # when stopped: pg_control says "shut down" (in recovery or not)
    terminating: bool = False  # SIGTERM on a primary: waiting for the operator to switch over
    crashes: int = 0
    last_crash_at: str | None = None
    last_error: str | None = None
    action: str | None = None  # the action in progress
    action_progress: ActionProgress | None = None  # a long action's stage and bytes (restore)
    last_action: ActionOutcome | None = None  # how the last long action ended
    start_error: str | None = None  # why PostgreSQL did not start (its log's last FATAL line), until it does
    archiving_healthy: bool | None = None  # pg_stat_archiver on a primary
    archive_error: str | None = None  # while archiving fails: why wal-push last failed
    system_identifier: str | None = None
    server_version: str | None = None  # the running server's MAJOR.MINOR ("16.15"); null while stopped
    data_major: int | None = None  # the major the data directory belongs to (PG_VERSION), also stopped
    analyzing: bool = False  # statistics being rebuilt after a major upgrade (vacuumdb --analyze-in-stages)
    pg_port: int | None = None
    agent_version: str = ""

    @property
    def running(self) -> bool:
        return self.postmaster == "running"

    @property
    def stopped(self) -> bool:
        return self.postmaster == "stopped"

    @property
    def streaming(self) -> bool:
        return self.wal_receiver is not None and self.wal_receiver.status == "streaming"


# -- /actions/<name> -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Request(Wire):
    """Every action request may say why (logged by the agent)."""

    action: ClassVar[str]
    reason: str = ""


@dataclass(frozen=True)
class PromoteRequest(Request):
    action = "promote"


@dataclass(frozen=True)
class FenceRequest(Request):
    action = "fence"


@dataclass(frozen=True)
class DemoteRequest(Request):
    action = "demote"


@dataclass(frozen=True)
class UnfenceRequest(Request):
    """`primary`: start read-write again (only if it was the primary when fenced)."""

    action = "unfence"
    primary: bool = False


@dataclass(frozen=True)
class RejoinRequest(Request):
    """`upstream`: a libpq conninfo, or `host:port` of the member to follow. `aheadOfPromotion`: the
    upstream is about to be promoted (a running replica then switches timeline without the archive)."""

    action = "rejoin"
    upstream: str = ""
    reclone: bool = False
    ahead_of_promotion: bool = False


@dataclass(frozen=True)
class RestartRequest(Request):
    action = "restart"
    revision: str | None = None
    primary: bool = False


@dataclass(frozen=True)
class SetSyncRequest(Request):
    """synchronous_standby_names, e.g. `ANY 1 ("c-1", "c-2")`; "" for none."""

    action = "set-sync"
    value: str = ""


@dataclass(frozen=True)
class CheckpointRequest(Request):
    action = "checkpoint"


@dataclass(frozen=True)
class DropSlotRequest(Request):
    action = "drop-slot"
    slot: str = ""


@dataclass(frozen=True)
class SeedRequest(Request):
    """`method`: initdb | basebackup (from `upstream`) | snapshot (`snapshot` id or "latest"; with
    `upstream` it then follows it, without it recovers the archive to `target` and promotes).
    `target`: "time:<ISO 8601>", "lsn:<lsn>" or "immediate"."""

    action = "seed"
    method: str = ""
    upstream: str | None = None
    snapshot: str | None = None
    target: str | None = None


@dataclass(frozen=True)
class RestoreRequest(Request):
    """Restore a snapshot into this fenced member's own volume, in place: PostgreSQL stopped, the data
    directory moved to `<volume>/kept/<stamp>`, the snapshot (`snapshot`: an id, or "latest": with a
    time target the newest one ending before it) restored, archived WAL replayed to `target` (as
    SeedRequest's; none: the end of the archive), promoted onto a new timeline. Long: answered with
    202 at once, followed in /status. `requestId`: the caller's name for this restore (e.g. its Restore
    object): asked again with the id of the restore in progress or of the last one, the agent answers
    that restore's state and never starts another."""

    action = "restore"
    snapshot: str | None = None
    target: str | None = None
    request_id: str | None = None


@dataclass(frozen=True)
class UpgradeRequest(Request):
    """The major-version upgrade of this member's data to `major` (agent/upgrading.py). `check`: the
    preflight only (pg_upgrade --check against the running primary, the room on the volume); else the
    upgrade itself (PostgreSQL stopped cleanly, fenced): pg_upgrade --link, then the new major started
    read-write and checked. Long: answered with 202, followed in /status; `requestId` as RestoreRequest's."""

    action = "upgrade"
    major: int = 0
    check: bool = False
    request_id: str | None = None


ACTIONS: dict[str, type[Request]] = {
    cls.action: cls
    for cls in (
        PromoteRequest,
        FenceRequest,
        DemoteRequest,
        UnfenceRequest,
        RejoinRequest,
        RestartRequest,
        SetSyncRequest,
        CheckpointRequest,
        DropSlotRequest,
        SeedRequest,
        RestoreRequest,
        UpgradeRequest,
    )
}


@dataclass(frozen=True)
class ActionResult(Wire):
    """The answer of an action that is done. `changed`: False when there was nothing to do (every
    action is idempotent). `method`: how it was done (rejoin: repoint | rewind | none | reclone; seed:
    initdb | basebackup | snapshot). `inProgress`: the action goes on in the background (HTTP 202): follow
    it in /status (`action`, `actionProgress`) until `lastAction` says how it ended."""

    action: str
    ok: bool = True
    changed: bool = True
    detail: str = ""
    method: str | None = None
    final_lsn: str | None = None
    shutdown_clean: bool | None = None
    kept_aside: str | None = None
    timeline: int | None = None
    in_progress: bool = False


@dataclass(frozen=True)
class ErrorBody(Wire):
    """Any 4xx/5xx answer. `reason`: unauthorized | forbidden | bad-request | not-found | busy |
    refused (the member's state forbids it now) | failed (it was tried and did not work)."""

    error: str
    reason: str = "failed"
    action: str | None = None
