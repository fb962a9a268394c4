"""`psql` in a member's pod, through the Kubernetes exec API: as the superuser on the local Unix socket
(trusted there, as the agent's own connections are: no password travels or shows), with the member's
own major's psql. Interactive (a terminal, raw mode, resized with the window) when both ends are
terminals; otherwise its output is piped back, and piped input sent to it."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pgherd.kube import names
from pgherd.kube.builders.statefulset import postgres_bindir
from pgherd.plugin.errors import PluginError
from pgherd.plugin.kube import Kube
from pgherd_backup.agent.options import AgentOptions

STDIN, STDOUT, STDERR, ERROR, RESIZE = 0, 1, 2, 3, 4


def socket_dir() -> str:
    """The directory of PostgreSQL's Unix socket in a member pod, where the agent puts it."""
    options = AgentOptions(
        cluster="-", member="-", pgdata=Path(names.PGDATA), token_file=Path("/dev/null"), no_tls=True
    )
    return str(options.socket_dir)


def choose_member(
    cluster: Mapping[str, Any], *, replica: bool = False, member: str | None = None
) -> Mapping[str, Any]:
    """The member to connect to: ``member``, else a ready replica (the least behind) with ``replica``,
    else the primary."""
    meta, status = cluster.get("metadata") or {}, cluster.get("status") or {}
    members = [m for m in status.get("members") or [] if isinstance(m, Mapping)]
    name = meta.get("name")
    if member is not None:
        found = next((m for m in members if m.get("name") == member), None)
        if found is None:
            raise PluginError(
                f"{name} has no member {member} (members: {', '.join(str(m.get('name')) for m in members) or 'none'})"
            )
        return found
    if replica:
        ready = [m for m in members if m.get("role") == "replica" and m.get("ready")]
        if not ready:
            raise PluginError(f"{name} has no ready replica")
        return min(
            ready,
            key=lambda m: (
                m.get("lagBytes") if m.get("lagBytes") is not None else 1 << 62,
                str(m.get("name")),
            ),
        )
    primary = status.get("currentPrimary")
    found = next((m for m in members if m.get("name") == primary), None)
    if found is None:
        raise PluginError(
            f"{name} has no primary now (phase {status.get('phase') or 'Pending'}): --replica or --member M"
        )
    return found


def command(member: Mapping[str, Any], psql_args: Sequence[str]) -> list[str]:
    """psql's argv in the pod: the member's major's psql on the local socket, as the superuser; the
    person's arguments last (they win: -d app, -U app, -c ...)."""
    version = str(member.get("version") or "")
    major = version.split(".", 1)[0]
    psql = f"{postgres_bindir(int(major))}/psql" if major.isdigit() else "psql"
    return [psql, "-h", socket_dir(), "-p", str(names.POSTGRES_PORT), "-U", names.SUPERUSER, *psql_args]


def exit_code(error_channel: str) -> int:
    """The command's exit status from the exec API's error channel (a metav1.Status)."""
    if not error_channel:
        return 0
    try:
        status = json.loads(error_channel)
    except ValueError:
        return 1
    if status.get("status") == "Success":
        return 0
    for cause in (status.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            return int(cause.get("message") or 1)
    return 1


def run(kube: Kube, pod: str, argv: Sequence[str], *, interactive: bool | None = None) -> int:
    """Run ``argv`` in the member's container; its exit status."""
    from kubernetes.stream import stream

    tty = sys.stdin.isatty() and sys.stdout.isatty() if interactive is None else interactive
    send_stdin = tty or not sys.stdin.isatty()
    client = kube.call(
        "create",
        "pods/exec",
        pod,
        lambda: stream(
            kube.core.connect_get_namespaced_pod_exec,
            pod,
            kube.namespace,
            container=names.CONTAINER_POSTGRES,
            command=list(argv),
            stdin=send_stdin,
            stdout=True,
            stderr=not tty,
            tty=tty,
            binary=True,
            _preload_content=False,
        ),
    )
    return _interactive(client) if tty else _piped(client, send_stdin)


def _pump(client: Any, fd: int, close: bool) -> None:
    """Copy ``fd`` to the command's stdin until it ends (then close it: psql sees the end of its input)."""
    try:
        while True:
            data = os.read(fd, 65536)
            if not data:
                break
            client.write_stdin(data)
        if close:
            client.close_channel(STDIN)
    except (OSError, ValueError):  # the session ended first
        return
    except Exception:  # the websocket closed under us: nothing more to send
        return


def _drain(client: Any) -> None:
    out, err = sys.stdout.buffer, sys.stderr.buffer
    data = client.read_channel(STDOUT)
    if data:
        out.write(data)
        out.flush()
    data = client.read_channel(STDERR)
    if data:
        err.write(data)
        err.flush()


def _piped(client: Any, send_stdin: bool) -> int:
    if send_stdin:
        threading.Thread(target=_pump, args=(client, sys.stdin.fileno(), True), daemon=True).start()
    while client.is_open():
        client.update(timeout=1)
        _drain(client)
    _drain(client)
    error = client.read_channel(ERROR)
    client.close()
    return exit_code(error.decode() if isinstance(error, bytes) else str(error or ""))


def _interactive(client: Any) -> int:
    import termios
    import tty as terminal

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)

    def resize(*_: object) -> None:
        size = os.get_terminal_size(sys.stdout.fileno())
        try:
            client.write_channel(RESIZE, json.dumps({"Width": size.columns, "Height": size.lines}).encode())
        except Exception:  # the session is over
            return

    previous = signal.signal(signal.SIGWINCH, resize)
    try:
        terminal.setraw(fd)
        resize()
        threading.Thread(target=_pump, args=(client, fd, False), daemon=True).start()
        while client.is_open():
            client.update(timeout=0.2)
            _drain(client)
        _drain(client)
        error = client.read_channel(ERROR)
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        signal.signal(signal.SIGWINCH, previous)
        client.close()
    return exit_code(error.decode() if isinstance(error, bytes) else str(error or ""))
