"""`kubectl pgherd` (the console script `kubectl-pgherd`): its commands and flags. kubectl's global
flags (-n/--namespace, --context, --kubeconfig) are taken before or after the command. Every error is
one line on stderr and a non-zero exit; every request's refusal says what and where."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pgherd import __version__
from pgherd.plugin import logs, operations, psql, report, version
from pgherd.plugin.errors import PluginError
from pgherd.plugin.gather import gather
from pgherd.plugin.kube import Kube, Target, connect
from pgherd.plugin.render import render
from pgherd.plugin.summary import summarize

PROG = "kubectl pgherd"


def _globals(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument("-n", "--namespace", default=default, help="the namespace (default: the context's)")
    parser.add_argument(
        "--context", default=default, help="the kubeconfig context (default: the current one)"
    )
    parser.add_argument(
        "--kubeconfig",
        default=default,
        help="the kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="pgherd's PostgreSQL clusters on Kubernetes: a status that explains, requests that wait,"
        " a shell, logs and a support bundle; never a secret.",
    )
    parser.add_argument("--version", action="version", version=f"kubectl-pgherd {__version__}")
    _globals(parser, None)
    common = argparse.ArgumentParser(add_help=False)
    _globals(common, argparse.SUPPRESS)  # given after the command: kept; not given: the parser's default
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, parents=[common])

    p = add(
        "status", "the phase and why, the operation, members, replication, archiving, backups, certificates"
    )
    p.add_argument("name", metavar="NAME")
    p.add_argument("-v", "--verbose", action="store_true", help="more: replayed LSNs, every recent Event")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    p = add("switchover", "a planned switchover (annotation pgherd.io/switchover-to)")
    p.add_argument("name", metavar="NAME")
    p.add_argument(
        "--to", metavar="MEMBER", help="the member to promote (default: the replica with the most WAL)"
    )
    _wait(p, 180)
    p = add(
        "restart",
        "a rolling restart in the engine's safe order (replicas first, the primary last), or one member",
    )
    p.add_argument("name", metavar="NAME")
    p.add_argument(
        "member", metavar="MEMBER", nargs="?", help="restart this member alone (its pod is made again)"
    )
    _wait(p, 3600)
    for name, text in (("pause", "stop acting on the cluster (spec.paused)"), ("resume", "act on it again")):
        p = add(name, text)
        p.add_argument("name", metavar="NAME")
    p = add("backup", "take a Backup now")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--backup-name", metavar="B", help="the Backup's name (default: NAME-<UTC time>)")
    p.add_argument(
        "--target", choices=("preferStandby", "primary"), help="where to take it (default preferStandby)"
    )
    _wait(p, 6 * 3600)
    p = add("restore", "restore the cluster in place from a Backup or a snapshot, to a time or an LSN")
    p.add_argument("name", metavar="NAME")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--backup", metavar="B", help="a Completed Backup of the cluster")
    source.add_argument("--snapshot", metavar="ID", help="a snapshot id in the cluster's store")
    point = p.add_mutually_exclusive_group()
    point.add_argument(
        "--time", metavar="T", help="recover up to this time (RFC 3339, e.g. 2026-11-21T10:41:59Z)"
    )
    point.add_argument("--lsn", metavar="L", help="recover up to this WAL location (e.g. 0/3000060)")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for a confirmation at a terminal")
    _wait(p, 6 * 3600)
    p = add("upgrade", "confirm or roll back a major upgrade")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, text in (
        ("confirm", "confirm the upgrade: the replica kept on the old major is rebuilt (no way back then)"),
        ("rollback", "go back to the replica kept on the old major"),
    ):
        a = actions.add_parser(name, help=text, description=text, parents=[common])
        a.add_argument("name", metavar="NAME")
    p = add(
        "psql", "psql in a member's pod (the primary by default): kubectl pgherd psql NAME -- -c 'select 1'"
    )
    p.add_argument("name", metavar="NAME")
    member = p.add_mutually_exclusive_group()
    member.add_argument("--replica", action="store_true", help="a ready replica (the least behind)")
    member.add_argument("--member", metavar="M", help="this member")
    p = add("logs", "every member's log lines, interleaved by time, prefixed with the member")
    p.add_argument("name", metavar="NAME")
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("--since", metavar="D", help="only lines newer than this: 30s, 10m, 1h")
    p.add_argument("--tail", type=int, metavar="N", help="the last N lines of each member")
    p = add("report", "a support bundle (.tar.gz or .zip), with no Secret value in it")
    p.add_argument("name", metavar="NAME")
    p.add_argument("-o", "--output", required=True, type=Path, metavar="FILE")
    add("version", "the plugin's version and the operator's")
    return parser


def _wait(parser: argparse.ArgumentParser, timeout: float) -> None:
    parser.add_argument(
        "--wait", action="store_true", help="follow it until it is done (non-zero exit if it fails)"
    )
    parser.add_argument(
        "--timeout", type=float, default=timeout, help=f"with --wait, seconds (default {timeout:.0f})"
    )


def _kube(args: argparse.Namespace) -> Kube:
    return connect(Target(kubeconfig=args.kubeconfig, context=args.context, namespace=args.namespace))


def run(args: argparse.Namespace) -> int:
    command = args.command
    if command == "version":
        try:
            kube = _kube(args)
        except PluginError as exc:
            print(f"kubectl-pgherd {__version__}")
            raise PluginError(f"the operator's version is unknown: {exc}") from None
        lines, error = version.lines(kube)
        print("\n".join(lines))
        if error is not None:
            raise PluginError(error)
        return 0
    kube = _kube(args)
    name = args.name
    if command == "status":
        summary = summarize(gather(kube, name))
        if args.output == "json":
            print(json.dumps(summary, indent=2, sort_keys=True))
        else:
            sys.stdout.write(render(summary, verbose=args.verbose))
        return 0
    if command == "switchover":
        operations.switchover(kube, name, args.to, wait=args.wait, timeout=args.timeout)
    elif command == "restart":
        operations.restart(kube, name, args.member, wait=args.wait, timeout=args.timeout)
    elif command in ("pause", "resume"):
        operations.pause(kube, name, command == "pause")
    elif command == "upgrade":
        operations.upgrade(kube, name, args.action)
    elif command == "backup":
        operations.backup(kube, name, args.backup_name, args.target, wait=args.wait, timeout=args.timeout)
    elif command == "restore":
        operations.restore(
            kube,
            name,
            backup_name=args.backup,
            snapshot=args.snapshot,
            time=args.time,
            lsn=args.lsn,
            wait=args.wait,
            timeout=args.timeout,
            yes=args.yes,
        )
    elif command == "psql":
        cluster = kube.cluster(name)
        member = psql.choose_member(cluster, replica=args.replica, member=args.member)
        return psql.run(kube, str(member["name"]), psql.command(member, args.psql_args))
    elif command == "logs":
        return logs.show(kube, name, follow=args.follow, since=args.since, tail=args.tail)
    elif command == "report":
        bundle = report.write(kube, name, args.output)
        print(
            f"{args.output}: {len(bundle.files)} files"
            + (f"; not collected: {len(bundle.errors)} (README.txt)" if bundle.errors else "")
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    # psql's own arguments follow `--`, untouched.
    psql_args: list[str] = []
    if "--" in given:
        cut = given.index("--")
        given, psql_args = given[:cut], given[cut + 1 :]
    args = build_parser().parse_args(given)
    args.psql_args = psql_args
    if psql_args and args.command != "psql":
        print(
            f"{PROG}: error: arguments after -- are psql's: only the psql command takes them", file=sys.stderr
        )
        return 2
    try:
        return run(args)
    except PluginError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
