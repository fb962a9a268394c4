"""The /status document and the probes' answers.

While PostgreSQL runs, one SQL round trip over the agent's Unix socket; while it is stopped, pg_control
and the end of valid WAL in pg_wal (cached per file version, see walend.py). Never a guess: what cannot
be established is null.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import psycopg

from pgherd_backup.agent.instance import VERSION, Instance, describe_upstream
from pgherd_backup.agent.supervisor import PostmasterState
from pgherd_backup.agent.upstream import silence_now
from pgherd_backup.agent.wire import ActionOutcome, Status, WalReceiver, WireError, format_lsn, parse_lsn
from pgherd_backup.postgres.binaries import data_major
from pgherd_backup.wal import archive_failure

# A primary's timeline, from its current WAL file's name (pg_control's lags a promotion until the
# checkpoint after it, which is spread).
PRIMARY_TIMELINE = "('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int"

_QUERY = f"""
SELECT pg_is_in_recovery(),
       (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_receive_lsn() ELSE pg_current_wal_lsn() END)::text,
       (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END)::text,
       (CASE WHEN pg_is_in_recovery() THEN (SELECT flushed_lsn FROM pg_stat_wal_receiver)
             ELSE pg_current_wal_flush_lsn() END)::text,
       CASE WHEN pg_is_in_recovery() THEN NULL ELSE {PRIMARY_TIMELINE} END,
       (SELECT timeline_id FROM pg_control_checkpoint()),
       (SELECT status FROM pg_stat_wal_receiver),
       (SELECT received_tli FROM pg_stat_wal_receiver),
       (SELECT sender_host FROM pg_stat_wal_receiver),
       (SELECT sender_port FROM pg_stat_wal_receiver),
       (SELECT extract(epoch FROM clock_timestamp() - last_msg_receipt_time)::float8
          FROM pg_stat_wal_receiver),
       (SELECT setting::int FROM pg_settings WHERE name = 'wal_receiver_timeout'),
       current_setting('synchronous_standby_names'),
       (SELECT coalesce(last_failed_time < last_archived_time, last_failed_time IS NULL)
          FROM pg_stat_archiver),
       (SELECT max(('x' || substr(name, 1, 8))::bit(32)::int) FROM pg_ls_waldir()
         WHERE name ~ '^[0-9A-F]{{24}}$'),
       (SELECT count(*) > 0 FROM pg_settings WHERE pending_restart),
       (SELECT system_identifier FROM pg_control_system())::text,
       current_setting('server_version_num')::int
"""


@dataclass(frozen=True)
class Live:
    """What SQL says about a running member."""

    in_recovery: bool
    received: int | None
    replayed: int | None
    flushed: int | None
    timeline: int | None
    receiver: WalReceiver | None
    sync: str
    archiving_healthy: bool | None
    pending_restart: bool
    system_identifier: str | None
    server_version: str | None  # MAJOR.MINOR, e.g. "16.15" (server_version_text)

    @property
    def streaming(self) -> bool:
        return self.receiver is not None and self.receiver.status == "streaming"


def server_version_text(number: int | None) -> str | None:
    """server_version_num as MAJOR.MINOR: 160015 -> "16.15" (every supported major is 10 or later)."""
    if number is None:
        return None
    return f"{number // 10000}.{number % 10000}"


def _lsn(text: str | None) -> int | None:
    return parse_lsn(text) if text else None


def query_live(inst: Instance) -> Live | None:
    """Live, on a connection of its own as the superuser (/status: the operator's fresh data)."""
    if not inst.postmaster.alive:
        return None
    try:
        with inst.connect(timeout=1, statement_timeout=1.5) as conn:
            return read_live(conn)
    except psycopg.Error:
        return None


def read_live(conn: psycopg.Connection[Any]) -> Live:
    """Live from one round trip on `conn`: every function and view it reads is pg_monitor's to read."""
    row = conn.execute(_QUERY).fetchone()
    assert row is not None
    (
        in_recovery,
        received,
        replayed,
        flushed,
        wal_tli,
        checkpoint_tli,
        receiver,
        received_tli,
        sender_host,
        sender_port,
        silent,
        receiver_timeout_ms,
        sync,
        archiving,
        waldir_tli,
        pending,
        system_id,
        version_num,
    ) = row
    replayed_lsn = _lsn(replayed)
    if in_recovery:
        # The newest timeline it holds WAL for: its receiver's, else its newest WAL segment's; its last
        # restartpoint (pg_control) can lag a followed promotion for long (same rule as the sandbox's).
        timeline = max((t for t in (received_tli, checkpoint_tli, waldir_tli) if t is not None), default=None)
    else:
        timeline = wal_tli or checkpoint_tli
    wal_receiver = None
    if receiver is not None:
        where = f"{sender_host}:{sender_port}" if sender_host else None
        wal_receiver = WalReceiver(
            status=receiver,
            upstream=where,
            received_timeline=received_tli,
            silent_seconds=None if silent is None else round(max(0.0, silent), 3),
            heartbeat_seconds=receiver_timeout_ms / 2000 if receiver_timeout_ms else None,
        )
    return Live(
        in_recovery=bool(in_recovery),
        received=_lsn(received) or replayed_lsn,
        replayed=replayed_lsn,
        flushed=_lsn(flushed),
        timeline=timeline,
        receiver=wal_receiver,
        sync=sync or "",
        archiving_healthy=None if in_recovery else archiving,
        pending_restart=bool(pending),
        system_identifier=system_id,
        server_version=server_version_text(version_num),
    )


def readiness(inst: Instance, live: Live | None) -> tuple[bool, str]:
    """Accepting connections in its role: a primary writable and not fenced; a replica streaming, its
    replay within --ready-lag-bytes of what it received."""
    if live is None:
        return False, f"PostgreSQL is {inst.postmaster.state.value} and does not answer"
    if inst.state.fenced:
        return False, "fenced"
    if not live.in_recovery:
        return True, "primary"
    if not live.streaming:
        return False, "replica not streaming"
    lag = (live.received or 0) - (live.replayed or 0)
    if lag > inst.options.ready_lag_bytes:
        return False, f"replica replay lag {lag} bytes"
    return True, "replica streaming"


def serving(inst: Instance, live: Live | None, readied: tuple[bool, str]) -> tuple[bool, str]:
    """What /readyz answers the kubelet: ready, or a replica that lost its upstream less than
    --route-grace ago and replayed what it received. Through a failover the replicas then stay in the
    -ro Service: their leaving would make kube-proxy sync its rules, and the -rw Service's change that
    follows the promotion would wait for its next sync (its min-sync-period, 1 s by default: 0.4-0.6 s
    of a back-off failover on localkube). The operator's `ready` (/status) stays the strict one;
    `readied` is readiness(inst, live), taken once by the caller."""
    ready, why = readied
    if ready or live is None or not live.in_recovery or inst.state.fenced or live.streaming:
        return ready, why
    silence = upstream_silence(inst, live)
    lag = (live.received or 0) - (live.replayed or 0)
    if silence is None or silence > inst.options.route_grace or lag > inst.options.ready_lag_bytes:
        return ready, why
    return (
        True,
        f"replica; its upstream silent for {silence:.1f}s (reads served for {inst.options.route_grace:g}s)",
    )


def _fmt(value: int | None) -> str | None:
    return None if value is None else format_lsn(value)


def _archive_error(inst: Instance) -> str | None:
    """Why wal-push last failed, with any secret removed (its messages hold none: a second defence)."""
    error = archive_failure(inst.options.archive_failure_file)
    return inst.credentials.redact(error) if error is not None else None


def upstream_silence(inst: Instance, live: Live) -> float | None:
    """Seconds since its upstream last said anything: the receiver's own figure while it has one, else
    the date the agent's own watch gave its loss (upstream.py), aged, while it still follows that
    upstream (a receiver that gave up on a silent primary leaves no row: its silence goes on all the
    same). Never from this reading alone: a row gone since the watch's last sample is dated now."""
    if not live.in_recovery:
        return None
    receiver = live.receiver
    if receiver is not None and receiver.silent_seconds is not None:
        return receiver.silent_seconds
    configured = describe_upstream(inst.settings_snapshot()["upstream"])
    return silence_now(inst.upstream_heard, configured, time.monotonic())


def gather(inst: Instance) -> Status:
    live = query_live(inst)
    state = inst.settings_snapshot()
    pm = inst.postmaster
    ready, _ = readiness(inst, live)
    long_action = inst.long_action
    common: dict[str, Any] = {
        "member": inst.options.member,
        "cluster": inst.options.cluster,
        "postmaster": pm.state.value,
        "postmaster_since": pm.since.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "ready": ready,
        "upstream": describe_upstream(state["upstream"]),
        "fenced": state["fenced"],
        "demoted": state["demoted"],
        # False only when it positively holds no data: never while an action may be replacing it.
        "data_present": inst.data_present() or inst.action_name is not None,
        "kept_aside": tuple(state["kept_aside"]),
        "revision": state["revision"],
        "terminating": inst.terminating,
        "crashes": state["crashes"],
        "last_crash_at": state["last_crash_at"],
        "last_error": inst.last_error,
        "start_error": inst.start_error,
        "action": inst.action_name,
        "action_progress": long_action.wire() if long_action is not None else None,
        "last_action": _last_action(state["last_action"]),
        "pg_port": inst.options.pg_port,
        "agent_version": VERSION,
        "data_major": data_major(inst.pgdata),
        "analyzing": inst.analyzing,
    }
    if live is not None:
        held = max((v for v in (live.received, live.replayed, live.flushed) if v is not None), default=None)
        if live.in_recovery and not live.streaming and live.timeline is not None:
            # Not streaming (restarted, or the upstream is gone): what it received says little; the valid
            # WAL in its pg_wal says what it has.
            end = inst.wal.end(inst.pgdata, live.timeline, known=live.replayed)
            if end is not None:
                held = max(held or 0, end.lsn)
        if not live.in_recovery:
            held = live.flushed  # a primary holds what it flushed, not what it inserted
        return Status(
            **common,
            role="replica" if live.in_recovery else "primary",
            timeline=live.timeline,
            received_lsn=_fmt(live.received),
            replayed_lsn=_fmt(live.replayed),
            flushed_lsn=_fmt(live.flushed),
            held_lsn=_fmt(held),
            wal_receiver=live.receiver,
            upstream_silent_seconds=upstream_silence(inst, live),
            pending_restart=live.pending_restart,
            synchronous_standby_names=live.sync,
            archiving_healthy=live.archiving_healthy,
            archive_error=_archive_error(inst) if live.archiving_healthy is False else None,
            system_identifier=live.system_identifier,
            server_version=live.server_version,
        )
    if (
        pm.state in (PostmasterState.STOPPED, PostmasterState.CRASHED)
        and (inst.pgdata / "global" / "pg_control").exists()
    ):
        # Stopped, or crashed and not started again (yet, or at all): where its WAL ends.
        return Status(**common, **_stopped(inst))
    return Status(**common)


def _last_action(raw: Any) -> ActionOutcome | None:
    try:
        return ActionOutcome.from_dict(raw) if raw else None
    except WireError:
        return None


def _stopped(inst: Instance) -> dict[str, Any]:
    """A stopped member: where its WAL ends and how it shut down (its final state, for a fence)."""
    control = inst.wal.control(inst.pgdata)  # kept until pg_control changes: no fork per observation
    if control is None:
        return {}
    end = inst.wal.end(inst.pgdata)
    final = _fmt(end.lsn) if end is not None else None
    return {
        "timeline": end.timeline if end is not None else control.timeline,
        "held_lsn": final,
        "final_lsn": final,
        "shutdown_clean": control.cleanly_shut_down,
        "system_identifier": control.system_id,
    }
