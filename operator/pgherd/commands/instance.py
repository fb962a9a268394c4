"""`pgherd instance run` (the instance agent: PID 1 of every PostgreSQL container, and each member of
the sandbox) and `pgherd instance certs` (the per-cluster CA, member certificates and secrets).

Every flag of `run` can also come from PGHERD_<FLAG> (`--pg-port` -> PGHERD_PG_PORT), as a pod
template sets it; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pgherd_backup import logformat
from pgherd_backup.errors import BackupError
from pgherd_backup.postgres import parameters as user_parameters


def _env(flag: str) -> str | None:
    return os.environ.get("PGHERD_" + flag.lstrip("-").replace("-", "_").upper()) or None


def _env_bool(flag: str) -> bool:
    return (_env(flag) or "").lower() in ("1", "true", "yes", "on")


def _env_list(flag: str) -> list[str]:
    value = _env(flag)
    return [line for line in value.splitlines() if line.strip()] if value else []


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("instance", help="the instance agent of a PostgreSQL member")
    commands = parser.add_subparsers(dest="instance_command", required=True, metavar="COMMAND")
    _register_run(commands)
    _register_certs(commands)


def _register_run(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "run",
        help="run a member: seed as told, supervise PostgreSQL, serve probes, /status and /actions",
        description="The instance agent (see docs/agent.md). Every flag also reads PGHERD_<FLAG>.",
    )

    group: argparse._ArgumentGroup | argparse.ArgumentParser = p

    def add(flag: str, *, kind: Callable[[str], Any] = str, default: Any = None, **kwargs: Any) -> None:
        env = _env(flag)
        group.add_argument(flag, type=kind, default=kind(env) if env is not None else default, **kwargs)

    group = p.add_argument_group("member")
    add("--cluster", help="the cluster's name")
    add("--member", help="this member's name (<cluster>-<ordinal>)")
    add("--pgdata", kind=Path, help="the data directory (its parent is the member's volume)")
    add("--revision", help="the spec revision this member runs")
    add("--namespace", help="the pod's namespace: named in each JSON log line")
    add(
        "--log-format",
        default="text",
        choices=logformat.FORMATS,
        help="text (default) or json: one object per line (docs/monitoring.md, Logs)",
    )

    group = p.add_argument_group("API")
    add("--listen", default="0.0.0.0", help="address of the agent's HTTPS server (default 0.0.0.0)")
    add("--port", kind=int, default=8008, help="port of the agent's HTTPS server (default 8008)")
    add("--tls-cert", kind=Path, help="the member's server certificate (PEM)")
    add("--tls-key", kind=Path, help="its private key (PEM)")
    add("--tls-ca", kind=Path, help="the cluster CA (PEM): documents which CA the operator trusts")
    add(
        "--token-file",
        kind=Path,
        help="the operator's bearer token, or its digest sha256:<hex> (a file, e.g. a mounted Secret)",
    )
    group.add_argument(
        "--no-tls",
        action="store_true",
        default=_env_bool("--no-tls"),
        help="plain HTTP (tests and the local sandbox only; the token then travels in clear text)",
    )
    group.add_argument(
        "--pg-tls",
        action="store_true",
        default=_env_bool("--pg-tls"),
        help="PostgreSQL's TLS: --tls-cert/--tls-key serve it (or --pg-tls-*), --tls-ca verifies; hostssl pg_hba only",
    )
    add("--replication-cert", kind=Path, help="with --pg-tls: the replication user's client certificate")
    add("--replication-key", kind=Path, help="its private key")
    add(
        "--pg-tls-cert",
        kind=Path,
        help="with --pg-tls: PostgreSQL's own server certificate (default --tls-cert)",
    )
    add("--pg-tls-key", kind=Path, help="its private key (default --tls-key)")
    add(
        "--pg-tls-ca",
        kind=Path,
        help="with --pg-tls: the CA --pg-tls-cert chains to, that members verify each other by (default --tls-ca)",
    )
    add(
        "--pg-client-ca",
        kind=Path,
        help="with --pg-tls: the CAs whose client certificates PostgreSQL accepts (default --tls-ca)",
    )
    add("--pg-tls-min-version", default="TLSv1.3", help="with --pg-tls: TLSv1.2 or TLSv1.3 (default)")
    group.add_argument(
        "--superuser-network-access",
        action="store_true",
        default=_env_bool("--superuser-network-access"),
        help="with --pg-tls: the superuser may log in over TLS with its password (default: Unix socket only)",
    )
    add("--ready-lag-bytes", kind=int, default=16 << 20, help="/readyz: most replay lag of a ready replica")
    add(
        "--route-grace",
        kind=float,
        default=10.0,
        help="/readyz: seconds a replica that lost its upstream keeps serving reads (its /status ready is false)",
    )
    add(
        "--metrics-port",
        kind=int,
        default=9187,
        help="GET /metrics in plain HTTP on --listen (default 9187; 0: none)",
    )
    add(
        "--custom-queries",
        kind=Path,
        help="a YAML file of metric queries of your own (docs/monitoring.md), read again when it changes",
    )

    group = p.add_argument_group("PostgreSQL")
    add("--pg-port", kind=int, default=5432, help="PostgreSQL's port (default 5432)")
    add("--pg-listen", default="*", help="PostgreSQL's listen_addresses (default *)")
    add("--pg-log", kind=Path, help="PostgreSQL's log file (default: <pgdata>.log on the volume)")
    add("--superuser", default="postgres")
    add("--superuser-password-file", kind=Path)
    add("--replication-user", help="default: the superuser")
    add("--replication-password-file", kind=Path, help="default: the superuser's")
    add("--app-user", help="created at initdb with --app-database (default: named after the user)")
    add("--app-database")
    add("--app-password-file", kind=Path)
    group.add_argument(
        "--hba",
        action="append",
        default=_env_list("--hba"),
        help="a pg_hba.conf line added at initdb (repeat; default: password auth from anywhere)",
    )
    group.add_argument(
        "--parameter",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a PostgreSQL parameter (repeat)",
    )
    add("--parameters-file", kind=Path, help="parameters (postgresql.conf syntax), read again at every start")

    group = p.add_argument_group("seeding (an empty data directory only)")
    add("--seed", default="none", help="none (wait for POST /actions/seed) | initdb | basebackup | snapshot")
    add("--upstream", help="host:port or a libpq conninfo: the member to clone and follow")
    add("--snapshot", help="the snapshot id to restore (default latest)")
    add(
        "--recovery-target",
        help="with --seed snapshot and no upstream: time:<ISO 8601> | lsn:<lsn> | immediate",
    )
    add("--store", help="s3://bucket/path: WAL archive (wal-push), the WAL service, snapshots")

    group = p.add_argument_group("shutdown")
    add("--stop-timeout", kind=float, default=10.0, help="fast shutdown bound before immediate (seconds)")
    add("--grace-period", kind=float, default=30.0, help="the pod's terminationGracePeriodSeconds")
    add(
        "--terminate-wait",
        kind=float,
        help="how long a terminating primary waits for a switchover (default: grace - 2 x stop-timeout - 3)",
    )
    add("--start-timeout", kind=float, default=120.0, help="how long a start waits for connections")
    add("--state-dir", kind=Path, help="default: <volume>/agent")
    add("--kept-dir", kind=Path, help="where replaced data directories are kept (default: <volume>/kept)")
    p.set_defaults(func=_run)


def _register_certs(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "certs",
        help="make a cluster's CA, member certificates, operator token and passwords (files, mode 0600)",
    )
    p.add_argument("--cluster", required=True)
    p.add_argument("--out", type=Path, required=True, help="the directory (made 0700)")
    p.add_argument(
        "--member", action="append", default=[], help="a member to make a certificate for (repeat)"
    )
    p.add_argument("--ip", action="append", default=[], help="an IP address for the certificates (repeat)")
    p.add_argument("--dns", action="append", default=[], help="a DNS name for the certificates (repeat)")
    p.add_argument("--headless-service", help="adds <member>.<service> (give <service>.<namespace> for .svc)")
    p.add_argument(
        "--client",
        action="append",
        default=[],
        metavar="USER",
        help="a PostgreSQL role to make a client certificate for, <USER>.client.crt (repeat)",
    )
    p.add_argument(
        "--lifetime",
        metavar="DURATION",
        help="how long the certificates are valid: 90d, 12h, 5m (default 825d)",
    )
    p.set_defaults(func=_certs)


def _parameters(values: list[str]) -> dict[str, str]:
    parameters: dict[str, str] = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise BackupError(f"--parameter {item!r}: expected NAME=VALUE")
        if (why := user_parameters.problem(name.strip(), value.strip())) is not None:
            raise BackupError(f"--parameter: {why}")
        parameters[name.strip()] = value.strip()
    return parameters


def _run(args: argparse.Namespace) -> int:
    from pgherd_backup.agent.options import AgentOptions
    from pgherd_backup.agent.run import run

    missing = [flag for flag in ("cluster", "member", "pgdata", "token_file") if getattr(args, flag) is None]
    if missing:
        names = ", ".join("--" + m.replace("_", "-") for m in missing)
        print(f"pgherd instance run: error: {names} required (or PGHERD_* variables)", file=sys.stderr)
        return 2
    try:
        options = AgentOptions(
            cluster=args.cluster,
            member=args.member,
            pgdata=args.pgdata.absolute(),
            token_file=args.token_file,
            namespace=args.namespace,
            log_format=args.log_format,
            listen=args.listen,
            port=args.port,
            metrics_port=args.metrics_port,
            custom_queries=args.custom_queries,
            pg_port=args.pg_port,
            pg_listen=args.pg_listen,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_ca=args.tls_ca,
            no_tls=args.no_tls,
            pg_tls=args.pg_tls,
            replication_cert=args.replication_cert,
            replication_key=args.replication_key,
            pg_tls_cert=args.pg_tls_cert,
            pg_tls_key=args.pg_tls_key,
            pg_tls_ca=args.pg_tls_ca,
            pg_client_ca=args.pg_client_ca,
            pg_tls_min_version=args.pg_tls_min_version,
            superuser_network_access=args.superuser_network_access,
            seed=args.seed,
            upstream=args.upstream,
            snapshot=args.snapshot,
            recovery_target=args.recovery_target,
            store=args.store,
            superuser=args.superuser,
            superuser_password_file=args.superuser_password_file,
            replication_user=args.replication_user,
            replication_password_file=args.replication_password_file,
            app_user=args.app_user,
            app_database=args.app_database,
            app_password_file=args.app_password_file,
            hba=tuple(args.hba),
            parameters=_parameters(args.parameter),
            parameters_file=args.parameters_file,
            revision=args.revision,
            stop_timeout=args.stop_timeout,
            grace_period=args.grace_period,
            terminate_wait=args.terminate_wait,
            ready_lag_bytes=args.ready_lag_bytes,
            route_grace=args.route_grace,
            pg_log=args.pg_log,
            start_timeout=args.start_timeout,
            state_dir=args.state_dir,
            kept_dir=args.kept_dir,
        )
        return run(options)
    except BackupError as exc:
        print(f"pgherd instance run: error: {exc.message}", file=sys.stderr)
        return 2


def _certs(args: argparse.Namespace) -> int:
    from pgherd_backup.agent.auth import token_digest
    from pgherd_backup.agent.credentials import ensure_secret
    from pgherd_backup.agent.tls import issue, write_private
    from pgherd_backup.retention import parse_duration

    issued = issue(
        args.out,
        args.cluster,
        args.member,
        ips=args.ip,
        dns=args.dns,
        headless_service=args.headless_service,
        clients=args.client,
        lifetime=parse_duration(args.lifetime) if args.lifetime else None,
    )
    secrets = {}
    for name in ("token", "superuser-password", "replication-password"):
        path = args.out / name
        ensure_secret(path)
        secrets[name] = str(path)
    # The members may hold only the token's digest (--token-file accepts either): the operator alone
    # then holds the credential its requests carry.
    digest = args.out / "token.sha256"
    write_private(digest, (token_digest((args.out / "token").read_text()) + "\n").encode())
    secrets["tokenDigest"] = str(digest)
    summary = {
        "ca": str(issued.ca_cert),
        "caKey": str(issued.ca_key),
        "members": {m: {"cert": str(c), "key": str(k)} for m, (c, k) in issued.members.items()},
        "clients": {u: {"cert": str(c), "key": str(k)} for u, (c, k) in issued.clients.items()},
        **secrets,
    }
    print(json.dumps(summary, indent=2))
    return 0
