"""An emulated cluster's directory and the processes it runs, read and driven through files only, so that
`up`, `down`, the e2e driver and a person's shell all see the same cluster:

    DIR/kubeconfig            an administrator's kubeconfig (kubectl, the kubernetes client)
    DIR/operator.kubeconfig   the operator's: the token of the chart's ServiceAccount
    DIR/emulated.json         the API server's URL, the node process, the S3 store, the operator's pid
    DIR/operator.json         the operator's command line and environment (rendered from the chart)
    DIR/node.log              the node process: API server, kubelet and controllers, S3 server
    DIR/operator.log          the operator's output (every run)
    DIR/root/                 pods' directories (root/pods/<ns>/<pod>-<uid>/) and volumes (root/volumes/)
    DIR/s3/                   the S3 server's buckets
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from pgherd_backup.postgres.process import process_table

REPO = Path(__file__).resolve().parents[2]
STATE = "emulated.json"
OPERATOR = "operator.json"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def read_state(directory: Path) -> dict[str, Any]:
    path = directory / STATE
    if not path.exists():
        raise FileNotFoundError(f"{directory} holds no emulated cluster (no {STATE})")
    return dict(json.loads(path.read_text()))


def write_state(directory: Path, **changes: Any) -> dict[str, Any]:
    path = directory / STATE
    state = json.loads(path.read_text()) if path.exists() else {}
    state.update(changes)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    tmp.replace(path)
    return dict(state)


def alive(pid: int | None) -> bool:
    """Whether that process runs (a zombie does not)."""
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def wait_gone(pid: int | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def terminate(pid: int | None, grace: float) -> None:
    """SIGTERM to the process's group (it leads its own session), SIGKILL after `grace` seconds."""
    if not alive(pid):
        return
    assert pid is not None
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        if wait_gone(pid, grace if sig == signal.SIGTERM else 10):
            return


# -- the operator process ---------------------------------------------------------------------------


def operator_pid(directory: Path) -> int | None:
    pid = read_state(directory).get("operatorPid")
    return int(pid) if pid and alive(int(pid)) else None


def start_operator(directory: Path) -> int:
    """Start the operator as the chart's Deployment would start a new pod: a new pod name (its leader
    election identity), the rendered command line and environment, the ServiceAccount's kubeconfig."""
    running = operator_pid(directory)
    if running is not None:
        return running
    spec = json.loads((directory / OPERATOR).read_text())
    pod_name = f"{spec['podNamePrefix']}{secrets.token_hex(3)}"
    argv = [str(arg) for arg in spec["argv"]]
    liveness = free_port()
    argv = [arg.replace("{livenessPort}", str(liveness)) for arg in argv]
    env = {
        "PATH": f"{spec['venvBin']}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(directory),
        "KUBECONFIG": str(directory / "operator.kubeconfig"),
        **{k: v.replace("{podName}", pod_name) for k, v in spec["env"].items()},
    }
    with open(directory / "operator.log", "ab") as log:
        log.write(f"\n==== {time.strftime('%H:%M:%S')} operator pod {pod_name}: {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            cwd=directory, start_new_session=True,
        )  # fmt: skip
    write_state(directory, operatorPid=proc.pid, operatorPod=pod_name, operatorLiveness=liveness)
    return proc.pid


def kill_operator(directory: Path, *, graceful: bool = False) -> None:
    """Kill the operator: SIGKILL (a lost pod), or SIGTERM first with `graceful`."""
    pid = operator_pid(directory)
    if pid is not None:
        terminate(pid, 10) if graceful else _kill(pid)
    write_state(directory, operatorPid=None)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    wait_gone(pid, 10)


def processes_under(directory: Path) -> list[int]:
    """Processes whose command line or environment names `directory` (PostgreSQL's -D; a pod's
    processes have their HOME and TMPDIR in the pod's directory): what a node process killed before
    its pods could leave behind, or a pod's processes."""
    needle = str(directory.resolve()).encode()
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            text = (entry / "cmdline").read_bytes() + b"\0" + (entry / "environ").read_bytes() + b"\0"
        except OSError:
            continue
        # The directory itself or a path under it (not a sibling whose name it begins).
        if needle + b"/" in text or needle + b"\0" in text:
            found.append(int(entry.name))
    return found


def kill_tree(*roots: Path) -> list[int]:
    """kill -9 of every process whose command line names one of `roots` (a pod's directory, its volumes)
    and of all their descendants, all at once as the end of a container's cgroup would: every one is
    stopped (SIGSTOP) first, so that none reacts to another's death, then killed. Returns the pids."""
    found: set[int] = set()
    for root in roots:
        found.update(processes_under(root))
    parents = {pid: entry.ppid for pid, entry in process_table().items()}
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in found} - found
        grew = bool(children)
        found |= children
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
    for pid in found:
        wait_gone(pid, 5)
    return sorted(found)
