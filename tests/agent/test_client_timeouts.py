"""The operator's calls to an agent cut off by a partition: packets dropped, no reset. A fence's call may
wait 30 s for its answer, but a connection that does not open, or a TLS handshake that does not
finish, fails within CONNECT_TIMEOUT: the fence then deletes the pod (kube/actions.py) within seconds of
the failover's decision, not after the whole call's timeout. Real sockets: a listener whose accept queue
is full drops the SYNs (the kernel's own partition), and one that accepts and never speaks holds a TLS
handshake forever."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from pgherd_backup.agent.client import CONNECT_TIMEOUT, AgentClient, AgentUnreachable
from pgherd_backup.agent.wire import FenceRequest


@pytest.fixture
def full_listener() -> Iterator[int]:
    """A port whose SYNs go unanswered: listen(0) and its accept queue filled, never accepted."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    time.sleep(0.2)
    yield port
    for s in [*fillers, server]:
        s.close()


@pytest.fixture
def mute_listener() -> Iterator[int]:
    """A port that accepts connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield server.getsockname()[1]
    server.close()


def _fence_fails_fast(client: AgentClient) -> str:
    started = time.monotonic()
    with pytest.raises(AgentUnreachable) as failed:
        client.act(FenceRequest(reason="a partition"), timeout=30)
    assert time.monotonic() - started < CONNECT_TIMEOUT + 1.5
    return failed.value.message


def test_a_connection_that_does_not_open_fails_within_the_connect_timeout(full_listener: int) -> None:
    message = _fence_fails_fast(AgentClient(f"http://127.0.0.1:{full_listener}", token="t"))
    assert f"no connection within {CONNECT_TIMEOUT:g}s" in message


def test_a_tls_handshake_that_does_not_finish_fails_within_the_connect_timeout(
    mute_listener: int, certs
) -> None:
    _fence_fails_fast(AgentClient(f"https://127.0.0.1:{mute_listener}", ca_file=certs.ca, token="t"))


def test_an_answer_may_still_take_the_calls_whole_timeout(mute_listener: int) -> None:
    # Connected at once (the listener's queue accepts it), then silence: the call's own timeout holds.
    client = AgentClient(f"http://127.0.0.1:{mute_listener}", token="t")
    started = time.monotonic()
    with pytest.raises(AgentUnreachable, match="within 4s"):
        client.act(FenceRequest(reason="slow"), timeout=4)
    assert time.monotonic() - started >= 3.5
