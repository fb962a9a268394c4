"""One function per action of POST /actions/<name>. Each is idempotent (a repeated order finds its
work done and answers `changed: false`), returns once done (restore alone answers at once and goes on
in its thread: restoring.py), and raises `Refused` (409) when the member's state forbids it, before
changing anything. Fence alone does not wait for an action in
progress: it stops PostgreSQL at once, and the gate (instance.py) keeps the slower action from starting
it again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from pgherd_backup.agent import restoring, upgrading
from pgherd_backup.agent.instance import Instance, Refused, StartRole, describe_upstream, upstream_params
from pgherd_backup.agent.isolation import isolated
from pgherd_backup.agent.seeding import seed_and_start
from pgherd_backup.agent.status import PRIMARY_TIMELINE, query_live
from pgherd_backup.agent.wire import (
    ActionResult,
    CheckpointRequest,
    DemoteRequest,
    DropSlotRequest,
    FenceRequest,
    PromoteRequest,
    RejoinRequest,
    Request,
    RestartRequest,
    SeedRequest,
    SetSyncRequest,
    UnfenceRequest,
    format_lsn,
)
from pgherd_backup.errors import PostgresError
from pgherd_backup.postgres.binaries import data_major
from pgherd_backup.postgres.config import update_pgherd_conf
from pgherd_backup.postgres.rewind import rejoin_as_standby
from pgherd_backup.postgres.seed import basebackup_seed, is_empty

log = logging.getLogger("pgherd.agent")

PROMOTE_WAIT = 60  # seconds pg_promote() waits for the end of recovery
PROMOTE_AGAIN = 0.05  # seconds between pg_promote() requests while recovery goes on
# A re-point ahead of a promotion: how long the replica's restore_command skips the archive, enough for
# the promotion and the switch that follows it; a replica that needs the archive meanwhile waits as long.
SKIP_ARCHIVE_SECONDS = 5.0
# How long a running replica may take to stream from a new upstream after a reload before a rejoin
# stops it and rewinds (its history diverged, or the upstream is not ready yet).
REPOINT_WAIT = 10.0
SYNC_APPLY_WAIT = 5.0
STEADY = 1.0  # a re-pointed receiver streams this long, unrestarted, before the rejoin says it follows


def _timeline(inst: Instance) -> int | None:
    live = query_live(inst)
    return live.timeline if live is not None else None


# -- promote ------------------------------------------------------------------------------------------


def promote(inst: Instance, request: PromoteRequest) -> ActionResult:
    """pg_promote(); a stopped member is started read-only with no upstream first. Clears the fence."""
    with inst.action("promote"):
        inst.use_archive()  # its new timeline must be one the archive does not hold: ask it
        token = inst.order()
        if not inst.data_present():
            raise Refused("no data directory to promote: seed the member first")
        changed = False
        timeline: int | None = None
        if not inst.postmaster.alive:
            changed = inst.start(StartRole.STANDBY, token, upstream=None, may_start_fenced=True)
        if inst.wait_accepting(inst.options.start_timeout) == "replica":
            inst.check(token, may_start_fenced=True)
            with inst.connect(timeout=2, statement_timeout=PROMOTE_WAIT + 5) as conn:
                if not end_recovery(conn, PROMOTE_WAIT):
                    raise PostgresError(
                        f"the promotion of {inst.options.member} did not finish within {PROMOTE_WAIT}s: "
                        f"see the PostgreSQL log {inst.options.log_file}"
                    )
                # On this connection: the operator routes writes once it has the answer, and /status's
                # query on a new one took up to 0.1 s beside the promotion's first checkpoint.
                row = conn.execute(f"SELECT {PRIMARY_TIMELINE}").fetchone()
                timeline = int(row[0]) if row is not None else None
            changed = True
        inst.record(token, fenced=False, demoted=False, upstream=None, role_at_fence=None)
        update_pgherd_conf(inst.pgdata, {"primary_conninfo": None, "primary_slot_name": None})
        if changed:
            log.info("promoted (%s)", request.reason or "no reason given")
        return ActionResult(
            "promote",
            changed=changed,
            detail="promoted" if changed else "already the primary",
            timeline=timeline if timeline is not None else _timeline(inst),
        )


def end_recovery(conn: psycopg.Connection[Any], timeout: float) -> bool:
    """pg_promote(false), asked again every PROMOTE_AGAIN until recovery has ended (True) or ``timeout``
    passed. pg_promote(wait => true) looks every 100 ms, which a failover's write outage would include.
    PostgreSQL's startup process may take a request and then sleep out `wal_retrieve_retry_interval`
    (one that lands while a WAL receiver is being started): the next request wakes it. A request made as
    recovery ends leaves a promote file, which the postmaster removes at its next start."""
    asked: float | None = None

    def ended() -> bool:
        nonlocal asked
        row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        if row is not None and not row[0]:
            return True
        if asked is None or time.monotonic() - asked >= PROMOTE_AGAIN:
            try:  # asked only in recovery: a refusal is an ERROR in PostgreSQL's log
                conn.execute("SELECT pg_promote(false) WHERE pg_is_in_recovery()")
            except pg_errors.ObjectNotInPrerequisiteState:  # recovery ended between the two
                return True
            asked = time.monotonic()
        return False

    return _wait(ended, timeout, every=0.005)


# -- fence / demote / unfence ------------------------------------------------------------------------


def fence(inst: Instance, request: FenceRequest) -> ActionResult:
    """Stop accepting writes now; stays stopped until unfence, demote, rejoin or promote."""
    newly, was_running = inst.fence_now()
    if newly or was_running:
        log.warning("fenced (%s)", request.reason or "no reason given")
    end = inst.wal.end(inst.pgdata)
    return ActionResult(
        "fence",
        changed=newly or was_running,
        detail="stopped" if was_running else "not running",
        final_lsn=format_lsn(end.lsn) if end is not None else None,
        shutdown_clean=inst.wal.shutdown_clean(inst.pgdata),
        timeline=end.timeline if end is not None else None,
    )


def fence_if_isolated(inst: Instance) -> bool:
    """Periodic (run.py): the operator's isolation order is due and this primary hears too few replicas
    (isolation.py): fence it, as the operator would. Whether it did."""
    order = inst.isolation.due()
    if order is None or not inst.postmaster.alive or inst.settings_snapshot()["fenced"]:
        return False
    try:
        with inst.connect(timeout=1, statement_timeout=1.5) as conn:
            why = isolated(conn, order)
    except psycopg.Error:
        return False  # PostgreSQL does not answer: nothing to tell, the next tick asks again
    if why is None:
        return False
    inst.last_error = why
    fence(inst, FenceRequest(reason=why))
    return True


def demote(inst: Instance, request: DemoteRequest) -> ActionResult:
    """Run read-only with no upstream, still fenced: its WAL can be counted and chosen by a failover."""
    with inst.action("demote"):
        if not inst.data_present():
            raise Refused("no data directory to start read-only: seed the member first")
        if inst.postmaster.alive:
            role = inst.role()
            if role == "replica":
                return ActionResult("demote", changed=False, detail="already running read-only")
            inst.fence_now()  # a primary (or a member that does not answer): stop it first
        token = inst.order()
        inst.record(token, fenced=True, demoted=True)
        inst.start(StartRole.STANDBY, token, upstream=None, may_start_fenced=True)
        log.info("demoted: running read-only with no upstream (%s)", request.reason or "no reason given")
        return ActionResult("demote", detail="running read-only with no upstream, still fenced")


def unfence(inst: Instance, request: UnfenceRequest) -> ActionResult:
    """Start a fenced member as it was: read-write only when asked and it was the primary when fenced."""
    with inst.action("unfence"):
        token = inst.order()
        state = inst.settings_snapshot()
        if not state["fenced"]:
            return ActionResult("unfence", changed=False, detail="not fenced")
        was = state["role_at_fence"]
        if request.primary and was != "primary":
            raise Refused(
                f"it was {'a replica' if was == 'replica' else 'of unknown role'} when fenced: it cannot start "
                "read-write; unfence it without primary, or promote it"
            )
        if inst.postmaster.alive:  # demoted: running read-only
            if request.primary:
                raise Refused("it runs read-only since a demote: promote it instead")
            inst.record(token, fenced=False, demoted=False, role_at_fence=None)
            return ActionResult("unfence", detail="unfenced; it keeps running read-only")
        if not inst.data_present():
            raise Refused("no data directory to start: seed the member first")
        inst.record(token, fenced=False, demoted=False, role_at_fence=None)
        if request.primary:
            inst.start(StartRole.PRIMARY, token)
            return ActionResult("unfence", detail="started read-write, as the primary it was")
        inst.start(StartRole.STANDBY, token, upstream=state["upstream"])
        return ActionResult("unfence", detail="started read-only")


# -- rejoin ----------------------------------------------------------------------------------------------


def _receiver_from(inst: Instance, upstream: str) -> int | None:
    """The pid of the WAL receiver when it streams over a connection to `upstream`'s host and port."""
    wanted, _ = upstream_params(upstream)
    try:
        with inst.connect(timeout=1) as conn:
            row = conn.execute("SELECT status, conninfo, pid FROM pg_stat_wal_receiver").fetchone()
    except psycopg.Error:
        return None
    if row is None or row[0] != "streaming" or not row[1]:
        return None
    used = conninfo_to_dict(row[1])
    same = str(used.get("host")) == str(wanted.get("host")) and str(used.get("port", "5432")) == str(
        wanted.get("port", "5432")
    )
    return int(row[2]) if same else None


def _streams_from(inst: Instance, upstream: str) -> bool:
    return _receiver_from(inst, upstream) is not None


def _streams_steadily(inst: Instance, upstream: str) -> bool:
    """Streams from `upstream`, and still by the same receiver STEADY later: a diverged replica's
    receiver says streaming for a moment before the startup process refuses the upstream's timeline."""
    pid = _receiver_from(inst, upstream)
    if pid is None:
        return False
    time.sleep(STEADY)
    return _receiver_from(inst, upstream) == pid


def _repoint(inst: Instance, upstream: str, *, ahead_of_promotion: bool = False) -> None:
    """A running replica follows another upstream: primary_conninfo changes on a reload (the WAL receiver
    restarts with it; recovery_target_timeline=latest takes the new timeline). `ahead_of_promotion`:
    the upstream is about to be promoted; its timeline switch streams without the archive."""
    changes: dict[str, Any] = {"primary_conninfo": inst.conninfo(upstream)}
    if ahead_of_promotion:
        inst.skip_archive(SKIP_ARCHIVE_SECONDS)
    command = inst.restore_command(standby=True)
    if command is not None:
        changes["restore_command"] = command  # a member started with no upstream ran without the archive
    update_pgherd_conf(inst.pgdata, changes)
    with inst.connect(timeout=2) as conn:
        conn.execute("SELECT pg_reload_conf()")


def _wait(predicate: Callable[[], bool], timeout: float, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


def _require_reachable(inst: Instance, upstream: str, *, left: str = "nothing was changed") -> None:
    """A rejoin never starts against an upstream that does not answer: a rewind would fail and the
    re-clone after it too, leaving the member with its data moved aside and nothing in its place.
    ``left``: what the refusal leaves of the member (a re-point may have been done already)."""
    try:
        with psycopg.connect(inst.conninfo(upstream, superuser=True), connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise Refused(
            f"the upstream {describe_upstream(upstream)} does not answer ({first}): {left}; "
            "ask again once it runs"
        ) from None


def rejoin(inst: Instance, request: RejoinRequest) -> ActionResult:
    """Become a streaming replica of `upstream`: re-point a running replica; else stop, pg_rewind, or
    re-clone (when rewind fails or `reclone` is asked) keeping the replaced data aside."""
    upstream = request.upstream.strip()
    if not upstream:
        raise Refused("rejoin needs an upstream (host:port or a libpq conninfo)")
    inst.conninfo(upstream)  # refuses an invalid upstream before anything changes
    with inst.action("rejoin"):
        _require_reachable(inst, upstream)
        token = inst.order()
        state = inst.settings_snapshot()
        role = inst.role() if inst.postmaster.alive else None
        if role == "replica" and not request.reclone and not state["fenced"]:
            if state["upstream"] == upstream and _streams_steadily(inst, upstream):
                return ActionResult(
                    "rejoin", changed=False, method="none", detail="already streaming from it"
                )
            _repoint(inst, upstream, ahead_of_promotion=request.ahead_of_promotion)
            inst.record(token, fenced=False, demoted=False, upstream=upstream)
            if _wait(lambda: _streams_steadily(inst, upstream), REPOINT_WAIT):
                return ActionResult(
                    "rejoin", method="repoint", detail="re-pointed; streaming", timeline=_timeline(inst)
                )
            # Not streaming may be the upstream gone meanwhile (fenced by a switchover): nothing a rewind
            # or a re-clone could fix, and both would stop the replica first.
            _require_reachable(
                inst, upstream, left="re-pointed at it (not streaming), still running read-only, not rewound"
            )
            log.warning("not streaming from the new upstream after %.0fs: stopping to rewind", REPOINT_WAIT)
        inst.stop(checkpoint=role == "primary")
        method, kept = _rebuild(inst, upstream, reclone=request.reclone)
        inst.record(token, fenced=False, demoted=False, upstream=upstream, role_at_fence=None)
        inst.start(StartRole.STANDBY, token, upstream=upstream)
        # Answer once it streams (bounded): an operator looking right after the answer must not find a
        # fresh clone whose WAL receiver is still starting, and order another re-clone of it.
        streaming = _wait(lambda: _streams_from(inst, upstream), REPOINT_WAIT)
        log.info("rejoined by %s (%s)", method, request.reason or "no reason given")
        detail = f"rejoined by {method}" + ("; streaming" if streaming else "; not streaming yet")
        return ActionResult(
            "rejoin",
            method=method,
            kept_aside=str(kept) if kept else None,
            detail=detail + (f"; the old data is kept in {kept}" if kept else ""),
            timeline=_timeline(inst),
        )


def _rebuild(inst: Instance, upstream: str, *, reclone: bool) -> tuple[str, Any]:
    pgdata = inst.pgdata
    own = data_major(pgdata)
    inst.use_binaries_of(upstream)
    if own is not None and own != inst.bins.major:
        reclone = True  # another major's data (an upgrade's): pg_rewind cannot cross majors
    if not inst.data_present() or reclone:
        kept = None if is_empty(pgdata) else inst.keep_aside(pgdata)
        basebackup_seed(
            pgdata,
            inst.conninfo(upstream),
            bins=inst.bins,
            settings=inst.settings(),
            primary_conninfo=inst.conninfo(upstream),
            restore_command=inst.restore_command(standby=True),
        )
        return ("reclone" if kept is not None else "basebackup"), kept
    result = rejoin_as_standby(
        pgdata,
        inst.conninfo(upstream, superuser=True),
        bins=inst.bins,
        primary_conninfo=inst.conninfo(upstream),
        restore_command=inst.restore_command(standby=True),
        keep_aside=inst.keep_aside,
    )
    return result.method, result.kept_aside


# -- restart -------------------------------------------------------------------------------------------


def restart(inst: Instance, request: RestartRequest) -> ActionResult:
    """Restart with the settings of `revision`: read-only (following its upstream, if any) unless
    `primary`, the operator's order to start the primary read-write again."""
    with inst.action("restart"):
        token = inst.order()
        state = inst.settings_snapshot()
        if state["fenced"]:
            raise Refused("the member is fenced: unfence, demote or rejoin it before a restart")
        if not inst.data_present():
            raise Refused("no data directory to start: seed the member first")
        alive = inst.postmaster.alive
        role = inst.role() if alive else None
        if request.primary and (role or (None if alive else inst.role_on_disk())) == "replica":
            raise Refused("it is a replica: promote it; a restart never makes a replica read-write")
        wanted = "primary" if request.primary else "replica"
        if request.revision is not None and request.revision == state["revision"] and role == wanted:
            return ActionResult(
                "restart", changed=False, detail=f"already running revision {request.revision}"
            )
        inst.stop(checkpoint=role == "primary")
        if request.primary:
            inst.start(StartRole.PRIMARY, token)
        else:
            inst.start(StartRole.STANDBY, token, upstream=state["upstream"])
        if request.revision is not None:
            inst.record(token, revision=request.revision)
        return ActionResult("restart", detail=f"restarted {'read-write' if request.primary else 'read-only'}")


# -- SQL actions ---------------------------------------------------------------------------------------


def _require_running(inst: Instance) -> None:
    if not inst.postmaster.alive:
        raise Refused(f"PostgreSQL is {inst.postmaster.state.value}: start it first")
    inst.wait_accepting(5)


def set_sync(inst: Instance, request: SetSyncRequest) -> ActionResult:
    """ALTER SYSTEM SET synchronous_standby_names; reload; answer once it is in force."""
    with inst.action("set-sync"):
        _require_running(inst)
        with inst.connect(timeout=2, statement_timeout=10) as conn:

            def in_force() -> bool:
                row = conn.execute("SELECT current_setting('synchronous_standby_names')").fetchone()
                return row is not None and row[0] == request.value

            if in_force():
                return ActionResult("set-sync", changed=False, detail="already in force")
            conn.execute(
                sql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}").format(sql.Literal(request.value))
            )
            conn.execute("SELECT pg_reload_conf()")
            # Polled closely: a switchover promotes only once this answers, inside its write outage.
            if not _wait(in_force, SYNC_APPLY_WAIT, every=0.005):
                raise PostgresError(
                    f"synchronous_standby_names is not in force {SYNC_APPLY_WAIT:.0f}s after the reload"
                )
        log.info("synchronous_standby_names = %r (%s)", request.value, request.reason or "no reason given")
        return ActionResult("set-sync", detail=f"synchronous_standby_names = {request.value!r}")


def checkpoint(inst: Instance, request: CheckpointRequest) -> ActionResult:
    with inst.action("checkpoint"):
        _require_running(inst)
        with inst.connect(timeout=2, statement_timeout=600) as conn:
            conn.execute("CHECKPOINT")
        return ActionResult("checkpoint", detail="checkpoint done")


def drop_slot(inst: Instance, request: DropSlotRequest) -> ActionResult:
    if not request.slot:
        raise Refused("drop-slot needs a slot name")
    with inst.action("drop-slot"):
        _require_running(inst)
        try:
            with inst.connect(timeout=2, statement_timeout=10) as conn:
                rows = conn.execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                    (request.slot,),
                ).fetchall()
        except pg_errors.ObjectInUse:
            raise Refused(
                f"replication slot {request.slot!r} is in use by a standby: stop it first"
            ) from None
        if not rows:
            return ActionResult("drop-slot", changed=False, detail=f"no replication slot {request.slot!r}")
        return ActionResult("drop-slot", detail=f"dropped replication slot {request.slot!r}")


# -- seed ------------------------------------------------------------------------------------------------


def seed(inst: Instance, request: SeedRequest) -> ActionResult:
    with inst.action("seed"):
        token = inst.order()
        if inst.data_present() or not is_empty(inst.pgdata):
            return ActionResult(
                "seed", changed=False, method="none", detail=f"{inst.pgdata} already holds data"
            )
        seeded = seed_and_start(
            inst, request.method, request.upstream, request.snapshot, request.target, token
        )
        return ActionResult("seed", method=seeded.method, detail=seeded.detail, timeline=_timeline(inst))


HANDLERS: dict[str, Callable[[Instance, Any], ActionResult]] = {
    "promote": promote,
    "fence": fence,
    "demote": demote,
    "unfence": unfence,
    "rejoin": rejoin,
    "restart": restart,
    "set-sync": set_sync,
    "checkpoint": checkpoint,
    "drop-slot": drop_slot,
    "seed": seed,
    "restore": restoring.request,  # answers at once; the restore goes on in its thread
    "upgrade": upgrading.request,  # likewise
}


def perform(inst: Instance, request: Request) -> ActionResult:
    return HANDLERS[request.action](inst, request)
