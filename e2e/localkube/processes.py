"""The cluster's processes: each started in a session of its own with its output in DIR/logs/NAME.log,
known by its pid and its start time (so that a pid the kernel gave to another process since is never
signalled), stopped by SIGTERM and then SIGKILL."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.localkube.settings import Layout

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: never dlopen in a child forked from threads


class StartError(RuntimeError):
    """A component did not start or did not become ready; the message says which and ends with its log."""


@dataclass(frozen=True)
class Process:
    name: str
    pid: int
    start_time: int  # clock ticks after boot (/proc/PID/stat field 22): with the pid, one process

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "startTime": self.start_time}

    @classmethod
    def from_json(cls, name: str, data: dict[str, Any]) -> Process:
        return cls(name, int(data["pid"]), int(data["startTime"]))

    @property
    def alive(self) -> bool:
        """Running, and still the process that was started (a zombie is not running)."""
        stat = _stat(self.pid)
        return stat is not None and stat[0] != "Z" and int(stat[19]) == self.start_time


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: state first (field 3), start time at index 19 (field 22)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    stat = _stat(pid)
    return None if stat is None else int(stat[19])


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that started it exits (PR_SET_PDEATHSIG)."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start(
    layout: Layout,
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    die_with_parent: bool = False,
) -> Process:
    """Start `argv` in a new session (no terminal signal reaches it after `up` returns), its output in
    DIR/logs/NAME.log; its pid goes to DIR/pids/NAME.json at once, so that `down` finds it even when
    `up` is killed before it records the process in DIR/state.json. ``die_with_parent``: killed when
    this process dies, however it dies (a test session's control plane; never a cluster of `up`,
    which outlives the command)."""
    log = layout.log(name)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None, start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent else None,
        )  # fmt: skip
    ticks = start_time(proc.pid)
    process = Process(name, proc.pid, -1 if ticks is None else ticks)  # -1: gone already
    layout.pids.mkdir(parents=True, exist_ok=True)
    (layout.pids / f"{name}.json").write_text(json.dumps(process.to_json()))
    return process


def recorded(layout: Layout) -> list[Process]:
    """The processes whose pid files are in DIR/pids."""
    if not layout.pids.is_dir():
        return []
    return [
        Process.from_json(path.stem, json.loads(path.read_text()))
        for path in sorted(layout.pids.glob("*.json"))
    ]


def forget(layout: Layout, name: str) -> None:
    (layout.pids / f"{name}.json").unlink(missing_ok=True)


def stop(process: Process, grace: float) -> bool:
    """SIGTERM to the process's session group, SIGKILL after `grace` seconds. True if it was running."""
    if not process.alive:
        return False
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        deadline = time.monotonic() + wait
        while process.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        if not process.alive:
            break
    return True


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def log_tail(log: Path, lines: int = 25) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return f"(no log at {log})"
    return "\n".join(f"    {line}" for line in text.splitlines()[-lines:])


def wait_until(
    what: str,
    check: Callable[[], bool],
    *,
    timeout: float,
    process: Process | None = None,
    log: Path | None = None,
) -> None:
    """Poll `check` until it holds; StartError when `process` exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    delay = 0.1
    while True:
        try:
            if check():
                return
        except StartError:
            raise
        except Exception:  # not ready yet (connection refused, not found, ...)
            pass
        if process is not None and not process.alive:
            raise StartError(
                f"{process.name} exited before {what}; {log} ends with:\n{log_tail(log) if log else ''}"
            )
        if time.monotonic() > deadline:
            tail = f"; {log} ends with:\n{log_tail(log)}" if log else ""
            raise StartError(f"{what}: not within {timeout:.0f} s{tail}")
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)


def processes_matching(predicate: Callable[[list[str]], bool]) -> list[int]:
    """Pids whose command line (argv) satisfies `predicate`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if predicate([arg.decode(errors="replace") for arg in argv if arg]):
            found.append(int(entry.name))
    return found
