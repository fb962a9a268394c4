"""`pgherd-backup`: the command line of the data plane (snapshots, WAL archive, restore, retention,
and the `instance` entrypoint that seeds and starts a member).

Expected failures print one line `pgherd-backup: error: ...` and exit non-zero; no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from pgherd_backup import __version__
from pgherd_backup.errors import BackupError, IntegrityError, ObjectMissing, UsageError

# exit status of wal-fetch for a damaged archived file: above 125, PostgreSQL treats it as fatal
# instead of "not archived", so a recovery never silently stops at a corrupted segment
FATAL_FOR_POSTGRES = 126


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's own usage errors: exit 2, like UsageError
        self.print_usage(sys.stderr)
        self.exit(2, f"pgherd-backup: error: {message}\n")


def _store_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("object store")
    group.add_argument(
        "--store", default=os.environ.get("PGHERD_STORE"), help="s3://bucket/path ($PGHERD_STORE)"
    )
    group.add_argument(
        "--cluster", default=os.environ.get("PGHERD_CLUSTER"), help="cluster name ($PGHERD_CLUSTER)"
    )
    group.add_argument("--system-id", default=None, help="PostgreSQL system identifier (default: found)")
    group.add_argument("--endpoint", default=None, help="S3 endpoint URL ($AWS_ENDPOINT_URL)")
    group.add_argument("--region", default=None, help="S3 region ($AWS_REGION)")
    group.add_argument(
        "--ca-bundle",
        default=None,
        metavar="PATH",
        help="verify an https endpoint with these CA certificates (PEM) alone, not the system's ($AWS_CA_BUNDLE)",
    )
    group.add_argument("--access-key-id", default=None, help="($AWS_ACCESS_KEY_ID; prefer the variable)")
    group.add_argument(
        "--secret-access-key", default=None, help="($AWS_SECRET_ACCESS_KEY; prefer the variable)"
    )


def _result_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--result-file",
        default=None,
        metavar="PATH",
        help="also write the JSON summary there, compact and within 4096 bytes (a Job's /dev/termination-log)",
    )


def _open_store(args: argparse.Namespace) -> Any:
    from pgherd_backup.store import S3Settings, Store, StoreLocation

    if not args.store:
        raise UsageError("no object store: pass --store s3://bucket/path or set PGHERD_STORE")
    if not args.cluster:
        raise UsageError("no cluster name: pass --cluster NAME or set PGHERD_CLUSTER")
    settings = S3Settings.from_env(
        endpoint_url=args.endpoint,
        region=args.region,
        ca_bundle=args.ca_bundle,
        access_key_id=args.access_key_id,
        secret_access_key=args.secret_access_key,
    )
    return Store(StoreLocation.parse(args.store, args.cluster), settings)


def _print_json(value: object) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")


# A Kubernetes termination message holds at most 4096 bytes: the operator reads a Job's result there.
RESULT_LIMIT = 4096


def result_document(value: dict[str, Any], limit: int = RESULT_LIMIT) -> str:
    """`value` as compact JSON of at most `limit` bytes. Lists too long to fit keep their newest
    (last) items, the number they had goes to `<key>_total` and `truncated` is true; scalars stay whole."""
    document = dict(value)

    def encoded() -> str:
        return json.dumps(document, sort_keys=True, separators=(",", ":"), default=str)

    text = encoded()
    while len(text.encode()) > limit:
        lists = [k for k, v in document.items() if isinstance(v, list) and v]
        if not lists:  # scalars alone too long: not a summary this module makes
            return json.dumps({"truncated": True})
        key = max(lists, key=lambda k: len(json.dumps(document[k], default=str)))
        items = document[key]
        document.setdefault(f"{key}_total", len(value[key]))
        document[key] = items[len(items) // 2 + 1 :] if len(items) > 1 else []
        document["truncated"] = True
        text = encoded()
    return text


def _emit(value: dict[str, Any], result_file: str | None) -> None:
    """The command's JSON summary on stdout and, with --result-file, compact and bounded in that file
    (a Job's /dev/termination-log: its result outlives the pod's logs)."""
    _print_json(value)
    if result_file:
        # The work is done: a result that cannot be written is reported, never a reason to fail (a Job
        # would take its snapshot again). The summary is on stdout as well.
        try:
            with open(result_file, "w", encoding="utf-8") as handle:
                handle.write(result_document(value))
        except OSError as exc:
            sys.stderr.write(f"pgherd-backup: warning: cannot write {result_file} ({exc.strerror})\n")


# -- backup commands ----------------------------------------------------------------------------


def cmd_snapshot(args: argparse.Namespace) -> int:
    from pgherd_backup.compression import Codec
    from pgherd_backup.postgres.sslkey import usable_sslkey
    from pgherd_backup.progress import Progress
    from pgherd_backup.snapshot import SnapshotOptions, take_snapshot

    if not args.source:
        raise UsageError("no source: pass --source DSN (a replication-capable connection string)")
    store = _open_store(args)
    options = SnapshotOptions(
        codec=Codec.get(args.compression, args.compression_level),
        compress_on=args.compress_on,
        compress_workers=args.compress_workers,
        object_size=args.object_size << 20,
        part_size=args.part_size << 20,
        upload_workers=args.upload_workers,
        max_inflight_parts=max(args.upload_workers + 2, 2),
        wal_method=args.wal_method,
        checkpoint=args.checkpoint,
        max_rate=args.max_rate,
        verify_checksums=not args.no_verify_checksums,
    )
    with usable_sslkey(args.source) as source:  # a mounted key libpq would refuse: a private copy
        manifest = take_snapshot(store, source, options=options, progress=Progress("snapshot"))
    summary = manifest.summary() | {"store": store.location.url()}
    if args.verify:
        summary |= verification(store, manifest)
    _emit(summary, args.result_file)
    return 0


def verification(store: Any, manifest: Any) -> dict[str, Any]:
    """`verified` (every object of the snapshot read back: sizes, checksums, decompression, the tar
    stream, backup_label and pg_control against the manifest) and, when false, `verify_error`. A
    snapshot that does not read back is complete but reported unverified, not retaken: the damage is in
    the store, and a person must see it (a Backup Completed with verified false and the error)."""
    from pgherd_backup.verify import verify_snapshot

    try:
        verify_snapshot(store, manifest)
    except IntegrityError as exc:
        return {"verified": False, "verify_error": exc.message}
    return {"verified": True}


def cmd_wal_push(args: argparse.Namespace) -> int:
    from pgherd_backup.compression import Codec
    from pgherd_backup.wal import ARCHIVE_FAILURE_VARIABLE, note_archive_outcome, push

    failure_file = os.environ.get(ARCHIVE_FAILURE_VARIABLE)
    try:
        store = _open_store(args)
        push(store, Path(args.path), system_id=args.system_id, codec=Codec.get(args.compression, threads=0))
    except BackupError as exc:
        note_archive_outcome(failure_file, exc.message)
        raise
    note_archive_outcome(failure_file, None)
    return 0


def cmd_wal_fetch(args: argparse.Namespace) -> int:
    from pgherd_backup.wal import fetch

    store = _open_store(args)
    try:
        fetch(store, args.name, Path(args.dest), system_id=args.system_id, prefetch=args.prefetch)
    except ObjectMissing:
        return 1  # not archived (yet): PostgreSQL probes for files that do not exist; stay quiet
    return 0


def _target(args: argparse.Namespace) -> Any:
    from pgherd_backup.manifest import parse_time
    from pgherd_backup.restore import RecoveryTarget

    moment = None
    if args.target_time:
        try:
            moment = parse_time(args.target_time)
        except ValueError:
            raise UsageError(
                f"invalid --target-time {args.target_time!r}: use ISO 8601 with a zone, "
                "e.g. 2025-01-31T12:00:00+00:00"
            ) from None
    return RecoveryTarget(time=moment, lsn=args.target_lsn, immediate=args.target_immediate)


def cmd_restore(args: argparse.Namespace) -> int:
    from pgherd_backup.progress import Progress
    from pgherd_backup.restore import RestoreOptions, restore

    target = _target(args)
    store = _open_store(args)
    options = RestoreOptions(download_workers=args.download_workers, sync=not args.no_sync)
    manifest = restore(
        store,
        Path(args.pgdata),
        snapshot=args.snapshot,
        system_id=args.system_id,
        target=target,
        options=options,
        progress=Progress("restore"),
    )
    _print_json(
        {
            "restored": manifest.id,
            "pgdata": str(Path(args.pgdata).absolute()),
            "system_id": manifest.system_id,
            "timeline": manifest.timeline,
            "target": target.settings() or "end of archive",
            "size": manifest.size,
        }
    )
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from pgherd_backup.catalog import list_snapshots
    from pgherd_backup.progress import human_bytes

    store = _open_store(args)
    store.check()
    snapshots = list_snapshots(store, args.system_id)
    if args.json:
        _print_json([m.summary() for m in snapshots])
        return 0
    rows = [("ID", "SYSTEM ID", "TL", "START LSN", "STOP LSN", "FINISHED (UTC)", "SIZE", "STORED", "FROM")]
    for m in snapshots:
        rows.append(
            (
                m.id,
                m.system_id,
                str(m.timeline),
                m.start_lsn,
                m.stop_lsn,
                m.stopped_at.strftime("%Y-%m-%d %H:%M:%S"),
                human_bytes(m.size),
                human_bytes(m.stored_size),
                m.source,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        sys.stdout.write(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() + "\n"
        )
    if not snapshots:
        sys.stdout.write(f"(no complete snapshot for cluster {store.location.cluster!r})\n")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from pgherd_backup.catalog import find_snapshot
    from pgherd_backup.progress import Progress
    from pgherd_backup.verify import verify_snapshot

    store = _open_store(args)
    store.check()
    manifest = find_snapshot(store, args.id, system_id=args.system_id)
    report = verify_snapshot(store, manifest, progress=Progress("verify"))
    _print_json(report.as_dict())
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    from pgherd_backup.retention import parse_duration, prune

    store = _open_store(args)
    store.check()
    within = parse_duration(args.keep_within) if args.keep_within else None
    report = prune(store, keep_last=args.keep_last, keep_within=within, dry_run=args.dry_run)
    _emit(report.as_dict(), args.result_file)
    return 0


# -- instance commands --------------------------------------------------------------------------


def _member_settings(args: argparse.Namespace) -> dict[str, Any]:
    from pgherd_backup.postgres.config import archive_command, member_settings
    from pgherd_backup.restore import agent_executable

    command = archive_command(agent_executable(), args.store, args.cluster) if args.archive else None
    return member_settings(
        args.port, listen_addresses=args.listen, socket_dir=args.socket_dir, archive_command=command
    )


def cmd_instance_seed(args: argparse.Namespace) -> int:
    from pgherd_backup.member import SnapshotSource, prepare_member

    snapshot = (
        SnapshotSource(_open_store(args), args.from_snapshot, args.system_id) if args.from_snapshot else None
    )
    prepared = prepare_member(
        Path(args.pgdata),
        settings=_member_settings(args),
        primary_dsn=args.primary,
        primary_conninfo=args.primary_conninfo,
        new_cluster=args.new_cluster,
        snapshot=snapshot,
        slot=args.slot,
    )
    _print_json(
        {"action": prepared.action, "pgdata": str(prepared.pgdata), "kept_aside": prepared.kept_aside}
    )
    if args.command_name == "run":
        from pgherd_backup.postgres.postmaster import run_foreground

        return run_foreground(Path(args.pgdata))
    return 0


def cmd_instance_start(args: argparse.Namespace) -> int:
    from pgherd_backup.postgres.postmaster import start

    start(Path(args.pgdata), log_file=args.log_file, wait=not args.no_wait, timeout=args.timeout)
    return 0


def cmd_instance_stop(args: argparse.Namespace) -> int:
    from pgherd_backup.postgres.postmaster import kill, stop

    if args.mode == "kill":
        kill(Path(args.pgdata))
    else:
        stop(Path(args.pgdata), mode=args.mode)
    return 0


def cmd_instance_promote(args: argparse.Namespace) -> int:
    from pgherd_backup.postgres.postmaster import promote

    promote(Path(args.pgdata))
    return 0


def cmd_instance_rejoin(args: argparse.Namespace) -> int:
    from pgherd_backup.postgres.rewind import rejoin_as_standby

    result = rejoin_as_standby(
        Path(args.pgdata), args.primary, slot=args.slot, allow_reclone=not args.no_reclone
    )
    _print_json({"method": result.method, "kept_aside": result.kept_aside})
    return 0


def cmd_instance_controldata(args: argparse.Namespace) -> int:
    from pgherd_backup.postgres.control import read_controldata

    data = read_controldata(Path(args.pgdata))
    _print_json(
        {
            "system_id": data.system_id,
            "state": data.state,
            "timeline": data.timeline,
            "checkpoint_lsn": data.checkpoint_lsn,
            "min_recovery_end_lsn": data.min_recovery_end_lsn,
        }
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pgherd-backup", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"pgherd-backup {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("snapshot", help="stream a physical base backup into the store")
    _store_options(p)
    p.add_argument("--source", default=os.environ.get("PGHERD_SOURCE"), help="DSN of the server to copy")
    p.add_argument("--compression", default="zstd", choices=["zstd", "lz4", "gzip", "none"])
    p.add_argument("--compression-level", type=int, default=None)
    p.add_argument("--upload-workers", type=int, default=4)
    p.add_argument("--part-size", type=int, default=8, help="multipart part size, MiB")
    p.add_argument(
        "--compress-on",
        default="auto",
        choices=["auto", "server", "client", "agent"],
        help="where to compress: the source server, pg_basebackup, or this agent (auto: server from "
        "PostgreSQL 15 on, else agent)",
    )
    p.add_argument(
        "--compress-workers", type=int, default=2, help="zstd threads on the server or in pg_basebackup"
    )
    p.add_argument(
        "--object-size",
        type=int,
        default=1024,
        help="MiB per stored object (compressed; uncompressed with --compress-on agent)",
    )
    p.add_argument("--wal-method", default="fetch", choices=["fetch", "none"])
    p.add_argument("--checkpoint", default="fast", choices=["fast", "spread"])
    p.add_argument("--max-rate", default=None, help="limit the read rate on the source, e.g. 100M")
    p.add_argument(
        "--no-verify-checksums",
        action="store_true",
        help="do not have the server verify page checksums while sending (faster, finds no corruption)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="read every object back once the snapshot is complete (as `verify` does); the summary says "
        "verified true, or false with verify_error",
    )
    _result_option(p)
    p.set_defaults(func=cmd_snapshot)

    p = sub.add_parser("wal-push", help="archive one WAL file (archive_command)")
    _store_options(p)
    p.add_argument("--compression", default="zstd", choices=["zstd", "lz4", "gzip", "none"])
    p.add_argument("path")
    p.set_defaults(func=cmd_wal_push)

    p = sub.add_parser("wal-fetch", help="restore one archived WAL file (restore_command)")
    _store_options(p)
    p.add_argument(
        "--prefetch",
        type=int,
        default=int(os.environ.get("PGHERD_WAL_PREFETCH", "8")),
        help="segments to download ahead, in parallel ($PGHERD_WAL_PREFETCH, default 8; 0 disables)",
    )
    p.add_argument("name")
    p.add_argument("dest")
    p.set_defaults(func=cmd_wal_fetch)

    p = sub.add_parser("restore", help="restore a snapshot into an empty data directory")
    _store_options(p)
    p.add_argument("--snapshot", default="latest")
    p.add_argument("--pgdata", required=True)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--target-time", default=None, help="ISO 8601 timestamp with a zone")
    target.add_argument("--target-lsn", default=None)
    target.add_argument("--target-immediate", action="store_true")
    p.add_argument("--download-workers", type=int, default=4)
    p.add_argument("--no-sync", action="store_true", help="skip the final sync to disk")
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("list", help="list the complete snapshots of the cluster")
    _store_options(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("verify", help="check a snapshot's manifest and every object")
    _store_options(p)
    p.add_argument("id", help="snapshot id or 'latest'")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("prune", help="delete old snapshots and the WAL they alone needed")
    _store_options(p)
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--keep-within", default=None, help="e.g. 7d, 12h, P7D")
    p.add_argument("--dry-run", action="store_true")
    _result_option(p)
    p.set_defaults(func=cmd_prune)

    instance = sub.add_parser("instance", help="seed, start and rejoin a PostgreSQL member")
    isub = instance.add_subparsers(dest="command_name", required=True, parser_class=_Parser)
    for name, helptext in (
        ("seed", "prepare the data directory"),
        ("run", "prepare, then run in the foreground"),
    ):
        p = isub.add_parser(name, help=helptext)
        _store_options(p)
        p.add_argument("--pgdata", required=True)
        p.add_argument("--port", type=int, default=5432)
        p.add_argument("--listen", default="127.0.0.1")
        p.add_argument("--socket-dir", default="")
        p.add_argument("--primary", default=None, help="DSN of the primary to clone and follow")
        p.add_argument(
            "--primary-conninfo", default=None, help="primary_conninfo, when it differs from --primary"
        )
        p.add_argument("--slot", default=None)
        p.add_argument("--new-cluster", action="store_true", help="first member of a new cluster: initdb")
        p.add_argument("--from-snapshot", default=None, help="seed from this snapshot id (or 'latest')")
        p.add_argument("--archive", action="store_true", help="archive WAL with wal-push")
        p.set_defaults(func=cmd_instance_seed)
    p = isub.add_parser("start", help="start the postmaster (pg_ctl)")
    p.add_argument("--pgdata", required=True)
    p.add_argument("--log-file", default=None)
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--no-wait", action="store_true")
    p.set_defaults(func=cmd_instance_start)
    p = isub.add_parser("stop", help="stop the postmaster")
    p.add_argument("--pgdata", required=True)
    p.add_argument("--mode", default="fast", choices=["smart", "fast", "immediate", "kill"])
    p.set_defaults(func=cmd_instance_stop)
    p = isub.add_parser("promote", help="promote a standby (the operator's decision)")
    p.add_argument("--pgdata", required=True)
    p.set_defaults(func=cmd_instance_promote)
    p = isub.add_parser("rejoin", help="make an old primary a standby again (pg_rewind, else re-clone)")
    p.add_argument("--pgdata", required=True)
    p.add_argument("--primary", required=True)
    p.add_argument("--slot", default=None)
    p.add_argument("--no-reclone", action="store_true")
    p.set_defaults(func=cmd_instance_rejoin)
    p = isub.add_parser("controldata", help="pg_control of a data directory, as JSON")
    p.add_argument("--pgdata", required=True)
    p.set_defaults(func=cmd_instance_controldata)
    return parser


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _one_malloc_arena() -> None:
    """glibc gives every thread that allocates its own heap arena and keeps freed blocks there: a
    restore's download and writer threads passing 8 MiB buffers around held ~70 MiB more than needed
    (an lz4 restore peaked at 187 MiB, 114 MiB with one arena, at the same speed).
    Large buffers are few, and small objects go through Python's own allocator: one arena costs no
    measurable contention. No-op where the C library is not glibc."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-8, 1)  # M_ARENA_MAX, before any thread starts


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.func in (cmd_restore, cmd_verify):  # not snapshot: its zstd workers then spent more CPU
        _one_malloc_arena()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        code: int = args.func(args)
        return code
    except IntegrityError as exc:
        sys.stderr.write(f"pgherd-backup: error: {exc.message}\n")
        return FATAL_FOR_POSTGRES if args.func is cmd_wal_fetch else exc.exit_code
    except BackupError as exc:
        sys.stderr.write(f"pgherd-backup: error: {exc.message}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("pgherd-backup: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
