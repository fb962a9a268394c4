"""The sandbox (`pgherd sandbox up`): every member is its own
`pgherd instance run` process, driven by the supervisor through its API. Real PostgreSQL, real TLS,
the real supervisor and engine."""

from __future__ import annotations

import contextlib
import os
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgherd.local.pods import _is_agent_of
from pgherd.local.s3server import S3ServerUnavailable, choose_backend
from pgherd.local.sandbox import Sandbox
from pgherd_backup.agent.client import AgentAuthError, AgentClient

try:
    choose_backend()
except S3ServerUnavailable as exc:  # pragma: no cover - the CI image has rclone
    pytest.skip(f"no embedded S3 server here: {exc}", allow_module_level=True)


def _manifest(name: str, instances: int) -> dict[str, Any]:
    return {
        "apiVersion": "pgherd.io/v1alpha1",
        "kind": "PostgresCluster",
        "metadata": {"name": name},
        "spec": {
            "instances": instances,
            "postgresVersion": 15,
            "failover": {"detectionSeconds": 3},
            "parameters": {"shared_buffers": "16MB", "max_connections": "40"},
        },
    }


@pytest.fixture
def agent_sandbox(work_root: Path) -> Iterator[Callable[..., Sandbox]]:
    made: list[Sandbox] = []

    def up(instances: int, restart_delay: float = 1.0) -> Sandbox:
        sandbox = Sandbox(work_root / f"agents-{uuid.uuid4().hex[:6]}")
        made.append(sandbox)
        name = f"ag{uuid.uuid4().hex[:4]}"
        sandbox.up(_manifest(name, instances), timeout=240, restart_delay=restart_delay)
        return sandbox

    yield up
    for sandbox in made:
        with contextlib.suppress(Exception):
            sandbox.down()


def _wait(
    sandbox: Sandbox, predicate: Callable[[dict[str, Any]], bool], what: str, timeout: float = 90
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = sandbox.status()
        if predicate(status):
            return status
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {status.get('phase')} {status.get('message')}")


def _first_write(sandbox: Sandbox, timeout: float = 60) -> float:
    """Seconds until a write through the rw DSN succeeds."""
    dsn = sandbox.status()["rwDsn"].replace("connect_timeout='2'", "connect_timeout='1'")
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("SET statement_timeout = '2s'")
                conn.execute("CREATE TABLE IF NOT EXISTS probe (at timestamptz DEFAULT now())")
                conn.execute("INSERT INTO probe DEFAULT VALUES")
            return time.monotonic() - started
        except psycopg.Error:
            time.sleep(0.05)
    raise AssertionError(f"no successful write within {timeout:.0f}s")


def _member(status: dict[str, Any], name: str) -> dict[str, Any]:
    return next(m for m in status["members"] if m["name"] == name)


def _agent_pid(sandbox: Sandbox, name: str) -> int:
    return int((sandbox.paths.member_dir(name) / "agent.pid").read_text())


def test_one_member_runs_on_its_agent_and_a_crashed_postgres_is_promoted_in_place(
    agent_sandbox: Callable[..., Sandbox],
) -> None:
    sandbox = agent_sandbox(1)
    status = sandbox.status()
    primary = status["primary"]
    member = _member(status, primary)
    assert member["agent"].startswith("https://127.0.0.1:") and member["startError"] is None
    # The credentials live in the sandbox directory, readable by their owner only.
    certs = sandbox.paths.root / "certs"
    assert stat.S_IMODE(certs.stat().st_mode) == 0o700
    for path in certs.iterdir():
        if path.suffix in (".key", "") or path.name.endswith("password") or path.name.startswith("token"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    token = (certs / "token").read_text().strip()
    client = AgentClient(member["agent"], ca_file=certs / "ca.crt", token=token, server_hostname=primary)
    agent = client.status()
    assert agent.role == "primary" and agent.member == primary
    with pytest.raises(AgentAuthError):
        AgentClient(
            member["agent"], ca_file=certs / "ca.crt", token="wrong", server_hostname=primary
        ).status()
    _first_write(sandbox)
    timeline = status["timeline"]
    pid = _agent_pid(sandbox, primary)

    sandbox.kill(primary, postgres_only=True)
    took = _first_write(sandbox)
    after = _wait(sandbox, lambda s: s["phase"] == "Running" and (s["timeline"] or 0) > timeline, "in place")
    # The same member, its agent never restarted: the agent started PostgreSQL read-only at once, and
    # the engine promoted it in place.
    assert after["primary"] == primary and _agent_pid(sandbox, primary) == pid
    assert took < 15, took


def test_three_members_a_lost_pod_is_restarted_and_rejoins(agent_sandbox: Callable[..., Sandbox]) -> None:
    sandbox = agent_sandbox(3, restart_delay=1.0)
    status = sandbox.status()
    primary = status["primary"]
    replicas = [m["name"] for m in status["members"] if m["name"] != primary]
    assert len({m["agent"] for m in status["members"]}) == 3
    victim = replicas[0]
    pid = _agent_pid(sandbox, victim)

    sandbox.kill(victim)  # the agent and its PostgreSQL together: a lost pod
    assert not _is_agent_of(pid, victim)
    _wait(
        sandbox,
        lambda s: (
            _agent_pid(sandbox, victim) != pid and _member(s, victim)["streaming"] and s["phase"] == "Running"
        ),
        "the lost pod restarted and streaming",
    )
    assert sandbox.status()["primary"] == primary
    _first_write(sandbox)

    pids = [_agent_pid(sandbox, m["name"]) for m in status["members"]]
    sandbox.down()
    assert not any(_is_agent_of(p, m["name"]) for p, m in zip(pids, status["members"], strict=True))
    assert not os.path.exists(sandbox.paths.root)
