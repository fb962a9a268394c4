"""The snapshot manifest: written last, so a snapshot without one is never considered complete."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from pgherd_backup.errors import IntegrityError

LEGACY_FORMAT = 1  # one compressed frame (or run of frames) per object; every object's raw size known
STREAM_FORMAT = 2  # one compressed stream cut into objects; the raw size is the server's count, to the kB
FORMAT_VERSION = STREAM_FORMAT  # the newest format this version reads
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class Part:
    """One multipart-upload part of a data object (restore fetches parts by byte range)."""

    size: int
    sha256: str


@dataclass(frozen=True)
class DataObject:
    """One stored object: a slice of the base backup's compressed tar stream (format 2, raw_size 0),
    or a compressed frame holding a slice of the tar stream (format 1)."""

    name: str
    size: int
    raw_size: int
    sha256: str
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class Manifest:
    id: str
    cluster: str
    system_id: str
    timeline: int
    start_lsn: str
    stop_lsn: str
    start_wal: str
    stop_wal: str
    start_time: str
    stop_time: str
    pg_version: str
    pg_major: int
    compression: str
    source: str
    size: int
    stored_size: int
    objects: tuple[DataObject, ...]
    format: int = FORMAT_VERSION
    tool: str = "pgherd-backup"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def started_at(self) -> datetime:
        return parse_time(self.start_time)

    @property
    def stopped_at(self) -> datetime:
        return parse_time(self.stop_time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, origin: str = "manifest") -> Manifest:
        try:
            raw = json.loads(text)
            objects = tuple(
                DataObject(
                    name=o["name"],
                    size=int(o["size"]),
                    raw_size=int(o["raw_size"]),
                    sha256=o["sha256"],
                    parts=tuple(Part(int(p["size"]), p["sha256"]) for p in o["parts"]),
                )
                for o in raw.pop("objects")
            )
            if int(raw.get("format", 0)) > FORMAT_VERSION:
                raise IntegrityError(
                    f"{origin} has format {raw['format']}, newer than this pgherd-backup understands: "
                    "upgrade pgherd-backup"
                )
            known = set(cls.__dataclass_fields__)
            return cls(objects=objects, **{k: v for k, v in raw.items() if k in known})
        except IntegrityError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(
                f"{origin} is not a valid pgherd manifest ({exc}): the snapshot is unusable"
            ) from None

    def summary(self) -> dict[str, Any]:
        """The JSON summary printed by `snapshot` and `list --json` (no per-object detail)."""
        return {
            "id": self.id,
            "cluster": self.cluster,
            "system_id": self.system_id,
            "timeline": self.timeline,
            "start_lsn": self.start_lsn,
            "stop_lsn": self.stop_lsn,
            "start_wal": self.start_wal,
            "start_time": self.start_time,
            "stop_time": self.stop_time,
            "pg_version": self.pg_version,
            "compression": self.compression,
            "compressed_by": self.extra.get("compressed_by", "agent"),
            "source": self.source,
            "size": self.size,
            "stored_size": self.stored_size,
            "objects": len(self.objects),
        }


def now_utc() -> datetime:
    return datetime.now(UTC)


def format_time(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="microseconds")


def parse_time(text: str) -> datetime:
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        raise ValueError(f"timestamp {text!r} has no time zone")
    return moment


def snapshot_id(moment: datetime) -> str:
    """Sortable, unique to the millisecond: 20250101T120000123Z."""
    utc = moment.astimezone(UTC)
    return utc.strftime("%Y%m%dT%H%M%S") + f"{utc.microsecond // 1000:03d}Z"
