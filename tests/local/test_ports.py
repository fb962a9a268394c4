"""The ports the sandbox and the tests pick for their servers (`pgherd.local.ports`).

A port picked by binding port 0 comes from the kernel's ephemeral range, which every outgoing
connection also draws its source port from: between the pick and the server's own bind, a client
socket can take it, and the server fails with "Address already in use" (seen in CI on 2026-12-07,
an agent test's PostgreSQL)."""

from __future__ import annotations

import socket

from pgherd.local.ports import ephemeral_range, free_port


def test_a_free_port_is_never_one_a_client_connection_could_take() -> None:
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(200)]
    inside = [port for port in ports if low <= port <= high]
    assert not inside, f"{len(inside)} of 200 ports in the ephemeral range {low}-{high}: {inside[:5]}"


def test_a_port_is_never_handed_out_twice_by_one_process() -> None:
    # Nothing binds them between the calls, as when a test picks an agent's three ports at once.
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)


def test_a_port_that_something_holds_is_never_handed_out() -> None:
    held = []
    try:
        for _ in range(50):
            sock = socket.socket()
            sock.bind(("127.0.0.1", free_port()))
            sock.listen()
            held.append(sock)
        taken = {sock.getsockname()[1] for sock in held}
        assert not taken & {free_port() for _ in range(500)}
    finally:
        for sock in held:
            sock.close()
