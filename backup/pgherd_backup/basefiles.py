"""The base backup's own files against its manifest: backup_label (where the backup starts) and
global/pg_control (whose cluster it is). Checked when a snapshot is taken the old way (from the tar
stream), by verify (from the tar stream) and by restore (from the restored directory)."""

from __future__ import annotations

import re

from pgherd_backup.errors import IntegrityError, PostgresError
from pgherd_backup.manifest import Manifest
from pgherd_backup.postgres.control import system_id_from_control
from pgherd_backup.walnames import parse_lsn

LABEL = "backup_label"
CONTROL = "global/pg_control"


def parse_label(label: bytes) -> tuple[str, str, int]:
    """backup_label's start LSN, start WAL file and timeline."""
    text = label.decode(errors="replace")
    start = re.search(r"START WAL LOCATION: ([0-9A-F]+/[0-9A-F]+) \(file ([0-9A-F]{24})\)", text)
    timeline = re.search(r"START TIMELINE: (\d+)", text)
    if not start or not timeline:
        raise IntegrityError("the base backup's backup_label is not understood: the snapshot is not usable")
    return start.group(1), start.group(2), int(timeline.group(1))


def check_base_files(manifest: Manifest, label: bytes | None, control: bytes | None, origin: str) -> None:
    """Raise IntegrityError unless the backup's backup_label and pg_control match the manifest."""
    if label is None or control is None:
        raise IntegrityError(
            f"{origin} lacks {LABEL if label is None else CONTROL}: snapshot {manifest.id} is not a usable "
            "base backup"
        )
    try:
        system_id = system_id_from_control(control)
    except PostgresError:
        raise IntegrityError(
            f"{origin} holds a truncated {CONTROL}: snapshot {manifest.id} is damaged"
        ) from None
    start_lsn, _wal, timeline = parse_label(label)
    if system_id != manifest.system_id:
        raise IntegrityError(
            f"{origin} holds the cluster {system_id}, not the {manifest.system_id} of snapshot {manifest.id}'s "
            "manifest: the snapshot is damaged"
        )
    if parse_lsn(start_lsn) != parse_lsn(manifest.start_lsn) or timeline != manifest.timeline:
        raise IntegrityError(
            f"{origin} starts at {start_lsn} on timeline {timeline}, not at {manifest.start_lsn} on timeline "
            f"{manifest.timeline} as snapshot {manifest.id}'s manifest says: the snapshot is damaged"
        )
