"""The major-version upgrade of a member's data, in place (POST /actions/upgrade).

Two orders, both long actions (answered 202 at once, followed in /status: `action`, `actionProgress`,
then `lastAction` with the order's `requestId`):

``check: true``  (the preflight, PostgreSQL running as the primary, writes going on): the new major's
                 programs are here; the volume has the room the upgrade needs (twice the catalogs, the
                 new cluster's WAL and a margin: `--link` copies no data file); a new cluster is made by
                 the new major's initdb beside the data directory (`<volume>/upgrade/pgdata-<major>`, with
                 the old one's encoding, locale, checksums and WAL segment size) and `pg_upgrade --check
                 --link` runs against the live server; then a CHECKPOINT, so that the clean stop's own
                 has little left, and (`archiving`) a wait until the archive holds every segment that
                 was waiting for it at that checkpoint: the clean stop then waits for the archiver no
                 more than for what was written since. An archiver that makes no progress for
                 ARCHIVE_STALL seconds fails the check. Nothing of the running cluster changes.
``check: false`` (PostgreSQL stopped cleanly, fenced): stages
    archiving    the segments the stop left waiting for the archiver (a fast shutdown cut short by
                 --stop-timeout leaves some) are archived from the old data directory, as its
                 archive_command would: the old major's archive ends where its WAL ends, and a snapshot of
                 the old major restores to its last write. An archive that cannot take them fails the
                 upgrade before anything changed.
    upgrading    `pg_upgrade --link` from the data directory into the new cluster (hard links: no data
                 file is copied). A failure here leaves the old data directory as it was (pg_control is
                 given back its name: the new server never ran).
    swapping     the member's configuration (pg_hba.conf, pg_ident.conf, postgresql.auto.conf without
                 synchronous_standby_names, pgherd's settings) goes into the new cluster; the old data
                 directory is moved to `<volume>/kept/<stamp>` (never deleted) and the new one takes its
                 place.
    starting     the new major's programs from now on; PostgreSQL starts read-write (the order says so:
                 the member was the primary) on its Unix socket alone, and is checked: a write commits,
                 every extension of every database is there, no setting of the configuration files is
                 refused. A failed check stops it and fences the member again: no client ever wrote on
                 it. Passed, it is started again for every client.
  Then the statistics are rebuilt in the background (`vacuumdb --all --analyze-in-stages`): /status
  says `analyzing` until it is done. The order's answer does not wait for it.

The stage is kept in the agent's state: a restarted agent finishes a swap, starts and checks an
upgraded data directory, and reports an upgrade it interrupted before the swap as failed (the new
cluster's files removed, the old data directory as it was).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from pgherd_backup.agent.instance import Busy, Instance, LongAction, Refused, StartRole
from pgherd_backup.agent.restoring import last_outcome, spawn
from pgherd_backup.agent.status import query_live
from pgherd_backup.agent.wire import ActionOutcome, ActionResult, UpgradeRequest
from pgherd_backup.errors import BackupError, PostgresError
from pgherd_backup.postgres.binaries import PgBinaries, data_major
from pgherd_backup.postgres.config import update_pgherd_conf
from pgherd_backup.postgres.control import read_controldata, read_system_id
from pgherd_backup.postgres.process import give_to_pg, make_pg_dir, pg_run
from pgherd_backup.postgres.seed import initdb

log = logging.getLogger("pgherd.agent")

CHECK = "upgrade-check"
UPGRADE = "upgrade"
CHECKING, UPGRADING, SWAPPING, STARTING = "checking", "upgrading", "swapping", "starting"
MARGIN = 64 * 1024 * 1024  # room beyond the estimate: the new cluster's first WAL segments, logs
# Configuration files the member's data directory carries over to the new major (postgresql.conf is
# the new major's own: its defaults; pgherd's settings and the user's parameters are included into it).
CARRIED = ("pg_hba.conf", "pg_ident.conf", "postgresql.auto.conf", "postgresql.pgherd.conf")
UPGRADE_TIMEOUT = 6 * 3600
ARCHIVE_STALL = 120.0  # seconds the check waits for an archiver that archives nothing
ARCHIVING = "archiving"

_requests = threading.Lock()


def request(inst: Instance, order: UpgradeRequest) -> ActionResult:
    """Start the check or the upgrade in its thread; or answer the state of the same order."""
    name = CHECK if order.check else UPGRADE
    key = (order.request_id, str(order.major), name)
    with _requests:
        running = inst.long_action
        if running is not None:
            if running.key == key:
                return ActionResult(
                    name, changed=False, in_progress=True, detail=f"in progress ({running.stage})"
                )
            raise Busy(f"busy: a {running.name} is in progress ({running.stage}); ask again when it is done")
        done = last_outcome(inst, name, order.request_id)
        if done is not None:
            if not done.ok:
                raise BackupError(f"{name} {order.request_id} failed: {done.error}")
            return ActionResult(name, changed=False, detail=done.detail, timeline=done.timeline)
        if order.major <= 0:
            raise Refused("an upgrade needs the major to upgrade to")
        inst.hold(name)
        try:
            token = inst.order()
            job = LongAction(name, key, request_id=order.request_id, target=str(order.major))
            job.stage = CHECKING if order.check else UPGRADING
            inst.long_action = job
            work = _check if order.check else _upgrade
            spawn(inst, job, lambda: work(inst, job, order.major, token), marker="upgrade", fail=failed)
        except BaseException:
            inst.long_action = None
            inst.release()
            raise
    log.warning("%s to PostgreSQL %d (%s)", name, order.major, order.reason or "no reason given")
    return ActionResult(
        name, in_progress=True, detail=f"{name} to PostgreSQL {order.major}: follow it in /status"
    )


# -- shared ---------------------------------------------------------------------------------------------


def _majors(inst: Instance, major: int) -> tuple[int, PgBinaries, PgBinaries]:
    """The data's major, its programs and the new major's; PostgresError naming what is missing."""
    old = data_major(inst.pgdata)
    if old is None:
        raise Refused(f"{inst.pgdata} holds no data to upgrade")
    if major <= old:
        raise Refused(f"the data is PostgreSQL {old}'s: an upgrade goes to a later major, not {major}")
    return old, PgBinaries.for_major(old), PgBinaries.for_major(major)


def upgrade_root(inst: Instance) -> Path:
    return inst.options.volume / "upgrade"


def new_pgdata(inst: Instance, major: int) -> Path:
    return upgrade_root(inst) / f"pgdata-{major}"


def _pg_upgrade(inst: Instance, old: PgBinaries, new: PgBinaries, target: Path, *, check: bool) -> None:
    work = upgrade_root(inst) / "work"
    make_pg_dir(work)
    port = inst.options.pg_port
    args = [
        new.path("pg_upgrade"),
        "-b", str(old.bindir),
        "-B", str(new.bindir),
        "-d", str(inst.pgdata),
        "-D", str(target),
        "-U", inst.options.superuser,
        "-s", str(inst.options.socket_dir),
        "-p", str(port),
        "-P", str(port + 1 if port != 65535 else port - 1),
        "--link",
    ]  # fmt: skip
    if check:
        args.append("--check")
    else:
        # The old server pg_upgrade starts to read its catalogs archives nothing (what the stop left
        # waiting was archived before, with its progress shown) and so its stop never waits for it.
        args += ["-j", str(max(1, min(8, os.cpu_count() or 1))), "--old-options", "-c archive_mode=off"]
    pg_run(args, what="pg_upgrade" + (" --check" if check else ""), cwd=str(work), timeout=UPGRADE_TIMEOUT)


def _facts(inst: Instance) -> dict[str, Any]:
    """What the new cluster must match or keep, read from the running server: the encoding and locale
    of template1, each database's extensions, the size of the catalogs (what pg_upgrade rewrites)."""
    with inst.connect(timeout=5, statement_timeout=60) as conn:
        row = conn.execute(
            "SELECT pg_encoding_to_char(encoding), datcollate FROM pg_database WHERE datname = 'template1'"
        ).fetchone()
        names = [r[0] for r in conn.execute("SELECT datname FROM pg_database WHERE datallowconn ORDER BY 1")]
    extensions: dict[str, list[str]] = {}
    catalogs = 0
    for name in names:
        with psycopg.connect(
            make_conninfo(inst.local_dsn(), dbname=name), autocommit=True, connect_timeout=5
        ) as conn:
            extensions[name] = [r[0] for r in conn.execute("SELECT extname FROM pg_extension ORDER BY 1")]
            size = conn.execute(
                "SELECT coalesce(sum(pg_total_relation_size(oid)), 0) FROM pg_class"
                " WHERE relnamespace = 'pg_catalog'::regnamespace AND relkind IN ('r', 'm')"
            ).fetchone()
            catalogs += int(size[0]) if size else 0
    encoding, locale = (row[0], row[1]) if row else ("UTF8", "C")
    return {"encoding": encoding, "locale": locale, "extensions": extensions, "catalogBytes": catalogs}


def _known_settings(inst: Instance, new: PgBinaries, major: int) -> None:
    """Every setting the member's configuration names (its parameters, postgresql.auto.conf) exists in
    the new major: one it removed (vacuum_defer_cleanup_age in 16, say) would stop the new server from
    starting after pg_upgrade, writes already stopped. Extensions' own (a dotted name) are not checked."""
    out = pg_run([new.postgres, "--describe-config"], what="postgres --describe-config", timeout=60).stdout
    known = {line.split("\t", 1)[0].lower() for line in out.splitlines() if line.strip()}
    names = set(inst.settings()) | set(_auto_conf(inst.pgdata))
    unknown = sorted(n for n in names if "." not in n and n.lower() not in known)
    if unknown:
        raise PostgresError(
            f"PostgreSQL {major} does not know these settings of the cluster: {', '.join(unknown)}; remove"
            " them (spec.parameters, or ALTER SYSTEM RESET) before the upgrade"
        )


def _auto_conf(pgdata: Path) -> list[str]:
    try:
        text = (pgdata / "postgresql.auto.conf").read_text()
    except OSError:
        return []
    names = []
    for line in text.splitlines():
        name, sep, _ = line.strip().partition("=")
        if sep and not name.startswith("#"):
            names.append(name.strip())
    return names


def _room(inst: Instance, facts: dict[str, Any]) -> str:
    """Refuse when the volume lacks the room: the new catalogs (twice, while pg_upgrade rewrites them)
    and a margin. The data files are hard links: they take no room."""
    needed = 2 * int(facts["catalogBytes"]) + MARGIN
    stat = os.statvfs(inst.options.volume)
    free = stat.f_bavail * stat.f_frsize
    mib = 1024 * 1024
    if free < needed:
        raise PostgresError(
            f"the volume has {free // mib} MiB free and the upgrade needs {needed // mib} MiB (twice the"
            f" catalogs, {int(facts['catalogBytes']) // mib} MiB, and {MARGIN // mib} MiB): grow the volume"
        )
    return f"{free // mib} MiB free, {needed // mib} MiB needed"


def _make_new(inst: Instance, old: PgBinaries, new: PgBinaries, major: int, facts: dict[str, Any]) -> Path:
    """The new major's empty cluster beside the data directory, as the old one was made."""
    target = new_pgdata(inst, major)
    if target.exists():
        shutil.rmtree(target)  # a previous attempt's: never the member's data (that is inst.pgdata)
    make_pg_dir(upgrade_root(inst))
    control = read_controldata(inst.pgdata, old)
    checksums = control.raw.get("Data page checksum version", "0") != "0"
    initdb(
        target,
        bins=new,
        superuser=inst.options.superuser,
        auth_local="trust",
        auth_host="trust",
        data_checksums=checksums,
        locale=str(facts.get("locale") or "C"),
        encoding=str(facts.get("encoding") or "UTF8"),
        wal_segsize_mb=_segment_mb(control.raw.get("Bytes per WAL segment")),
    )
    return target


def _segment_mb(raw: str | None) -> int | None:
    try:
        return int(raw or "") // (1024 * 1024) or None
    except ValueError:
        return None


# -- the check ------------------------------------------------------------------------------------------


def _check(inst: Instance, job: LongAction, major: int, token: int) -> ActionOutcome:
    old_major, old, new = _majors(inst, major)
    if inst.settings_snapshot()["fenced"] or inst.role() != "primary":
        raise Refused("the check runs against the running primary: this member is not one")
    _known_settings(inst, new, major)
    facts = _facts(inst)
    room = _room(inst, facts)
    target = _make_new(inst, old, new, major, facts)
    _pg_upgrade(inst, old, new, target, check=True)
    inst.record(upgrade_facts={**facts, "major": major})
    # A checkpoint now, writes going on: the one the clean stop makes, once writes stopped, then has
    # only what was written since (after a bulk load, minutes of fsync otherwise).
    with inst.connect(timeout=5, statement_timeout=UPGRADE_TIMEOUT) as conn:
        conn.execute("CHECKPOINT")
    archived = _archive_caught_up(inst, job)
    return _outcome(
        job,
        ok=True,
        detail=f"pg_upgrade --check from PostgreSQL {old_major} to {major} passed; {room}{archived}",
    )


def _waiting(pgdata: Path) -> set[str]:
    """The WAL files waiting for archive_command (their `.ready` marks in pg_wal/archive_status)."""
    try:
        marks = os.listdir(pgdata / "pg_wal" / "archive_status")
    except FileNotFoundError:
        return set()
    return {mark.removesuffix(".ready") for mark in marks if mark.endswith(".ready")}


def _archive_caught_up(inst: Instance, job: LongAction) -> str:
    """Wait until every segment waiting at the checkpoint is archived; `; ...` for the check's detail."""
    if not inst.options.store:
        return ""
    backlog = _waiting(inst.pgdata)
    if not backlog:
        return "; the archive is caught up"
    job.stage = ARCHIVING
    total, remaining = len(backlog), backlog
    progressed = time.monotonic()
    while remaining:
        time.sleep(0.5)
        still = remaining & _waiting(inst.pgdata)
        if len(still) < len(remaining):
            progressed = time.monotonic()
        elif time.monotonic() - progressed > ARCHIVE_STALL:
            raise Refused(
                f"the WAL archive is behind: {len(still)} of the {total} segments waiting at the check"
                f" were not archived, none in {ARCHIVE_STALL:.0f}s ({_archiver(inst)}): the upgrade"
                " waits for a working archive, so that the old major's archive holds all its WAL"
            )
        remaining = still
    return f"; the archive caught up ({total} segments)"


def _archiver(inst: Instance) -> str:
    """What pg_stat_archiver says of the archiver's last failure."""
    try:
        with inst.connect(timeout=5) as conn:
            row = conn.execute(
                "SELECT failed_count, last_failed_wal, last_failed_time::text FROM pg_stat_archiver"
            ).fetchone()
    except psycopg.Error as exc:
        return f"pg_stat_archiver unreadable: {str(exc).strip()}"
    if row is None or not row[0]:
        return "no archive_command failure reported"
    return f"archive_command failed {row[0]} times, last on {row[1]} at {row[2]}"


def _archive_rest(inst: Instance, job: LongAction) -> int:
    """Archive what the stop left waiting for the archiver, as archive_command would (wal-push), from
    the stopped old data directory; mark each done. The number archived."""
    waiting = sorted(_waiting(inst.pgdata))
    if not waiting or not inst.options.store:
        return 0
    from pgherd_backup.compression import Codec
    from pgherd_backup.wal import push

    job.stage = ARCHIVING
    store = inst.options.open_store()
    system_id = read_system_id(inst.pgdata)
    status = inst.pgdata / "pg_wal" / "archive_status"
    codec = Codec.get("zstd", threads=0)
    for name in waiting:
        try:
            push(store, inst.pgdata / "pg_wal" / name, system_id=system_id, codec=codec)
        except BackupError as exc:
            raise BackupError(
                f"the old major's archive could not take {name}, which the stop left unarchived: {exc}"
            ) from None
        os.replace(status / f"{name}.ready", status / f"{name}.done")
    log.warning("archived %d WAL files the stop had left waiting for the archiver", len(waiting))
    return len(waiting)


# -- the upgrade ----------------------------------------------------------------------------------------


def _upgrade(inst: Instance, job: LongAction, major: int, token: int) -> ActionOutcome:
    old_major, old, new = _majors(inst, major)
    state = inst.settings_snapshot()
    if not state["fenced"] or inst.postmaster.alive:
        raise Refused("the upgrade needs PostgreSQL stopped and the member fenced (writes stopped first)")
    control = read_controldata(inst.pgdata, old)
    if control.state != "shut down":
        raise Refused(
            f"the data directory was not shut down cleanly as a primary (pg_control: {control.state}):"
            " pg_upgrade needs a clean primary shutdown"
        )
    facts = dict(state.get("upgrade_facts") or {})
    if facts.get("major") != major:
        facts = {}
    _archive_rest(inst, job)
    job.stage = UPGRADING
    target = new_pgdata(inst, major)
    if not facts or data_major(target) != major:
        target = _make_new(inst, old, new, major, facts)
    inst.record(upgrade=_marker(job, old_major, target))
    try:
        _pg_upgrade(inst, old, new, target, check=False)
    except BaseException:
        _give_back(inst)
        raise
    job.stage = SWAPPING
    inst.record(upgrade=_marker(job, old_major, target))
    return _finish(inst, job, major, old_major, token, facts)


def _give_back(inst: Instance) -> None:
    """pg_upgrade stopped before the new server ever ran: the old data directory is whole; its
    pg_control, renamed by --link so that nothing starts it by mistake, gets its name back."""
    renamed = inst.pgdata / "global" / "pg_control.old"
    if renamed.exists() and not (inst.pgdata / "global" / "pg_control").exists():
        os.rename(renamed, inst.pgdata / "global" / "pg_control")
        log.warning("pg_upgrade did not finish: the old data directory %s is as it was", inst.pgdata)


def _finish(
    inst: Instance, job: LongAction, major: int, old_major: int, token: int, facts: dict[str, Any]
) -> ActionOutcome:
    """Swap (idempotent: a restarted agent repeats it), then start and check the new major."""
    target = new_pgdata(inst, major)
    if data_major(inst.pgdata) == old_major and data_major(target) == major:
        _carry_config(inst.pgdata, target)
        job.kept_aside = str(inst.keep_aside(inst.pgdata))
        os.rename(target, inst.pgdata)
    if data_major(inst.pgdata) != major:
        raise PostgresError(f"{inst.pgdata} is not PostgreSQL {major}'s after the swap")
    job.stage = STARTING
    inst.record(upgrade=_marker(job, old_major, target))
    inst.use_binaries(PgBinaries.for_major(major))
    try:
        inst.record(token, fenced=False, demoted=False, upstream=None, role_at_fence=None)
    except Refused:
        raise Refused(
            f"fenced during the upgrade: PostgreSQL {major}'s data is in place but was not started"
        ) from None
    # Checked on the Unix socket alone: no client may commit on the new major before it passed (a
    # rollback to the replica kept on the old major would lose that write). Then started for all.
    inst.start(StartRole.PRIMARY, token, local_only=True)
    try:
        checked = _verify(inst, facts)
    except BaseException:
        inst.fence_now()
        raise
    inst.stop(checkpoint=False)
    inst.start(StartRole.PRIMARY, token)
    live = query_live(inst)
    start_analyze(inst)
    return _outcome(
        job,
        ok=True,
        timeline=live.timeline if live is not None else None,
        detail=f"upgraded from PostgreSQL {old_major} to {major} by pg_upgrade --link; {checked}",
    )


def _carry_config(old: Path, new: Path) -> None:
    for name in CARRIED:
        source = old / name
        if not source.exists():
            continue
        text = source.read_text()
        if name == "postgresql.auto.conf":
            # The quorum's standbys are the engine's to set again once they follow the new major.
            text = "".join(
                line
                for line in text.splitlines(keepends=True)
                if not line.strip().lower().startswith("synchronous_standby_names")
            )
        (new / name).write_text(text)
        give_to_pg(new / name)
        os.chmod(new / name, 0o600)
    update_pgherd_conf(new, {})  # makes postgresql.conf include pgherd's settings


def _verify(inst: Instance, facts: dict[str, Any]) -> str:
    """The new primary accepts a write, has every extension it had, and refuses no setting."""
    inst.wait_accepting(inst.options.start_timeout)
    with inst.connect(timeout=5, statement_timeout=60) as conn:
        conn.execute("SET synchronous_commit = local")
        with conn.transaction():
            conn.execute("SELECT pg_current_xact_id()")
        refused = conn.execute(
            "SELECT name, error FROM pg_file_settings WHERE error IS NOT NULL ORDER BY name"
        ).fetchall()
    if refused:
        listed = ", ".join(f"{name} ({error})" for name, error in refused)
        raise PostgresError(f"the new major refuses settings of the configuration: {listed}")
    missing: list[str] = []
    for database, names in sorted((facts.get("extensions") or {}).items()):
        with psycopg.connect(
            make_conninfo(inst.local_dsn(), dbname=database), autocommit=True, connect_timeout=5
        ) as conn:
            have = {r[0] for r in conn.execute("SELECT extname FROM pg_extension")}
        missing += [f"{database}.{name}" for name in names if name not in have]
    if missing:
        raise PostgresError(f"extensions missing after the upgrade: {', '.join(missing)}")
    counted = sum(len(v) for v in (facts.get("extensions") or {}).values())
    return f"a write committed, {counted} extension(s) and every setting in place"


# -- statistics, in the background ---------------------------------------------------------------------


def start_analyze(inst: Instance) -> None:
    """vacuumdb --all --analyze-in-stages in a thread of its own: pg_upgrade carries no statistics;
    the first stage (minimal targets) gives the planner something within seconds."""

    def run() -> None:
        inst.analyzing = True
        try:
            pg_run(
                [inst.bins.path("vacuumdb"), "--all", "--analyze-in-stages", "-h", str(inst.options.socket_dir),
                 "-p", str(inst.options.pg_port), "-U", inst.options.superuser, "-j", "2"],
                what="vacuumdb --analyze-in-stages",
                timeout=UPGRADE_TIMEOUT,
            )  # fmt: skip
            log.info("statistics rebuilt after the upgrade (vacuumdb --analyze-in-stages)")
        except (BackupError, OSError) as exc:
            log.warning("rebuilding the statistics failed: %s", exc)
        finally:
            inst.analyzing = False

    threading.Thread(target=run, name="analyze", daemon=True).start()


# -- records ----------------------------------------------------------------------------------------------


def _marker(job: LongAction, old_major: int, target: Path) -> dict[str, Any]:
    return {
        "requestId": job.request_id,
        "major": int(job.target or 0),
        "fromMajor": old_major,
        "stage": job.stage,
        "newData": str(target),
        "keptAside": job.kept_aside,
        "startedAt": job.started_at,
    }


def _outcome(
    job: LongAction, *, ok: bool, detail: str, error: str | None = None, timeline: int | None = None
) -> ActionOutcome:
    return job.outcome(ok=ok, detail=detail, error=error, timeline=timeline)


def failed(inst: Instance, job: LongAction, error: str) -> ActionOutcome:
    """How a failed check or upgrade is reported. A started new major was fenced already (_finish)."""
    error = inst.credentials.redact(error)
    inst.last_error = f"{job.name}: {error}"
    log.error("%s to PostgreSQL %s failed (%s): %s", job.name, job.target, job.stage, error)
    if job.name == CHECK:
        detail = "nothing was changed"
    elif job.stage == UPGRADING:
        detail = "the old data directory is as it was; the member stays fenced"
    else:
        detail = "the member stays fenced" + (
            f"; the old data is kept in {job.kept_aside}" if job.kept_aside else ""
        )
    return _outcome(job, ok=False, error=error, detail=detail)


# -- a restarted agent ----------------------------------------------------------------------------------


def on_boot(inst: Instance) -> None:
    """An upgrade a previous agent left in progress is reported failed, and never started here: the
    engine may have moved on (a rollback to the replica kept on the old major) while no agent ran. Cut
    short in pg_upgrade: the new cluster's files are removed and the old data directory given back. Past
    pg_upgrade: the swap is finished (the old data directory kept aside), the new major not started."""
    marker = inst.settings_snapshot().get("upgrade")
    if not marker:
        return
    job = _job(marker)
    major = int(marker.get("major") or 0)
    target = Path(str(marker.get("newData") or new_pgdata(inst, major)))
    if job.stage == UPGRADING:
        if target.exists() and target != inst.pgdata:
            shutil.rmtree(target, ignore_errors=True)
        _give_back(inst)
        why = "interrupted: the agent stopped during pg_upgrade (the old data directory is as it was)"
    else:
        old_major = int(marker.get("fromMajor") or 0)
        if data_major(inst.pgdata) == old_major and data_major(target) == major:
            _carry_config(inst.pgdata, target)
            job.kept_aside = str(inst.keep_aside(inst.pgdata))
            os.rename(target, inst.pgdata)
        if inst.postmaster.alive:
            inst.fence_now()
        inst.record(fenced=True, demoted=False)
        why = (
            f"interrupted after pg_upgrade: the data directory is PostgreSQL {major}'s, not started; the"
            " member stays fenced"
        )
    outcome = failed(inst, job, why)
    inst.record(upgrade=None, last_action=outcome.to_dict())


def _job(marker: dict[str, Any]) -> LongAction:
    request_id = marker.get("requestId")
    major = str(marker.get("major") or "")
    job = LongAction(
        UPGRADE,
        (request_id, major, UPGRADE),
        request_id=request_id,
        target=major,
        stage=marker.get("stage"),
        kept_aside=marker.get("keptAside"),
    )
    job.started_at = marker.get("startedAt") or job.started_at
    return job
