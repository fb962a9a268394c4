"""Retention: which snapshots to keep (a pure decision), then the deletions that follow from it.

A snapshot is kept when it is among the `keep_last` newest or ended within `keep_within`; the
newest complete snapshot is always kept. WAL older than the oldest kept snapshot of a system id
is deleted (timeline history files are kept: they are tiny and recovery needs them to choose a
new timeline); so is the archive of a system id none of whose snapshots is kept.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from pgherd_backup.catalog import scan
from pgherd_backup.errors import UsageError
from pgherd_backup.layout import Layout
from pgherd_backup.manifest import Manifest, now_utc
from pgherd_backup.store import Store
from pgherd_backup.walnames import Segment, is_history, segment_number_of

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """`7d`, `12h`, `30m`, `1w2d`, or ISO 8601 `P7D` / `PT12H`."""
    spec = text.strip()
    iso = re.fullmatch(r"P(?:(\d+)W)?(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?)?", spec.upper())
    if iso and spec.upper() != "P":
        weeks, days, hours, minutes, seconds = (int(g or 0) for g in iso.groups())
        return timedelta(weeks=weeks, days=days, hours=hours, minutes=minutes, seconds=seconds)
    parts = re.findall(r"(\d+)\s*([smhdw])", spec.lower())
    if not parts or re.sub(r"\d+\s*[smhdw]", "", spec.lower()).strip():
        raise UsageError(f"invalid duration {text!r}: use e.g. 7d, 12h, 30m, 1w or P7D")
    return timedelta(seconds=sum(int(n) * _UNITS[u] for n, u in parts))


@dataclass(frozen=True)
class RetentionPlan:
    keep: tuple[Manifest, ...]
    delete: tuple[Manifest, ...]


def plan_retention(
    snapshots: list[Manifest],
    *,
    keep_last: int | None,
    keep_within: timedelta | None,
    now: datetime | None = None,
) -> RetentionPlan:
    """Pure: decide which snapshots to keep; never deletes the newest one."""
    if keep_last is None and keep_within is None:
        raise UsageError("give --keep-last and/or --keep-within: prune refuses to guess what to keep")
    if keep_last is not None and keep_last < 0:
        raise UsageError("--keep-last must be >= 0")
    now = now or now_utc()
    ordered = sorted(snapshots, key=lambda m: (m.stopped_at, m.id))
    keep_ids: set[str] = set()
    if ordered:
        keep_ids.add(ordered[-1].id)
    if keep_last:
        keep_ids.update(m.id for m in ordered[-keep_last:])
    if keep_within is not None:
        keep_ids.update(m.id for m in ordered if now - m.stopped_at <= keep_within)
    keep = tuple(m for m in ordered if m.id in keep_ids)
    delete = tuple(m for m in ordered if m.id not in keep_ids)
    return RetentionPlan(keep, delete)


@dataclass
class PruneReport:
    kept: list[str] = field(default_factory=list)
    deleted_snapshots: list[str] = field(default_factory=list)
    deleted_incomplete: list[str] = field(default_factory=list)
    deleted_wal: int = 0
    dry_run: bool = False

    def as_dict(self) -> dict[str, object]:
        return {
            "kept": self.kept,
            "deleted_snapshots": self.deleted_snapshots,
            "deleted_incomplete": self.deleted_incomplete,
            "deleted_wal_files": self.deleted_wal,
            "dry_run": self.dry_run,
        }


def prune(
    store: Store,
    *,
    keep_last: int | None,
    keep_within: timedelta | None,
    dry_run: bool = False,
    now: datetime | None = None,
) -> PruneReport:
    complete, incomplete = scan(store)
    plan = plan_retention(complete, keep_last=keep_last, keep_within=keep_within, now=now)
    report = PruneReport(kept=[m.id for m in plan.keep], dry_run=dry_run)
    doomed: list[str] = []
    for manifest in plan.delete:
        layout = Layout(store.location, manifest.system_id)
        # the manifest goes first: from then on the snapshot is never mistaken for a complete one
        doomed_snapshot = [layout.manifest_key(manifest.id)] + [
            info.key
            for info in store.list_objects(layout.snapshot_prefix(manifest.id))
            if info.key != layout.manifest_key(manifest.id)
        ]
        if not dry_run:
            store.delete(doomed_snapshot)
        report.deleted_snapshots.append(manifest.id)
    newest_complete = max((m.id for m in complete), default="")
    for leftover in incomplete:
        # incomplete snapshots newer than the newest complete one may still be running
        if leftover.id < newest_complete:
            layout = Layout(store.location, leftover.system_id)
            doomed.extend(info.key for info in store.list_objects(layout.snapshot_prefix(leftover.id)))
            report.deleted_incomplete.append(leftover.id)
    kept_by_system: dict[str, list[Manifest]] = {}
    for manifest in plan.keep:
        kept_by_system.setdefault(manifest.system_id, []).append(manifest)
    deleted_systems = {m.system_id for m in plan.delete}
    for system_id in deleted_systems | set(kept_by_system):
        layout = Layout(store.location, system_id)
        kept = kept_by_system.get(system_id)
        oldest = min((Segment.parse(m.start_wal).number for m in kept), default=None) if kept else None
        for info in store.list_objects(layout.wal_prefix):
            name = info.key[len(layout.wal_prefix) :]
            if is_history(name):
                continue
            number = segment_number_of(name)
            if number is None:
                continue
            if oldest is None or number < oldest:
                doomed.append(info.key)
                report.deleted_wal += 1
    if doomed and not dry_run:
        store.delete(doomed)
    return report
