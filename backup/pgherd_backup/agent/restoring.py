"""The in-place restore (POST /actions/restore): a fenced member gets a snapshot back on its own volume.

The request is checked and answered at once (202); the restore goes on in a thread of its own, holding
the action slot, and /status shows it (`action: restore`, `actionProgress`) until `lastAction` says how
it ended. Its stages:

  restoring  the snapshot is found (an id, or the latest: with a time target, the newest one ending
             before it) and checked against the target and the archived WAL, before anything changes;
             then PostgreSQL is stopped, the data directory moved to <volume>/kept/<stamp> (never
             deleted), and the snapshot's files fetched, checked and written (bytes done / total);
  replaying  what the agent remembered of the old data is cleared (fence, demote, role at fence,
             upstream) and PostgreSQL recovers archived WAL up to the target, then promotes onto a new
             timeline: the restore is done once it runs as the primary.

A failure leaves the member fenced and deletes nothing but the snapshot's own half-written files (as
`restore_files` does); a fence during the restore wins (the restored data is not started). The stage
is kept in the agent's state once the old data is aside: a restarted agent resumes a replay, and
reports a fetch it interrupted as failed (its partial files removed).
"""

from __future__ import annotations

import io
import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

from pgherd_backup.agent.instance import Busy, Instance, LongAction, Refused, StartRole
from pgherd_backup.agent.seeding import parse_target
from pgherd_backup.agent.status import query_live
from pgherd_backup.agent.supervisor import PostmasterState
from pgherd_backup.agent.wire import ActionOutcome, ActionResult, RestoreRequest, WireError
from pgherd_backup.errors import BackupError, PostgresError
from pgherd_backup.postgres.config import write_recovery_config
from pgherd_backup.postgres.control import read_controldata
from pgherd_backup.postgres.seed import is_empty
from pgherd_backup.progress import Progress
from pgherd_backup.restore import RecoveryTarget

log = logging.getLogger("pgherd.agent")

RESTORING = "restoring"
REPLAYING = "replaying"
POLL = 0.25  # how often the replay is looked at

_requests = threading.Lock()  # a request's checks and its start, one request at a time


class Interrupted(Exception):
    """The agent shuts down: the restore stops where it is (a restarted agent takes it up)."""


class _Written(Progress):
    """restore_files' progress, shown in /status; it stops the fetch when the agent shuts down."""

    def __init__(self, inst: Instance, job: LongAction) -> None:
        super().__init__("restore", stream=io.StringIO())  # not a terminal: never rendered
        self.inst = inst
        self.job = job

    def set_total(self, total: int | None) -> None:
        super().set_total(total)
        self.job.bytes_total = total

    def update(self, done: int) -> None:
        if self.inst.shutting_down:
            raise Interrupted("the agent shuts down")
        super().update(done)
        self.job.bytes_done = done


# -- the request ------------------------------------------------------------------------------------------


def request(inst: Instance, order: RestoreRequest) -> ActionResult:
    """Check the order and start the restore in its thread; or answer the state of the same order."""
    target = parse_target(order.target)  # a malformed target: 400, nothing done
    snapshot = (order.snapshot or "").strip() or "latest"
    key = (order.request_id, None, None) if order.request_id else (None, snapshot, order.target)
    with _requests:
        running = inst.long_action
        if running is not None:
            if running.name == "restore" and running.key == key:
                return ActionResult(
                    "restore",
                    changed=False,
                    in_progress=True,
                    detail=f"this restore is in progress ({running.stage})",
                )
            raise Busy(f"busy: a {running.name} is in progress ({running.stage}); ask again when it is done")
        done = last_outcome(inst, "restore", order.request_id)
        if done is not None:
            if not done.ok:
                raise BackupError(
                    f"restore {order.request_id} failed: {done.error} (nothing more was done; ask with "
                    "another requestId to try again)"
                )
            return ActionResult(
                "restore",
                changed=False,
                detail=f"restore {order.request_id} is done: {done.detail}",
                kept_aside=done.kept_aside,
                timeline=done.timeline,
            )
        if not inst.options.store:
            raise Refused("a restore needs the agent's --store (and S3 credentials in its environment)")
        inst.hold("restore")
        try:
            if not inst.settings_snapshot()["fenced"]:
                raise Refused(
                    "the member is not fenced: fence it first (a restore replaces its data); nothing was changed"
                )
            token = inst.order()
            job = LongAction(
                "restore",
                key,
                request_id=order.request_id,
                snapshot=snapshot,
                target=order.target,
                stage=RESTORING,
            )
            inst.long_action = job
            spawn(inst, job, lambda: _restore(inst, job, snapshot, target, token))
        except BaseException:
            inst.long_action = None
            inst.release()
            raise
    log.warning(
        "restoring snapshot %s%s in place (%s)",
        snapshot,
        f" to {order.target}" if order.target else "",
        order.reason or "no reason given",
    )
    return ActionResult(
        "restore",
        in_progress=True,
        detail=f"restoring snapshot {snapshot}: follow it in /status (action, actionProgress, lastAction)",
    )


def last_outcome(inst: Instance, name: str, request_id: str | None) -> ActionOutcome | None:
    """How the last long action ended, if it was the `name` order named `request_id`."""
    raw = inst.settings_snapshot()["last_action"]
    if not request_id or not raw:
        return None
    try:
        outcome = ActionOutcome.from_dict(raw)
    except WireError:
        return None
    return outcome if outcome.name == name and outcome.request_id == request_id else None


# -- the restore, in its thread -------------------------------------------------------------------------


def spawn(
    inst: Instance,
    job: LongAction,
    work: Callable[[], ActionOutcome],
    *,
    marker: str = "restore",
    fail: Callable[[Instance, LongAction, str], ActionOutcome] | None = None,
) -> None:
    """Run a long action's `work` in its own thread, holding the action slot the request took; record
    how it ended (`lastAction`) and clear its `marker` in the agent's state. `fail`: how a failure is
    reported (the restore's own by default)."""

    def run() -> None:
        outcome: ActionOutcome | None = None
        try:
            outcome = work()
            log.info("%s done: %s", job.name, outcome.detail)
        except Interrupted:
            log.warning("the %s stops here (%s): the agent shuts down", job.name, job.stage)
        except Exception as exc:
            if not isinstance(exc, BackupError | psycopg.Error | OSError):
                log.exception("the %s failed unexpectedly", job.name)
            outcome = (fail or _failed)(inst, job, error_text(exc))
        finally:
            inst.postmaster.report_exits()
            if outcome is not None:
                inst.record(**{marker: None}, last_action=outcome.to_dict())
            inst.long_action = None
            inst.release()

    threading.Thread(target=run, name=job.name, daemon=True).start()


def _restore(
    inst: Instance, job: LongAction, snapshot: str, target: RecoveryTarget, token: int
) -> ActionOutcome:
    from pgherd_backup.catalog import find_snapshot
    from pgherd_backup.restore import check_target, check_wal_coverage, restore_files

    store = inst.options.open_store()
    store.check()
    manifest = find_snapshot(store, snapshot, not_after=target.time)
    check_target(manifest, target)
    check_wal_coverage(store, manifest, target)
    job.snapshot, job.bytes_total, job.bytes_done = manifest.id, manifest.size, 0
    # From here on the member changes. PostgreSQL stops (a demoted member runs read-only); the old data
    # goes aside by one rename, and only then is the stage recorded: a restarted agent may empty a data
    # directory that holds a partial restore, never one that may hold the old data.
    if inst.postmaster.alive:
        inst.stop(checkpoint=False)
    if not is_empty(inst.pgdata):
        job.kept_aside = str(inst.keep_aside(inst.pgdata))
    inst.record(restore=_marker(job))
    restore_files(store, manifest, inst.pgdata, progress=_Written(inst, job))
    job.bytes_done = job.bytes_total  # every file written and checked (the tar's end blocks included)
    inst.use_binaries_of_data()  # the snapshot's major: one taken before an upgrade is the old major's
    command = inst.restore_command()
    assert command is not None
    write_recovery_config(inst.pgdata, restore_command=command, target=target.settings())
    try:
        # The old data's memory goes with it; a fence since the order wins (nothing is started).
        inst.record(token, fenced=False, demoted=False, role_at_fence=None, upstream=None)
    except Refused:
        raise Refused(
            f"fenced during the restore: snapshot {manifest.id} is restored in {inst.pgdata} but was not "
            "started"
        ) from None
    job.stage = REPLAYING
    inst.record(restore=_marker(job))
    return _replay(inst, job, token)


def _replay(inst: Instance, job: LongAction, token: int) -> ActionOutcome:
    """Start the restored data's targeted recovery (as it is configured) and wait for its promotion."""
    inst.start(StartRole.AS_IS, token, report_exit=False)
    while True:
        if inst.shutting_down:
            raise Interrupted("the agent shuts down")
        if inst.order() != token:
            raise Refused("fenced during the replay: PostgreSQL was stopped before the end of its recovery")
        if not inst.postmaster.alive:
            reason = inst.postmaster.failure_reason() or f"see the PostgreSQL log {inst.options.log_file}"
            raise PostgresError(f"PostgreSQL stopped during the replay: {reason}")
        if inst.postmaster.state is PostmasterState.RUNNING and inst.role() == "primary":
            break
        time.sleep(POLL)
    inst.postmaster.report_exits()
    live = query_live(inst)
    timeline = live.timeline if live is not None else None
    return _outcome(
        job,
        ok=True,
        timeline=timeline,
        detail=f"restored snapshot {job.snapshot}"
        + (f" to {job.target}" if job.target else "")
        + f"; promoted on timeline {timeline}",
    )


def _failed(inst: Instance, job: LongAction, error: str) -> ActionOutcome:
    """The restore failed: a member started on the restored data is stopped and fenced again."""
    if job.stage == REPLAYING:
        inst.fence_now()
        inst.record(role_at_fence=None)
    error = inst.credentials.redact(error)
    inst.last_error = f"restore: {error}"
    log.error("the restore failed (%s): %s", job.stage, error)
    detail = "the member stays fenced" + (
        f"; its old data is kept in {job.kept_aside}" if job.kept_aside else ""
    )
    return _outcome(job, ok=False, error=error, detail=detail)


def _outcome(
    job: LongAction, *, ok: bool, detail: str, error: str | None = None, timeline: int | None = None
) -> ActionOutcome:
    return job.outcome(ok=ok, detail=detail, error=error, timeline=timeline)


def error_text(exc: BaseException) -> str:
    if isinstance(exc, BackupError):
        return exc.message
    if isinstance(exc, psycopg.Error):
        return "PostgreSQL: " + (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"{type(exc).__name__}: {exc}"


def _marker(job: LongAction) -> dict[str, object]:
    return {
        "requestId": job.request_id,
        "snapshot": job.snapshot,
        "target": job.target,
        "stage": job.stage,
        "keptAside": job.kept_aside,
        "startedAt": job.started_at,
        "bytesTotal": job.bytes_total,
    }


def _job(marker: dict[str, object]) -> LongAction:
    def text(key: str) -> str | None:
        value = marker.get(key)
        return None if value is None else str(value)

    request_id = text("requestId")
    job = LongAction(
        "restore",
        (request_id, None, None) if request_id else (None, text("snapshot"), text("target")),
        request_id=request_id,
        snapshot=text("snapshot"),
        target=text("target"),
        stage=text("stage"),
        kept_aside=text("keptAside"),
    )
    job.started_at = text("startedAt") or job.started_at
    return job


# -- a restarted agent ----------------------------------------------------------------------------------


def on_boot(inst: Instance) -> bool:
    """The restore a previous agent left in progress: True when its replay is to go on (`resume`);
    otherwise how it ended is recorded (a fetch cut short: failed, its partial files removed)."""
    marker = inst.settings_snapshot()["restore"]
    if not marker:
        return False
    job = _job(marker)
    outcome: ActionOutcome
    if job.stage != REPLAYING:
        if inst.pgdata.exists():
            _empty(inst.pgdata)  # the snapshot's partial files: the old data is aside already
        outcome = _failed(
            inst,
            job,
            "interrupted: the agent stopped while the snapshot's files were written (the partial files "
            "were removed); ask for a new restore",
        )
    elif inst.settings_snapshot()["fenced"]:
        outcome = _failed(inst, job, "fenced during the replay: the restored data was not started again")
    elif (inst.pgdata / "recovery.signal").exists():
        return True
    else:
        # The recovery ended while no agent watched it (its PostgreSQL outlived the agent): it promoted.
        try:
            timeline: int | None = read_controldata(inst.pgdata, inst.bins).timeline
        except BackupError:
            timeline = None
        outcome = _outcome(
            job,
            ok=True,
            timeline=timeline,
            detail=f"restored snapshot {job.snapshot}; its recovery ended while the agent was stopped",
        )
    inst.record(restore=None, last_action=outcome.to_dict())
    return False


def resume(inst: Instance, token: int) -> None:
    """Go on with a restore's replay after the agent's restart; takes over the boot's action slot."""
    job = _job(inst.settings_snapshot()["restore"] or {})
    inst.action_name = "restore"
    inst.long_action = job
    log.warning("resuming the replay of restored snapshot %s", job.snapshot)
    spawn(inst, job, lambda: _replay(inst, job, token))


def _empty(pgdata: Path) -> None:
    for child in pgdata.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
