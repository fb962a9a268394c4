"""Issue 31, item 1: both platforms carry out the engine's member actions through one actuator. The same
action sequences run through the sandbox's and Kubernetes' Platform, each member's agent a recording
HTTP server on its own loopback address (real AgentClient calls), and both must have asked the agents
the same: which member, which action, which parameters, in which order."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pgherd import actuator
from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import actions as act
from pgherd.engine.quorum import SyncConfig
from pgherd.kube import actions as kube_actions
from pgherd.kube import names
from pgherd.kube.agents import Agents
from pgherd.kube.observe import ClusterObjects
from pgherd.local.layout import SandboxPaths, write_json
from pgherd.local.objects import ObjectStore
from pgherd.local.platform import LocalPlatform
from pgherd.local.ports import free_port_range
from pgherd.local.postgres.resolve import resolve
from pgherd.local.state import MemberState, S3Endpoint, SandboxState
from pgherd_backup.agent.client import AgentClient, AgentError
from pgherd_backup.agent.wire import ActionOutcome, Status

CLUSTER = "demo"
NAMESPACE = "parity"
MEMBERS = [f"{CLUSTER}-{i}" for i in range(3)]
Request = tuple[str, str, dict[str, Any]]  # (member, action, body)


def _ip(member: str) -> str:
    return f"127.0.0.{int(member.rsplit('-', 1)[1]) + 2}"


class Recorder:
    """One HTTP server per member, at the member's loopback address: each POST /actions/<name> is
    recorded and answered as done."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._servers: dict[str, ThreadingHTTPServer] = {}

    def start(self, member: str) -> None:
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                action = self.path.rsplit("/", 1)[1]
                with recorder._lock:
                    recorder.requests.append((member, action, body))
                answer = json.dumps({"action": action, "changed": True, "detail": "done"}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer((_ip(member), self.port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._servers[member] = server

    def client(self, member: str) -> AgentClient:
        return AgentClient(f"http://{_ip(member)}:{self.port}")

    def take(self) -> list[Request]:
        with self._lock:
            taken, self.requests = self.requests, []
        return taken

    def close(self) -> None:
        for server in self._servers.values():
            server.shutdown()
            server.server_close()


@dataclass
class Scenario:
    """The members' last observed /status (None: observed, no answer) and whose agent listens."""

    statuses: dict[str, Status | None]
    listening: set[str]
    current_primary: str
    actions: Sequence[act.Action]
    effects: list[str] = field(default_factory=list)
    backups: list[dict[str, Any]] = field(default_factory=list)  # the Backup objects, as stored


def _status(member: str, role: str, **fields: Any) -> Status:
    return Status(
        member=member, cluster=CLUSTER, role=role, postmaster="running", data_present=True, **fields
    )


class FakeApi:
    """What Kubernetes is asked (its effects, outside this comparison), answered as done."""

    def __init__(self, effects: list[str]) -> None:
        self.effects = effects

    async def create(self, kind: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.effects.append(f"create {kind}")
        return body

    async def patch(self, kind: str, namespace: str, name: str, patch: Any, **_: Any) -> dict[str, Any]:
        self.effects.append(f"patch {kind} {name}")
        return {}

    async def delete(self, kind: str, namespace: str, name: str, **_: Any) -> None:
        self.effects.append(f"delete {kind} {name}")


def _pod(member: str, status: Status | None) -> dict[str, Any]:
    """The member's pod, at the revision its agent reports."""
    labels = {} if status is None or status.revision is None else {names.LABEL_REVISION: status.revision}
    return {
        "metadata": {"name": member, "namespace": NAMESPACE, "uid": f"uid-{member}", "labels": labels},
        "status": {
            "podIP": _ip(member),
            "phase": "Running",
            "containerStatuses": [
                {"name": names.CONTAINER_POSTGRES, "started": True, "state": {"running": {}}}
            ],
        },
    }


def run_on_kubernetes(recorder: Recorder, scenario: Scenario, address: Callable[[str], str]) -> list[Request]:
    async def run() -> list[Request]:
        agents = Agents(
            CLUSTER, token="t", ca_pem=None, server_hostname=lambda _: None, scheme="http", port=recorder.port
        )
        cluster = {"metadata": {"name": CLUSTER, "namespace": NAMESPACE, "uid": "c"}}
        objects = ClusterObjects(
            cluster=cluster,
            pods=[_pod(m, scenario.statuses.get(m)) for m in MEMBERS],
            rw_slices=[],
            statefulset={"spec": {"replicas": len(MEMBERS)}},
            backups=scenario.backups,
        )

        async def event(e: act.RecordEvent) -> None:
            scenario.effects.append(f"event {e.reason}")

        async def event_on(_: Any, e: act.RecordEvent) -> None:
            await event(e)

        ctx = kube_actions.ActContext(
            api=FakeApi(scenario.effects),  # type: ignore[arg-type]
            objects=objects,
            spec=PostgresClusterSpec.model_validate({"instances": len(MEMBERS)}),
            statuses=scenario.statuses,
            agents=agents,
            current_primary=scenario.current_primary,
            member_address=address,
            may_act=lambda: True,
            snapshot_job=lambda *_: {},
            prune_job=lambda _: {},
            event=event,
            event_on=event_on,
            restores=None,  # type: ignore[arg-type]
        )
        asked: list[Request] = []
        for action in scenario.actions:
            await kube_actions.apply_all(ctx, (action,))
            while any(agents.busy(m) for m in MEMBERS):  # one action's calls at a time: their order holds
                await asyncio.sleep(0.01)
            asked += recorder.take()
        await agents.close()
        return asked

    return asyncio.run(run())


def run_in_the_sandbox(platform: LocalPlatform, recorder: Recorder, scenario: Scenario) -> list[Request]:
    platform._statuses = dict(scenario.statuses)
    for backup in scenario.backups:
        write_json(platform.paths.backups / f"{backup['metadata']['name']}.json", backup)
    platform.current_primary = scenario.current_primary
    asked: list[Request] = []
    for action in scenario.actions:
        try:
            platform.apply(action, PostgresClusterSpec.model_validate({"instances": len(MEMBERS)}))
        except Exception as exc:  # as the supervisor's apply_actions: a failed action stops the list
            scenario.effects.append(f"failed {type(action).__name__}: {exc}")
            break
        deadline = time.monotonic() + 30
        while any(platform.busy(m) for m in MEMBERS) and time.monotonic() < deadline:
            time.sleep(0.01)
        asked += recorder.take()
    return asked


@pytest.fixture
def sandbox(work_root: Path, sandbox_certs: Path) -> Iterator[tuple[LocalPlatform, Recorder]]:
    """A sandbox platform whose members' agents are the recorder's servers (its processes are not
    started: the actuator reaches them through ``client``, and asks ``pod_running`` of them)."""
    root = work_root / f"actuator-{time.monotonic_ns()}"
    root.mkdir()
    shutil.copytree(sandbox_certs, root / "certs")
    base = free_port_range(len(MEMBERS))
    state = SandboxState(
        cluster=CLUSTER,
        base_port=base,
        agent_base_port=free_port_range(len(MEMBERS)),
        store_url="s3://unused/demo",
        s3=S3Endpoint(endpoint="http://127.0.0.1:9", access_key="a", secret_key="s", embedded=False),
        superuser_password="pw",
        app_user="app",
        app_database="app",
        app_password="app",
        pg_bindir=str(resolve(15).bindir),
    )
    paths = SandboxPaths(root)
    state.save(paths)
    platform = LocalPlatform(paths, state, ObjectStore(paths))
    recorder = Recorder(free_port_range(1))
    for ordinal, member in enumerate(MEMBERS):
        platform.members[member] = MemberState(member, ordinal, state.port_of(ordinal))
    yield platform, recorder
    recorder.close()
    shutil.rmtree(root, ignore_errors=True)


def _compare(
    sandbox: tuple[LocalPlatform, Recorder], scenario: Callable[[], Scenario]
) -> tuple[list[Request], Scenario, Scenario]:
    platform, recorder = sandbox
    local, kube = scenario(), scenario()
    for member in local.listening:
        recorder.start(member)
    running = set(MEMBERS)
    killed: list[str] = []
    platform.client = recorder.client  # type: ignore[method-assign]
    platform.pod_running = lambda name: name in running  # type: ignore[method-assign]
    platform.pods.kill = killed.append  # type: ignore[method-assign]
    in_sandbox = run_in_the_sandbox(platform, recorder, local)
    on_kubernetes = run_on_kubernetes(recorder, kube, platform.address)
    local.effects += [f"kill {m}" for m in killed]
    assert in_sandbox == on_kubernetes
    return in_sandbox, local, kube


def test_a_switchover_asks_the_same_of_the_agents_on_both_platforms(
    sandbox: tuple[LocalPlatform, Recorder],
) -> None:
    old, new, other = MEMBERS
    sync = SyncConfig(k=1, standbys=frozenset({new}))

    def scenario() -> Scenario:
        return Scenario(
            statuses={
                old: _status(old, "primary", synchronous_standby_names=""),
                new: _status(new, "replica", synchronous_standby_names=""),
                other: _status(
                    other, "replica", last_action=ActionOutcome(name="upgrade", ok=True, request_id="u1")
                ),
            },
            listening=set(MEMBERS),
            current_primary=old,
            actions=[
                act.SetSynchronousStandbys(old, sync, reason="switchover"),
                act.SetSynchronousStandbys(new, SyncConfig(), reason="already in force: skipped"),
                act.Rejoin(other, upstream=old, reason="follow"),
                act.Fence(old, reason="switchover"),
                act.Promote(new, reason="switchover"),
                act.SetPrimary(new, reason="switchover"),
                act.Rejoin(old, upstream=new, reason="switchover"),
                act.Rejoin(new, upstream=new, reason="to itself: refused"),
                act.DropReplicationSlot(new, "demo-0", reason="gone"),
                act.Unfence(other, reason="abandoned"),
                act.Demote(other, reason="count its WAL"),
                act.CheckUpgrade(other, 16, "u1", reason="ended already: not sent"),
                act.CheckUpgrade(old, 16, "u2", reason="upgrade"),
            ],
        )

    asked, _, _ = _compare(sandbox, scenario)
    assert [(member, action) for member, action, _ in asked] == [
        (old, "set-sync"),
        (MEMBERS[2], "rejoin"),
        (old, "fence"),
        (new, "promote"),
        (old, "rejoin"),
        (new, "drop-slot"),
        (other, "unfence"),
        (other, "demote"),
        (old, "upgrade"),
    ]
    assert asked[0][2]["value"] == sync.render()
    assert asked[4][2]["upstream"] == sandbox[0].address(new)
    assert asked[5][2]["slot"] == "demo_0"
    assert asked[6][2]["primary"] is False
    assert asked[8][2]["check"] is True and asked[8][2]["requestId"] == "u2"


@pytest.mark.parametrize("silent", [True, False], ids=["silent at observation", "refusing the fence"])
def test_a_failover_with_an_unanswering_primary_asks_the_same_of_the_agents_on_both_platforms(
    sandbox: tuple[LocalPlatform, Recorder], silent: bool
) -> None:
    """The old primary's agent did not answer this pass's /status (not asked again: stopped at once), or
    answered it and then refuses the fence's connection (asked, then stopped)."""
    old, new, other = MEMBERS

    def scenario() -> Scenario:
        return Scenario(
            statuses={
                old: None if silent else _status(old, "primary"),
                new: _status(new, "replica"),
                other: _status(other, "replica"),
            },
            listening={new, other},
            current_primary=old,
            actions=[
                act.Fence(old, reason="failover"),
                act.Promote(new, reason="failover"),
                act.SetPrimary(new, reason="failover"),
                act.Rejoin(other, upstream=new, reason="failover"),
            ],
        )

    asked, local, kube = _compare(sandbox, scenario)
    assert [(member, action) for member, action, _ in asked] == [(new, "promote"), (other, "rejoin")]
    # Each platform stopped the unanswering member its own way.
    assert f"delete Pod {old}" in kube.effects
    assert f"kill {old}" in local.effects


def test_a_planned_primary_restart_asks_the_same_of_the_agents_on_both_platforms(
    sandbox: tuple[LocalPlatform, Recorder],
) -> None:
    """At the new revision already (Kubernetes: its new pod; the sandbox: its agent restarted), the
    primary came back read-only: it starts read-write only on this explicit order. Not for a replica,
    a fenced member, or one at work."""
    old, new, other = MEMBERS

    def scenario() -> Scenario:
        return Scenario(
            statuses={
                old: _status(old, "replica", revision="r2"),
                new: _status(new, "replica", revision="r2", fenced=True),
                other: _status(other, "replica", revision="r2"),
            },
            listening=set(MEMBERS),
            current_primary=old,
            actions=[
                act.RestartMember(old, "r2", primary=True, reason="rollout"),
                act.RestartMember(new, "r2", primary=True, reason="fenced: not restarted"),
                act.RestartMember(other, "r2", reason="a replica at its revision: nothing to do"),
            ],
        )

    asked, _, _ = _compare(sandbox, scenario)
    assert asked == [(old, "restart", {"reason": "rollout", "revision": "r2", "primary": True})]


def _empty(member: str) -> Status:
    """An agent that answers for an empty volume, with nothing running: to be seeded."""
    return Status(member=member, cluster=CLUSTER, data_present=False)


def _backup(name: str, **status: Any) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": "Backup",
        "metadata": {"name": name, "namespace": NAMESPACE, "creationTimestamp": "2026-12-05T08:00:00Z"},
        "spec": {"cluster": {"name": CLUSTER}},
        "status": status,
    }


def test_creating_members_asks_the_same_seed_of_the_agents_on_both_platforms(
    sandbox: tuple[LocalPlatform, Recorder],
) -> None:
    """CreateMember: each platform has its member (the sandbox's process, Kubernetes' pod: both there
    already), and the actuator seeds it once its agent answers for an empty volume: initdb for the first,
    pg_basebackup from the primary for a replica, a snapshot (a Backup's, or a snapshot id) recovered to a
    target. Not a member that holds data or is at work, nor from a Backup without a snapshot."""
    first, replica, restored = MEMBERS
    target = "time:2026-12-05T08:30:00Z"

    def scenario() -> Scenario:
        return Scenario(
            statuses={first: _empty(first), replica: _empty(replica), restored: _empty(restored)},
            listening=set(MEMBERS),
            current_primary=first,
            backups=[
                _backup("nightly", phase="Completed", backupId="20261205T080000Z"),
                _backup("running", phase="Running"),
            ],
            actions=[
                act.CreateMember(first, 0, act.Seed.INITDB, "r1", reason="new cluster"),
                act.CreateMember(replica, 1, act.Seed.BASEBACKUP, "r1", first, first, reason="scale"),
                act.CreateMember(
                    restored,
                    2,
                    act.Seed.SNAPSHOT,
                    "r1",
                    source="nightly",
                    target=target,
                    reason="from a Backup",
                ),
                act.CreateMember(
                    restored, 2, act.Seed.SNAPSHOT, "r1", snapshot_id="S1", reason="from a snapshot id"
                ),
                act.CreateMember(
                    restored, 2, act.Seed.SNAPSHOT, "r1", source="running", reason="no snapshot yet: refused"
                ),
                act.CreateMember(
                    restored, 2, act.Seed.SNAPSHOT, "r1", source="missing", reason="no such Backup: refused"
                ),
            ],
        )

    asked, local, kube = _compare(sandbox, scenario)
    address = sandbox[0].address(first)

    def seed(reason: str, method: str, **fields: str) -> dict[str, Any]:
        return {
            "reason": reason,
            "method": method,
            "upstream": None,
            "snapshot": None,
            "target": None,
            **fields,
        }

    assert asked == [
        (first, "seed", seed("new cluster", "initdb")),
        (replica, "seed", seed("scale", "basebackup", upstream=address)),
        # The Backup's snapshot, by its id: the agent finds snapshots in the store by id, not by Backup.
        (restored, "seed", seed("from a Backup", "snapshot", snapshot="20261205T080000Z", target=target)),
        (restored, "seed", seed("from a snapshot id", "snapshot", snapshot="S1")),
    ]
    assert not [e for e in local.effects + kube.effects if e.startswith("failed")]


def test_a_member_seeded_or_at_work_is_not_seeded_again_on_either_platform(
    sandbox: tuple[LocalPlatform, Recorder],
) -> None:
    """Its agent reports data, or an action in progress (a seed already), or no answer: nothing asked."""
    first, replica, silent = MEMBERS

    def scenario() -> Scenario:
        return Scenario(
            statuses={
                first: _status(first, "primary"),
                replica: Status(member=replica, cluster=CLUSTER, data_present=False, action="seed"),
                silent: None,
            },
            listening=set(MEMBERS),
            current_primary=first,
            actions=[
                act.CreateMember(first, 0, act.Seed.INITDB, "r1", reason="holds data"),
                act.CreateMember(replica, 1, act.Seed.BASEBACKUP, "r1", first, first, reason="seeding"),
                act.CreateMember(silent, 2, act.Seed.BASEBACKUP, "r1", first, first, reason="silent"),
            ],
        )

    asked, _, _ = _compare(sandbox, scenario)
    assert asked == []


def test_the_sandbox_starts_a_new_member_as_any_pod_and_seeds_it_once_its_agent_answers(
    sandbox: tuple[LocalPlatform, Recorder],
) -> None:
    """No seed flags: the new pod's agent waits with its empty volume (as after any restart, a member
    restarted before its seed completed included), and the engine's next CreateMember seeds it."""
    platform, recorder = sandbox
    first, _, new = MEMBERS
    del platform.members[new]
    recorder.start(new)
    started: list[tuple[str, int, str | None]] = []

    def start(name: str, ordinal: int, revision: str | None, env: Any) -> int:
        started.append((name, ordinal, revision))
        return 1

    platform.client = recorder.client  # type: ignore[method-assign]
    platform.pods.start = start  # type: ignore[method-assign]
    platform.pod_running = lambda name: any(s[0] == name for s in started)  # type: ignore[method-assign]
    spec = PostgresClusterSpec.model_validate({"instances": len(MEMBERS)})
    create = act.CreateMember(new, 2, act.Seed.BASEBACKUP, "r2", first, first, reason="scale")

    platform.apply(create, spec)
    assert started == [(new, 2, "r2")] and "--seed" not in platform.pods.command(new, 2, "r2")
    assert platform.members[new].revision == "r2" and recorder.take() == []

    platform._statuses[new] = _empty(new)  # its agent answers for the empty volume: no member yet
    platform.apply(create, spec)
    deadline = time.monotonic() + 30
    while platform.busy(new) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert started == [(new, 2, "r2")]  # not started again
    assert [(m, a, b["upstream"]) for m, a, b in recorder.take()] == [(new, "seed", platform.address(first))]


def test_a_member_record_written_with_seed_flags_is_read(sandbox: tuple[LocalPlatform, Recorder]) -> None:
    platform, _ = sandbox
    member = MEMBERS[1]
    old = {"name": member, "ordinal": 1, "port": 5433, "seed": ["--seed", "initdb"], "notes": []}
    write_json(platform.paths.member_state(member), old)
    loaded = MemberState.load(platform.paths, member)
    assert loaded is not None and loaded.name == member and loaded.port == 5433


class _Guarded:
    """The part of a Platform set_sync looks at: one member, busy or without an address."""

    def __init__(self, *, reachable: bool, busy: bool, value: str) -> None:
        self._reachable, self._busy, self.value, self.calls = reachable, busy, value, 0

    def status(self, member: str) -> Status:
        return _status(member, "replica", synchronous_standby_names=self.value)

    def reachable(self, member: str) -> bool:
        return self._reachable

    def busy(self, member: str) -> bool:
        return self._busy

    async def call(self, member: str, what: str, fn: Callable[[AgentClient], Any]) -> Any:
        self.calls += 1


@pytest.mark.parametrize(("reachable", "busy"), [(True, True), (False, False)])
def test_a_set_sync_that_cannot_be_sent_fails_so_that_no_promote_follows_it(
    reachable: bool, busy: bool
) -> None:
    """Both platforms stop a pass at its first failure: a set-sync skipped in silence let the Promote
    after it run without the new primary's synchronous standbys."""
    wanted = SyncConfig(k=1, standbys=frozenset({"demo-0", "demo-2"}))
    platform = _Guarded(reachable=reachable, busy=busy, value="")
    with pytest.raises(AgentError, match="synchronous_standby_names not set on demo-1"):
        asyncio.run(actuator.set_sync(platform, act.SetSynchronousStandbys("demo-1", wanted)))  # type: ignore[arg-type]
    # In force already: nothing to send, nothing failed.
    platform.value = wanted.render()
    asyncio.run(actuator.set_sync(platform, act.SetSynchronousStandbys("demo-1", wanted)))  # type: ignore[arg-type]
    assert platform.calls == 0
