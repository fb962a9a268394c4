"""The operator's /status polls keep their connection to the agent open (a TLS handshake per poll cost
more than the poll): a GET over HTTP/1.1 stays open on the agent's side, a client with a `Connections`
pool reuses it, actions never do, and a connection the agent closed meanwhile (the agent restarted) is
replaced without the poll failing."""

from __future__ import annotations

import http.client
import json
import ssl
import time
from collections.abc import Iterator

import pytest
from agent_helpers import MEMBERS, Agent

from pgherd_backup.agent.client import AgentClient, Connections

NAME = MEMBERS[0]


@pytest.fixture(scope="module")
def primary(module_agents) -> Iterator[Agent]:  # type: ignore[no-untyped-def]
    yield module_agents.primary(NAME)


def _client(agent: Agent, pool: Connections | None) -> AgentClient:
    return AgentClient(
        f"https://127.0.0.1:{agent.port}", ca_file=agent.certs.ca, token=agent.certs.token, connections=pool
    )


def _key(agent: Agent) -> tuple[str, int, None]:
    return ("127.0.0.1", agent.port, None)


def test_status_polls_reuse_one_connection(primary: Agent) -> None:
    pool = Connections()
    client = _client(primary, pool)
    client.status()
    first = pool.take(_key(primary))
    assert first is not None and first.sock is not None, "the first poll's connection was not kept"
    local = first.sock.getsockname()
    pool.give(_key(primary), first)
    for _ in range(3):
        assert client.status().role == "primary"
    again = pool.take(_key(primary))
    assert again is first and again.sock is not None and again.sock.getsockname() == local
    pool.close()


def test_actions_and_clients_without_a_pool_close_their_connection(primary: Agent) -> None:
    pool = Connections()
    _client(primary, pool).checkpoint(reason="a test")
    assert len(pool) == 0, "an action's connection was kept"
    assert _client(primary, None).status().role == "primary"  # one connection per call, as before


def test_the_agent_keeps_an_http11_get_open_and_closes_the_rest(primary: Agent) -> None:
    context = ssl.create_default_context(cafile=str(primary.certs.ca))
    auth = {"Authorization": f"Bearer {primary.certs.token}"}
    connection = http.client.HTTPSConnection("127.0.0.1", primary.port, timeout=10, context=context)
    try:
        for _ in range(2):  # two requests on one connection
            connection.request("GET", "/status", headers=auth)
            response = connection.getresponse()
            assert response.status == 200 and json.loads(response.read())["role"] == "primary"
            assert response.getheader("Connection") == "keep-alive" and not response.will_close
        connection.request("GET", "/status", headers={**auth, "Connection": "close"})
        response = connection.getresponse()
        response.read()
        assert response.will_close, "a request that asked to close was kept open"
    finally:
        connection.close()
    refused = http.client.HTTPSConnection("127.0.0.1", primary.port, timeout=10, context=context)
    try:
        refused.request("GET", "/status")  # no credential: answered, then closed
        response = refused.getresponse()
        response.read()
        assert response.status == 401 and response.will_close
    finally:
        refused.close()


def test_a_poll_on_a_connection_the_restarted_agent_closed_succeeds(primary: Agent) -> None:
    pool = Connections(reuse=60.0)
    client = _client(primary, pool)
    client.status()
    before = pool.take(_key(primary))
    assert before is not None
    pool.give(_key(primary), before)
    primary.stop()
    primary.start()
    client.status()  # on the connection the stopped agent closed, then once more on a new one
    kept = pool.take(_key(primary))
    assert kept is not None and kept.sock is not None, "the new connection was not kept"
    assert kept is not before, "the poll after the restart did not open a new connection"
    pool.close()
    kept.close()


def test_idle_connections_are_closed_after_their_reuse_time() -> None:
    pool = Connections(reuse=0.2)
    key = ("127.0.0.1", 1, None)
    pool.give(key, http.client.HTTPConnection("127.0.0.1", 1))
    time.sleep(0.3)
    assert pool.take(key) is None
    pool.give(key, http.client.HTTPConnection("127.0.0.1", 1))
    pool.give(("127.0.0.1", 2, None), http.client.HTTPConnection("127.0.0.1", 2))
    time.sleep(0.3)
    pool.give(("127.0.0.1", 3, None), http.client.HTTPConnection("127.0.0.1", 3))
    assert len(pool) == 1, "expired connections were not pruned when another was given back"
    pool.close()
    assert len(pool) == 0
