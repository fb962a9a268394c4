"""The operator's side of the members' agents (operator/pgherd/kube/agents.py): an acknowledged fence
stands for a member whose agent stopped answering (a terminating primary's agent exits once fenced),
as long as nothing else was sent to it and its data volume (which keeps the fence) is the same."""

from __future__ import annotations

import asyncio
import contextlib

from pgherd.agentview import member_view
from pgherd.kube.agents import Agents
from pgherd_backup.agent.client import AgentClient
from pgherd_backup.agent.tls import certificate_facts, make_ca
from pgherd_backup.agent.wire import ActionResult, Status

FENCED = ActionResult("fence", detail="stopped", final_lsn="0/3000148", shutdown_clean=True, timeline=2)


def agents() -> Agents:
    return Agents("db", token="t", ca_pem=None, server_hostname=lambda member: member)


def unreachable(_: AgentClient) -> ActionResult:
    raise OSError("connection refused")


def answering(member: str) -> Status:
    return Status(member=member, cluster="db", role="replica", postmaster="running", data_present=True)


def test_an_acknowledged_fence_stands_for_a_member_that_no_longer_answers() -> None:
    remote = agents()
    remote.remember_fence("db-0", "uid-a", FENCED)
    statuses = remote.with_fences({"db-0": None, "db-1": answering("db-1")}, {"db-0": "uid-a", "db-1": "u"})
    status = statuses["db-0"]
    assert status is not None and status.fenced and status.postmaster == "stopped"
    view = member_view("db-0", 0, status, resolve_upstream=lambda _: None)
    # What a switchover needs of the old primary: fenced, stopped cleanly, where its WAL ends.
    assert view.fenced and view.stopped and view.shutdown_clean and view.received_lsn == 0x3000148
    assert view.timeline == 2
    # Its pod gone, or made again on the same volume, its agent not answering yet: still fenced.
    assert remote.with_fences({}, {"db-0": "uid-a"})["db-0"] is not None


def test_the_fence_is_forgotten_once_the_member_answers_or_has_another_volume() -> None:
    remote = agents()
    remote.remember_fence("db-0", "uid-a", FENCED)
    assert remote.with_fences({"db-0": answering("db-0")}, {"db-0": "uid-a"})["db-0"] == answering("db-0")
    assert remote.with_fences({"db-0": None}, {"db-0": "uid-a"})["db-0"] is None  # forgotten
    remote.remember_fence("db-0", "uid-a", FENCED)
    assert remote.with_fences({"db-0": None}, {"db-0": "uid-b"})["db-0"] is None  # another volume
    remote.remember_fence("db-0", "uid-a", FENCED)
    assert remote.with_fences({"db-0": None}, {})["db-0"] is None  # its volume gone


def test_any_other_action_sent_to_the_member_forgets_the_fence() -> None:
    async def scenario() -> None:
        remote = agents()
        for what in ("promote", "fence"):
            remote.remember_fence("db-0", "uid-a", FENCED)
            # The call fails; it may still have reached the agent.
            with contextlib.suppress(OSError):
                await remote.call("db-0", "127.0.0.1", what, unreachable)
            remembered = remote.with_fences({"db-0": None}, {"db-0": "uid-a"})["db-0"] is not None
            assert remembered == (what == "fence"), what
        remote.remember_fence("db-0", "uid-a", FENCED)
        remote.spawn("db-0", "127.0.0.1", "unfence", lambda c: None)
        assert remote.with_fences({"db-0": None}, {"db-0": "uid-a"})["db-0"] is None
        await remote.close()

    asyncio.run(scenario())


def test_a_long_action_to_a_pod_gone_does_not_hold_back_the_members_new_pod() -> None:
    """Seen on localkube: a rejoin sent to the old primary's terminating pod (its address no longer
    answers: the call waits for its timeout) kept the member busy, and the rejoin of its new pod, up at
    once on another address, waited about two minutes. A long action is busy only for the pod it went to."""

    async def run() -> None:
        remote = agents()
        release = asyncio.Event()
        loop = asyncio.get_running_loop()
        calls: list[str] = []

        def stuck(client: AgentClient) -> ActionResult:
            calls.append(client.base_url)
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result()
            return ActionResult("rejoin")

        def quick(client: AgentClient) -> ActionResult:
            calls.append(client.base_url)
            return ActionResult("rejoin")

        assert remote.spawn("db-0", "10.0.0.5", "rejoin", stuck)
        await asyncio.sleep(0.05)
        assert remote.busy("db-0", "10.0.0.5") and not remote.spawn("db-0", "10.0.0.5", "rejoin", quick)
        # Its new pod, on another address: not busy; the rejoin goes there at once.
        assert not remote.busy("db-0", "10.0.0.9")
        assert remote.spawn("db-0", "10.0.0.9", "rejoin", quick)
        for _ in range(100):
            if len(calls) == 2:
                break
            await asyncio.sleep(0.01)
        assert calls == ["https://10.0.0.5:8008", "https://10.0.0.9:8008"]
        release.set()
        await remote.close()

    asyncio.run(run())


def test_every_call_to_a_clusters_agents_uses_one_tls_context_trusting_its_ca() -> None:
    """A client is made per call; building a context reads the CA file (0.28 ms a call, 3,000 polls a
    second at 2,000 clusters): one per cluster, trusting that cluster's CA alone."""
    ca_pem, _ = make_ca("db")
    remote = Agents("db", token="t", ca_pem=ca_pem.decode(), server_hostname=lambda member: member)
    try:
        first, second = remote.client("db-0", "10.0.0.1"), remote.client("db-1", "10.0.0.2")
        assert first._context is not None and first._context is second._context
        trusted = first._context.get_ca_certs()
        name = certificate_facts(ca_pem.decode()).common_name
        assert len(trusted) == 1 and f"('commonName', '{name}')" in str(trusted[0]["subject"])
    finally:
        asyncio.run(remote.close())


def test_a_clusters_tls_context_is_built_only_when_an_agent_is_called() -> None:
    """A context holds ~17 KB: 34 MB at 2,000 clusters before any has a member to call."""
    ca_pem, _ = make_ca("db")
    remote = Agents("db", token="t", ca_pem=ca_pem.decode(), server_hostname=lambda member: member)
    try:
        assert remote._context is None
        client = remote.client("db-0", "10.0.0.1")
        assert client._context is not None and remote._context is client._context
    finally:
        asyncio.run(remote.close())
