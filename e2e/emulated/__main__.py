"""`python -m e2e.emulated up --dir DIR` / `down --dir DIR`: an emulated Kubernetes cluster with the
pgherd operator running in it (see e2e/emulated/__init__.py and docs/e2e.md).

    up --dir DIR [--max-probe-period S] [--stop-grace S] [--restart-delay S] [--no-operator]
    down --dir DIR [--keep]              stop everything `up` started; remove DIR unless --keep
    operator start|kill --dir DIR        start the operator again / kill -9 it (a lost operator pod)
    serve --dir DIR                      the node process `up` starts (not for direct use)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from e2e.emulated import state

UP_TIMEOUT = 120.0


def up(
    directory: Path, *, max_probe_period: float, stop_grace: float, restart_delay: float, operator: bool
) -> None:
    if (directory / state.STATE).exists() and state.alive(state.read_state(directory).get("nodePid")):
        raise SystemExit(
            f"{directory} already holds a running emulated cluster: `down --dir {directory}` first"
        )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / state.STATE).unlink(missing_ok=True)
    argv = [
        sys.executable, "-m", "e2e.emulated", "serve", "--dir", str(directory),
        "--max-probe-period", str(max_probe_period), "--stop-grace", str(stop_grace),
        "--restart-delay", str(restart_delay),
    ]  # fmt: skip
    with open(directory / "node.log", "ab") as log:
        node = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=state.REPO, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + UP_TIMEOUT
    while True:
        if (directory / state.STATE).exists() and state.read_state(directory).get("ready"):
            break
        if node.poll() is not None or time.monotonic() > deadline:
            tail = (directory / "node.log").read_text(errors="replace")[-3000:]
            state.terminate(node.pid, 10)
            raise SystemExit(f"the emulated cluster did not start; {directory}/node.log ends with:\n{tail}")
        time.sleep(0.1)
    if operator:
        state.start_operator(directory)
    print(f"emulated cluster up: export KUBECONFIG={directory.resolve()}/kubeconfig")


def down(directory: Path, *, keep: bool) -> None:
    if not (directory / state.STATE).exists():
        return
    current = state.read_state(directory)
    state.kill_operator(directory, graceful=keep)  # its log complete when kept, else no need to wait
    state.terminate(current.get("nodePid"), 90)
    for pid in state.processes_under(directory):  # left behind by a node process that was killed
        state.terminate(pid, 5)
    state.write_state(directory, ready=False, nodePid=None)
    if not keep:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.emulated", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("up", "serve"):
        p = sub.add_parser(name)
        p.add_argument("--dir", type=Path, required=True)
        p.add_argument("--max-probe-period", type=float, default=1.0, help="cap on probe periods (s)")
        p.add_argument("--stop-grace", type=float, default=5.0, help="SIGTERM to SIGKILL at down (s)")
        p.add_argument(
            "--restart-delay", type=float, default=10.0,
            help="the kubelet's back-off before a dead container is started again (s; a real kubelet's first is 10)",
        )  # fmt: skip
        if name == "up":
            p.add_argument("--no-operator", action="store_true", help="do not start the operator")
    p = sub.add_parser("down")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--keep", action="store_true", help="keep DIR (data and logs)")
    p = sub.add_parser("operator")
    p.add_argument("action", choices=("start", "kill"))
    p.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args(argv)
    directory = args.dir.resolve()
    if args.command == "up":
        up(
            directory,
            max_probe_period=args.max_probe_period,
            stop_grace=args.stop_grace,
            restart_delay=args.restart_delay,
            operator=not args.no_operator,
        )
    elif args.command == "serve":
        from e2e.emulated.node import serve

        serve(
            directory,
            max_probe_period=args.max_probe_period,
            stop_grace=args.stop_grace,
            restart_delay=args.restart_delay,
        )
    elif args.command == "down":
        down(directory, keep=args.keep)
    elif args.action == "start":
        state.start_operator(directory)
    else:
        state.kill_operator(directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
