"""TCP ports for the servers the sandbox and the tests start on this machine.

Ports come from below the kernel's ephemeral range, never from a bind to port 0: every outgoing
connection draws its source port from that range, so a port picked there can be taken by a client
socket before the server binds it, and the server fails with "Address already in use". A port is
also never handed out twice in a short while by one process: callers pick several before binding any.
"""

from __future__ import annotations

import secrets
import socket
import threading
from collections import deque
from pathlib import Path

LOWEST = 21000  # above localkube's own ports (20200 and up), which its components bind again on a restart
HIGHEST = 30000  # below Kubernetes' NodePort range (30000-32767) as well
RECENT = 1024  # how many handed-out ports are remembered; the oldest were bound or freed long ago
ATTEMPTS = 500

_recent: deque[int] = deque(maxlen=RECENT)
_lock = threading.Lock()


class NoFreePorts(RuntimeError):
    pass


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for client connections' source ports (Linux's default if unreadable)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _span(count: int) -> tuple[int, int]:
    """Where bases are drawn from: below the ephemeral range if it leaves room, else above it, else
    (a range set to cover nearly every port) the usual span, where only the bind check protects."""
    low, high = ephemeral_range()
    top = min(low, HIGHEST) - count
    if top - LOWEST > 1000:
        return LOWEST, top
    if 65536 - count - (high + 1) > 1000:
        return high + 1, 65536 - count
    return LOWEST, HIGHEST - count


def _free(host: str, ports: range) -> bool:
    sockets: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, port))
    except OSError:
        return False
    finally:
        for sock in sockets:
            sock.close()
    return True


def free_port_range(count: int, host: str = "127.0.0.1") -> int:
    """A base port such that base..base+count-1 are free on `host` now and none was handed out lately."""
    first, last = _span(count)
    with _lock:
        for _ in range(ATTEMPTS):
            base = first + secrets.randbelow(last - first)
            ports = range(base, base + count)
            if any(port in _recent for port in ports) or not _free(host, ports):
                continue
            _recent.extend(ports)
            return base
    raise NoFreePorts(f"no {count} free consecutive ports in {first}-{last + count - 1} on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, not handed out lately."""
    return free_port_range(1, host)
