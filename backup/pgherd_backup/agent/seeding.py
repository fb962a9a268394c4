"""Seed an empty data directory as the operator says, then start it in the role that goes with it:
initdb (a new cluster's first member: the one start as a primary the agent makes without a later order,
because this order asks for exactly that), pg_basebackup from an upstream (a standby of it), or a
snapshot (a standby of the upstream, or without one a targeted recovery that promotes at its end).

Never on the agent's own initiative, and never into a directory that holds anything.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from pgherd_backup.agent.instance import Instance, Refused, StartRole
from pgherd_backup.errors import UsageError
from pgherd_backup.manifest import parse_time
from pgherd_backup.postgres.config import Setting, update_pgherd_conf
from pgherd_backup.postgres.process import give_to_pg, make_pg_dir
from pgherd_backup.postgres.seed import basebackup_seed, initdb, is_empty, snapshot_seed
from pgherd_backup.restore import RecoveryTarget

log = logging.getLogger("pgherd.agent")

METHODS = ("initdb", "basebackup", "snapshot")
# The agent's own view of its PostgreSQL (the probes): pg_monitor's rights and nothing more, no password,
# so that it logs in on the Unix socket alone.
MONITOR_ROLE = "pgherd_monitor"
MONITOR_HBA = f"local postgres {MONITOR_ROLE} trust"


@dataclass(frozen=True)
class Seeded:
    method: str
    detail: str


def parse_target(target: str | None) -> RecoveryTarget:
    """A recovery target given as `time:<ISO 8601>`, `lsn:<lsn>` or `immediate` (none: the end of the
    archive); UsageError (400) otherwise."""
    if not target:
        return RecoveryTarget()
    kind, _, value = target.partition(":")
    try:
        if kind == "time":
            return RecoveryTarget(time=parse_time(value))
        if kind == "lsn":
            return RecoveryTarget(lsn=value)
        if kind == "immediate" and not value:
            return RecoveryTarget(immediate=True)
    except ValueError as exc:
        raise UsageError(f"invalid recovery target {target!r}: {exc}") from None
    raise UsageError(f"invalid recovery target {target!r}: expected time:<ISO 8601>, lsn:<lsn> or immediate")


def recovery_target(target: str | None) -> dict[str, Setting]:
    """Settings for a target given as `time:<ISO 8601>`, `lsn:<lsn>` or `immediate`."""
    settings = parse_target(target).settings()
    return {**settings, "recovery_target_action": "promote"} if settings else {}


def seed_and_start(
    inst: Instance, method: str, upstream: str | None, snapshot: str | None, target: str | None, token: int
) -> Seeded:
    pgdata = inst.pgdata
    if not is_empty(pgdata):
        return Seeded("none", f"{pgdata} already holds data: nothing seeded")
    if method not in METHODS:
        raise UsageError(f"unknown seed method {method!r}: expected one of {', '.join(METHODS)}")
    inst.check(token)
    make_pg_dir(inst.options.volume, mode=0o755)
    log.info("seeding %s by %s", pgdata, method)
    if method == "initdb":
        _initdb(inst)
        inst.record(token, fenced=False, demoted=False, upstream=None)
        inst.start(StartRole.PRIMARY, token)
        _create_roles(inst)
        return Seeded("initdb", "a new cluster: started as its primary")
    if method == "basebackup":
        if not upstream:
            raise UsageError("seed by basebackup needs an upstream (host:port or a conninfo)")
        inst.use_binaries_of(upstream)  # the clone is the upstream's major
        inst.check(token)  # a SIGTERM (or fence) while the upstream was asked: nothing copied
        basebackup_seed(
            pgdata,
            inst.conninfo(upstream),
            bins=inst.bins,
            settings=inst.settings(),
            primary_conninfo=inst.conninfo(upstream),
            restore_command=inst.restore_command(standby=True),
        )
        inst.record(token, fenced=False, demoted=False, upstream=upstream)
        inst.start(StartRole.STANDBY, token, upstream=upstream)
        return Seeded("basebackup", "cloned; started as a standby")
    return _snapshot(inst, upstream, snapshot, target, token)


def _initdb(inst: Instance) -> None:
    options, credentials = inst.options, inst.credentials
    password = credentials.superuser_password.value() if credentials.superuser_password else None
    hba = list(options.hba)
    if not hba and password is not None:
        # Remote connections (other members, the operator) authenticate by password; the Unix socket,
        # in a directory only the PostgreSQL account reaches, stays trusted for the agent itself.
        hba = ["host all all all scram-sha-256", "host replication all all scram-sha-256"]
    initdb(
        inst.pgdata,
        bins=inst.bins,
        settings=inst.settings(),
        superuser=options.superuser,
        password=password,
        auth_local="trust",
        auth_host="scram-sha-256" if password is not None else "trust",
        hba_lines=[*hba, MONITOR_HBA],
    )


# Each step is idempotent, so a failed attempt is simply made again: a concurrent catalog update (the
# agent's probe granting the same rewind functions: "tuple concurrently updated", or creating the same
# role) or a dropped connection must not leave a new cluster without its application's role.
ROLES_RETRY_SECONDS = 60.0


def _create_roles(inst: Instance) -> None:
    for attempt in Retrying(
        retry=retry_if_exception_type(psycopg.Error),
        stop=stop_after_delay(ROLES_RETRY_SECONDS),
        wait=wait_exponential(multiplier=0.1, max=2),
        before_sleep=_roles_retried,
        reraise=True,
    ):
        with attempt:
            _create_roles_once(inst)


def _roles_retried(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome else None
    reason = next(iter(str(error).strip().splitlines()), type(error).__name__)
    log.warning("creating the cluster's roles failed (%s): trying again", reason)


def _create_roles_once(inst: Instance) -> None:
    """The replication account (when it is not the superuser), the agent's monitor, and the application's
    owner and database."""
    options, credentials = inst.options, inst.credentials
    inst.wait_accepting(inst.options.start_timeout)
    with inst.connect(timeout=5, statement_timeout=60) as conn:
        ensure_monitor_role(conn)
        if options.replication_role != options.superuser:
            _ensure_role(conn, options.replication_role, credentials.replication_password, "REPLICATION")
            ensure_rewind_grants(conn, options.replication_role)
        if options.app_user:
            _ensure_role(conn, options.app_user, credentials.app_password, "")
            database = options.app_database or options.app_user
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone():
                conn.execute(
                    sql.SQL("CREATE DATABASE {} OWNER {}").format(
                        sql.Identifier(database), sql.Identifier(options.app_user)
                    )
                )


def ensure_monitor_role(conn: psycopg.Connection[Any]) -> bool:
    """pgherd_monitor on a primary that lacks it (a cluster made before it existed, or at initdb); True
    when it was created. Replicas get it by replication."""
    row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
    if row is None or row[0]:
        return False
    try:
        with conn.transaction():
            # a synchronous standby that is away must not hold the probes' role back
            conn.execute("SET LOCAL synchronous_commit = local")
            created = _ensure_role(conn, MONITOR_ROLE, None, "IN ROLE pg_monitor")
    except psycopg.errors.DuplicateObject:
        return False  # created meanwhile
    if created:
        log.info("created the role %s (the agent's probes read PostgreSQL as it)", MONITOR_ROLE)
    return created


# What pg_rewind reads on its source: with these, the replication account (by its certificate) rewinds a
# member, and the superuser need not be reachable over the network.
_REWIND_FUNCTIONS = (
    "pg_catalog.pg_ls_dir(text, boolean, boolean)",
    "pg_catalog.pg_stat_file(text, boolean)",
    "pg_catalog.pg_read_binary_file(text)",
    "pg_catalog.pg_read_binary_file(text, bigint, bigint, boolean)",
)


def ensure_rewind_grants(conn: psycopg.Connection[Any], role: str) -> None:
    """On a primary (a replica gets them by replication), idempotent."""
    row = conn.execute(
        "SELECT pg_is_in_recovery(), EXISTS (SELECT 1 FROM pg_roles WHERE rolname = %s)", (role,)
    )
    found = row.fetchone()
    if found is None or found[0] or not found[1]:
        return
    with conn.transaction():
        conn.execute("SET LOCAL synchronous_commit = local")
        for function in _REWIND_FUNCTIONS:
            conn.execute(
                sql.SQL("GRANT EXECUTE ON FUNCTION " + function + " TO {}").format(sql.Identifier(role))
            )
        # pg_rewind's source must checkpoint first (rewind.checkpoint_source); before PostgreSQL 15
        # only a superuser may, and a member is then re-cloned instead of rewound.
        if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'pg_checkpoint'").fetchone():
            conn.execute(sql.SQL("GRANT pg_checkpoint TO {}").format(sql.Identifier(role)))


def _ensure_role(conn: psycopg.Connection[Any], name: str, secret: object, attributes: str) -> bool:
    from pgherd_backup.agent.credentials import SecretFile

    if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone():
        return False
    query = sql.SQL("CREATE ROLE {} LOGIN " + attributes).format(sql.Identifier(name))
    if isinstance(secret, SecretFile):
        query = sql.SQL("{} PASSWORD {}").format(query, sql.Literal(secret.value()))
    conn.execute(query)
    return True


def _snapshot(
    inst: Instance, upstream: str | None, snapshot: str | None, target: str | None, token: int
) -> Seeded:
    options = inst.options
    if not options.store:
        raise Refused(
            "seed from a snapshot needs the agent's --store (and S3 credentials in its environment)"
        )
    targeted = recovery_target(target) if not upstream else {}
    store = options.open_store()
    manifest = snapshot_seed(
        inst.pgdata,
        store,
        snapshot=snapshot or "latest",
        settings=inst.settings(),
        primary_conninfo=inst.conninfo(upstream) if upstream else None,
        agent=inst.agent_executable,
    )
    give_to_pg(inst.pgdata, recursive=True)
    inst.use_binaries_of_data()  # the snapshot's major (an older one's, taken before an upgrade)
    if upstream:
        inst.record(token, fenced=False, demoted=False, upstream=upstream)
        inst.start(StartRole.STANDBY, token, upstream=upstream)
        return Seeded("snapshot", f"restored snapshot {manifest.id}; started as a standby")
    if targeted:
        update_pgherd_conf(inst.pgdata, dict(targeted))
    inst.record(token, fenced=False, demoted=False, upstream=None)
    inst.start(StartRole.AS_IS, token)
    return Seeded("snapshot", f"restored snapshot {manifest.id}; recovering the archive, then it promotes")
