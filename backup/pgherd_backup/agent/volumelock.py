"""One agent at a time on a member's volume.

A member's pod made again while the old pod's processes are still being stopped (force-deleted, or
evicted from a node cut off) can start on the same node and volume. PostgreSQL's own guard
(postmaster.pid, its shared memory) does not see a postmaster in another pod's PID and IPC namespaces,
and an agent that finds a postmaster of its own namespace running stops it as a stray: either way two
agents on one data directory would harm it. So the agent holds an exclusive flock on a file of the
volume for its whole life, taken before it reads or writes anything there; the kernel drops it when
the old agent's process ends, whatever ended it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("pgherd.agent")

LOCK_FILE = ".pgherd-agent.lock"
POLL = 0.1  # seconds between tries: the next agent starts this soon after the old one ends
REMIND = 30.0  # seconds between the log lines of a long wait


def hold_volume(volume: Path) -> int | None:
    """Wait until no other agent holds ``volume``, then hold it until this process ends: the lock's
    file descriptor (kept open, not inherited by children). None on a filesystem without locks, or
    one where the file cannot be made: said in the log, and the agent goes on as before."""
    path = volume / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        log.warning("cannot open %s (%s): starting without the volume's lock", path, exc.strerror)
        return None
    started = time.monotonic()
    reminded: float | None = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # ENOLCK, EOPNOTSUPP: no locks here
                os.close(fd)
                log.warning("cannot lock %s (%s): starting without the volume's lock", path, exc.strerror)
                return None
            now = time.monotonic()
            if reminded is None or now - reminded >= REMIND:
                reminded = now
                log.warning(
                    "another agent holds %s (a previous pod of this member, still stopping?): "
                    "waiting until it exits before touching the data directory (%.0f s so far)",
                    path,
                    now - started,
                )
            time.sleep(POLL)
            continue
        if reminded is not None:
            log.info("the volume is free after %.1f s: starting", time.monotonic() - started)
        return fd
