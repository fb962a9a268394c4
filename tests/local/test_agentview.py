"""The agent's /status as the engine's MemberView (pgherd.agentview): pure, no PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from pgherd.agentview import fetch_statuses, member_view, port_resolver, restore_job_view
from pgherd.engine.quorum import SyncConfig
from pgherd.engine.view import JobKind, JobState, Role
from pgherd_backup.agent.client import AgentClient
from pgherd_backup.agent.wire import ActionOutcome, ActionProgress, Status, WalReceiver

RESOLVE = port_resolver({5432: "c-0", 5433: "c-1", 5434: "c-2"})


def _status(**fields: Any) -> Status:
    base: dict[str, Any] = {"member": "c-1", "cluster": "c", "data_present": True, "revision": "r1"}
    return Status(**{**base, **fields})


def test_a_streaming_replica() -> None:
    status = _status(
        role="replica",
        postmaster="running",
        ready=True,
        timeline=3,
        received_lsn="0/3000100",
        replayed_lsn="0/3000060",
        held_lsn="0/3000100",
        wal_receiver=WalReceiver(status="streaming", upstream="127.0.0.1:5432", received_timeline=3),
        synchronous_standby_names="",
        kept_aside=("/v/kept/a", "/v/kept/b"),
    )
    view = member_view("c-1", 1, status, resolve_upstream=RESOLVE)
    assert view.reachable and view.role is Role.REPLICA and view.exists
    assert (view.timeline, view.received_lsn, view.replayed_lsn, view.held_lsn) == (
        3,
        0x3000100,
        0x3000060,
        0x3000100,
    )
    assert view.wal_receiver_streaming and view.upstream == "c-0" and view.streams_from("c-0")
    assert view.ready and view.revision == "r1" and view.kept_aside == 2
    assert not view.stopped and view.shutdown_clean is None and view.sync == SyncConfig()


def test_a_primary_reports_its_sync_configuration() -> None:
    status = _status(
        role="primary",
        postmaster="running",
        ready=True,
        synchronous_standby_names='ANY 1 ("c-1", "c-2")',
        received_lsn="0/5000000",
        held_lsn="0/4FFFFF0",
    )
    view = member_view("c-0", 0, status, resolve_upstream=RESOLVE)
    assert view.is_primary and view.sync == SyncConfig(1, frozenset({"c-1", "c-2"}))
    assert view.held_lsn == 0x4FFFFF0 and view.upstream is None


def test_a_fenced_stopped_member_reports_its_final_wal_end() -> None:
    status = _status(
        role="unknown",
        postmaster="stopped",
        fenced=True,
        timeline=2,
        held_lsn="0/7000028",
        final_lsn="0/7000028",
        shutdown_clean=True,
    )
    view = member_view("c-0", 0, status, resolve_upstream=RESOLVE)
    assert not view.reachable and view.role is Role.UNKNOWN
    assert view.stopped and view.fenced and view.shutdown_clean is True
    assert view.received_lsn == view.held_lsn == 0x7000028
    assert view.sync is None  # only what is in force on a running member counts


def test_a_crashed_postgres_under_a_live_agent_is_stopped_until_restarted() -> None:
    crashed = member_view("c-0", 0, _status(postmaster="crashed", crashes=1), resolve_upstream=RESOLVE)
    assert crashed.stopped and not crashed.reachable and crashed.exists
    starting = member_view("c-0", 0, _status(postmaster="starting"), resolve_upstream=RESOLVE)
    assert not starting.stopped and not starting.reachable


@pytest.mark.parametrize("action", ["rejoin", "promote", "restart", "unfence", "demote", "seed"])
def test_a_member_an_action_may_start_is_not_stopped(action: str) -> None:
    view = member_view("c-1", 1, _status(postmaster="stopped", action=action), resolve_upstream=RESOLVE)
    assert not view.stopped


def test_a_member_whose_agent_carries_out_an_action_is_busy() -> None:
    """The engine never makes it a switchover target: its agent would take a Promote only after it."""
    streaming = {"role": "replica", "postmaster": "running", "ready": True}
    assert member_view("c-1", 1, _status(**streaming, action="rejoin"), resolve_upstream=RESOLVE).busy
    assert not member_view("c-1", 1, _status(**streaming), resolve_upstream=RESOLVE).busy


def test_a_fence_in_progress_does_not_hide_the_stop() -> None:
    view = member_view(
        "c-1", 1, _status(postmaster="stopped", action="fence", fenced=True), resolve_upstream=RESOLVE
    )
    assert view.stopped


def test_an_agent_that_does_not_answer_says_nothing_of_postgres() -> None:
    view = member_view("c-2", 2, None, resolve_upstream=RESOLVE)
    assert view.exists and not view.reachable and not view.stopped and view.data_present
    assert view.held_lsn is None and view.revision is None


def test_a_lost_pod_is_stopped_and_still_exists() -> None:
    view = member_view("c-2", 2, None, resolve_upstream=RESOLVE, process_gone=True)
    assert view.exists and view.stopped and not view.reachable


def test_a_member_being_restored_is_neither_stopped_nor_without_data() -> None:
    status = _status(postmaster="stopped", data_present=False)
    view = member_view("c-0", 0, status, resolve_upstream=RESOLVE, filling=True)
    assert view.data_present and not view.stopped
    gone = member_view("c-0", 0, None, resolve_upstream=RESOLVE, process_gone=True, filling=True)
    assert not gone.stopped


def test_an_agent_answering_for_an_empty_volume_is_no_member_yet() -> None:
    """Both platforms: the engine issues CreateMember for it (the actuator seeds it) or restores into it;
    its agent never fills it on its own, a volume lost since included."""
    view = member_view("c-1", 1, _status(data_present=False), resolve_upstream=RESOLVE)
    assert not view.exists and not view.data_present and not view.reachable and view.stopped
    fenced = member_view("c-1", 1, _status(data_present=False, fenced=True), resolve_upstream=RESOLVE)
    assert not fenced.exists and fenced.fenced


def test_an_agent_seeding_its_empty_volume_is_a_member_at_work() -> None:
    view = member_view("c-1", 1, _status(data_present=False, action="seed"), resolve_upstream=RESOLVE)
    assert view.exists and not view.data_present and not view.stopped


def test_terminating_is_passed_on() -> None:
    status = _status(role="primary", postmaster="running", terminating=True)
    assert member_view("c-0", 0, status, resolve_upstream=RESOLVE).terminating


def test_an_unknown_upstream_is_none() -> None:
    status = _status(
        role="replica",
        postmaster="running",
        wal_receiver=WalReceiver(status="waiting", upstream="10.0.0.9:6000"),
    )
    view = member_view("c-1", 1, status, resolve_upstream=RESOLVE)
    assert view.upstream is None and not view.wal_receiver_streaming
    assert port_resolver({})("no-port") is None


class _Handler(BaseHTTPRequestHandler):
    delay: dict[int, float] = {}

    def do_GET(self) -> None:
        time.sleep(self.delay.get(self.server.server_address[1], 0))  # type: ignore[index]
        body = json.dumps(_status(role="replica", postmaster="running").to_dict()).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the client gave up

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def servers() -> Iterator[list[ThreadingHTTPServer]]:
    made = [ThreadingHTTPServer(("127.0.0.1", 0), _Handler) for _ in range(3)]
    for server in made:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield made
    for server in made:
        server.shutdown()
        server.server_close()


def test_statuses_are_fetched_in_parallel_and_a_slow_agent_is_unknown(
    servers: list[ThreadingHTTPServer],
) -> None:
    slow = servers[2].server_address[1]
    _Handler.delay = {slow: 3.0}
    clients = {
        f"c-{i}": AgentClient(f"http://127.0.0.1:{server.server_address[1]}", token="t")
        for i, server in enumerate(servers)
    }
    # A closed port: refused at once.
    clients["c-3"] = AgentClient("http://127.0.0.1:1", token="t")
    started = time.monotonic()
    statuses = fetch_statuses(clients, timeout=0.5)
    assert time.monotonic() - started < 2.0
    assert statuses["c-0"] is not None and statuses["c-1"] is not None
    assert statuses["c-0"].role == "replica"
    assert statuses["c-2"] is None and statuses["c-3"] is None
    assert fetch_statuses({}) == {}


def test_a_restore_in_progress_is_a_running_job_in_its_stage() -> None:
    progress = ActionProgress("restore", "replaying", "r1", "20250101T000000Z", None, 99, 99)
    status = _status(postmaster="running", role="replica", action="restore", action_progress=progress)
    view = restore_job_view("r1", "c-0", status)
    assert (view.kind, view.name, view.state, view.member, view.stage) == (
        JobKind.RESTORE,
        "r1",
        JobState.RUNNING,
        "c-0",
        "replaying",
    )
    # Another restore in progress is not this one; an agent that does not answer: as last seen.
    other = _status(action="restore", action_progress=ActionProgress("restore", "restoring", "r0"))
    assert restore_job_view("r1", "c-0", other).state is JobState.FAILED
    assert restore_job_view("r1", "c-0", None, "replaying").stage == "replaying"
    assert restore_job_view("r1", "c-0", None).state is JobState.RUNNING


def test_a_finished_restore_is_its_last_action() -> None:
    done = _status(role="primary", last_action=ActionOutcome("restore", True, "r1", timeline=3))
    view = restore_job_view("r1", "c-0", done)
    assert view.state is JobState.SUCCEEDED and view.timeline == 3
    failed = _status(last_action=ActionOutcome("restore", False, "r1", error="no snapshot 'x'"))
    view = restore_job_view("r1", "c-0", failed, "restoring")
    assert view.state is JobState.FAILED and view.message == "no snapshot 'x'"
    # The agent answers but knows nothing of it (its state was lost): failed, saying so.
    forgotten = restore_job_view("r1", "c-0", _status(last_action=ActionOutcome("restore", True, "r0")))
    assert forgotten.state is JobState.FAILED and "no record of restore r1" in forgotten.message


def test_the_isolation_order_follows_the_voters_and_is_off_during_operations() -> None:
    from pgherd.agentview import isolation_order
    from pgherd_backup.agent.isolation import IsolationOrder

    assert isolation_order(3, 3, steady=True) == IsolationOrder(seconds=15, peers=1)
    assert isolation_order(10, 5, steady=True) == IsolationOrder(seconds=30, peers=2)
    assert isolation_order(3, 2, steady=True).peers == 1  # the replica is needed for a majority of two
    assert isolation_order(3, 1, steady=True).peers == 0  # a single member is its own majority
    assert isolation_order(3, 3, steady=False).peers == 0  # an upgrade may leave it alone on purpose
    order = isolation_order(3, 3, steady=True)
    assert IsolationOrder.parse(order.render()) == order
    assert IsolationOrder.parse("seconds=x;peers=1") is None and IsolationOrder.parse(None) is None
