"""The partition tool of the localkube driver (e2e/localkube/partition.py) on real addresses: a network
namespace of the test's own behind a veth pair. Cut off, a new connection times out and an established
one goes silent (no reset: the raw table comes before connection tracking), both ways; healed, both
work again and no rule of ours is left. Runs as root with iproute2 and iptables."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator

import pytest
from e2e.localkube import partition

NETNS = "pgherd-part-test"
HOST_IF, NS_IF = "pgpt0", "pgpt1"
HOST_IP, NS_IP = "10.251.77.1", "10.251.77.2"
PORT = 29581

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("iptables"),
    reason="needs root, iproute2 and iptables",
)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def peer() -> Iterator[subprocess.Popen[bytes]]:
    """An echo server in a namespace of its own, at NS_IP, reached from this host at HOST_IP."""
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True, check=False)
    ip("netns", "add", NETNS)
    try:
        ip("link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        ip("link", "set", NS_IF, "netns", NETNS)
        ip("addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
        ip("link", "set", HOST_IF, "up")
        ip("-n", NETNS, "addr", "add", f"{NS_IP}/30", "dev", NS_IF)
        ip("-n", NETNS, "link", "set", NS_IF, "up")
        server = subprocess.Popen(
            ["ip", "netns", "exec", NETNS, "python3", "-c", ECHO, NS_IP, str(PORT)], stdout=subprocess.PIPE
        )
        assert server.stdout is not None and server.stdout.readline() == b"ready\n"
        yield server
        server.kill()
        server.wait(10)
    finally:
        partition.heal()
        subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", NETNS], capture_output=True, check=False)


ECHO = """
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
print("ready", flush=True)
def serve(c):
    while (data := c.recv(100)):
        c.sendall(data)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""


def echo(conn: socket.socket, data: bytes) -> bytes:
    conn.sendall(data)
    return conn.recv(100)


def test_a_partition_silences_new_and_established_connections_both_ways_until_healed(
    peer: subprocess.Popen[bytes],
) -> None:
    established = socket.create_connection((NS_IP, PORT), timeout=2)
    assert echo(established, b"before") == b"before"

    assert partition.partition([[HOST_IP], [NS_IP]]) == [(HOST_IP, NS_IP), (NS_IP, HOST_IP)]
    assert partition.partition([[HOST_IP], [NS_IP]])  # again: replaced, not added twice
    assert len([r for r in partition.rules() if r.startswith("-A PGHERD-PARTITION")]) == 2
    with pytest.raises(TimeoutError):
        socket.create_connection((NS_IP, PORT), timeout=1.5)
    established.settimeout(1.5)
    with pytest.raises(TimeoutError):  # silence: no reset, no answer
        echo(established, b"during")
    # From the other side too: the namespace reaches nothing of this host.
    probe = subprocess.run(
        ["ip", "netns", "exec", NETNS, "python3", "-c",
         f"import socket; socket.create_connection(('{HOST_IP}', 22), timeout=1.5)"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert probe.returncode != 0 and "timed out" in probe.stderr, probe.stderr

    partition.heal()
    assert partition.rules() == []
    # The established connection lives on: TCP retransmits what the partition dropped.
    established.settimeout(20)
    established.sendall(b"after")
    received = b""
    while len(received) < len(b"duringafter"):
        received += established.recv(100)
    assert received == b"duringafter"
    established.close()
    with socket.create_connection((NS_IP, PORT), timeout=2) as fresh:
        assert echo(fresh, b"healed") == b"healed"
    partition.heal()  # a second time: nothing to do, no error


def test_groups_may_not_share_an_address() -> None:
    with pytest.raises(ValueError, match="in two groups"):
        partition.pairs([["10.0.0.1", "10.0.0.2"], ["10.0.0.2"]])
    assert partition.pairs([["a"], ["b", "c"], ["d"]]) == [
        ("a", "b"), ("a", "c"), ("a", "d"), ("b", "a"), ("c", "a"), ("b", "d"), ("c", "d"), ("d", "a"),
        ("d", "b"), ("d", "c"),
    ]  # fmt: skip
