"""One localkube cluster per machine: kube-proxy's iptables chains (KUBE-SERVICES, ...), the kubelet's
device-plugin socket (/var/lib/kubelet/device-plugins) and the fixed folders of containerd's shims and
of libcni are global names, so a second cluster would break the first.

LOCK_FILE is held (flock) while `up` or `down` works, and names the directory of the cluster that runs
(its owner) in between. A second `up` is refused while the owner's processes run or its bridge exists."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = Path(os.environ.get("PGHERD_LOCALKUBE_LOCK", "/run/pgherd-localkube.lock"))


class Busy(RuntimeError):
    """Another cluster owns the machine, or another `up`/`down` is at work."""


@contextlib.contextmanager
def held(timeout: float) -> Iterator[int]:
    """The lock file, flocked; waits up to `timeout` seconds for another `up`/`down` to finish."""
    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise Busy(
                        f"another `python -m e2e.localkube up` or `down` holds {LOCK_FILE}; wait for it"
                    ) from None
                time.sleep(0.2)
        yield fd
    finally:
        os.close(fd)


def owner(fd: int) -> Path | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode().strip()
    return Path(text) if text else None


def set_owner(fd: int, directory: Path | None) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    if directory is not None:
        os.write(fd, f"{directory}\n".encode())
