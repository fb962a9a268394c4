"""The sandbox's platform over real members (each its own `pgherd instance run` process), driven action
by action (no supervisor, no engine): the `LocalCluster` the `local_cluster` fixture (conftest.py) hands
to the tests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import psycopg

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import actions as act
from pgherd.engine.lsn import parse_lsn
from pgherd.engine.view import MemberView, member_name
from pgherd.local.layout import SandboxPaths
from pgherd.local.platform import LocalPlatform
from pgherd_backup.agent.client import AgentError
from pgherd_backup.agent.wire import Status

RESTART_DELAY = 0.5


class LocalCluster:
    """The platform under test, with the few verbs the tests need."""

    def __init__(self, platform: LocalPlatform, spec: PostgresClusterSpec) -> None:
        self.platform = platform
        self.spec = spec

    @property
    def paths(self) -> SandboxPaths:
        return self.platform.paths

    def name(self, ordinal: int) -> str:
        return member_name(self.platform.state.cluster, ordinal)

    def apply(self, action: act.Action) -> None:
        self.platform.apply(action, self.spec)

    def wait_idle(self, name: str, timeout: float = 120) -> None:
        """Wait for the member's worker (restart, rejoin, demote...) to finish."""
        deadline = time.monotonic() + timeout
        while self.platform.busy(name):
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} still busy after {timeout:.0f}s")
            time.sleep(0.05)

    def tick(self) -> None:
        """One round of the supervisor's platform duties: keep members running, then observe."""
        self.platform.keep_running(self.spec)
        self.platform.observe_members()

    def member(self, name: str, answer_wait: float = 10.0) -> MemberView:
        """The member as the platform observes it. A running agent that did not answer within the
        observation's 1 s (a loaded machine: CI's main suite) is asked again, up to ``answer_wait``: the
        tests judge what it says, not the machine's speed."""
        deadline = time.monotonic() + answer_wait
        while True:
            views, _ = self.platform.observe_members()
            view = next(view for view in views if view.name == name)
            if view.reachable or not self.platform.pods.running(name) or time.monotonic() > deadline:
                return view
            time.sleep(0.2)

    def status(self, name: str) -> Status:
        """The member's /status, asked now."""
        return self.platform.client(name).status(timeout=5)

    def running(self, name: str) -> bool:
        """Its agent reports PostgreSQL alive (running, or starting)."""
        try:
            return self.status(name).postmaster in ("running", "starting")
        except AgentError:
            return False

    def sql(self, name: str, query: str, params: tuple[Any, ...] | None = None) -> list[tuple[Any, ...]]:
        with (
            psycopg.connect(self.platform.superuser_dsn(name), autocommit=True, connect_timeout=5) as conn,
            conn.cursor() as cur,
        ):
            cur.execute(query, params)
            return list(cur.fetchall()) if cur.description else []

    def value(self, name: str, query: str) -> Any:
        return self.sql(name, query)[0][0]

    def lsn(self, name: str, query: str) -> int | None:
        text = self.value(name, query)
        return None if text is None else parse_lsn(str(text))

    def in_recovery(self, name: str) -> bool:
        return bool(self.value(name, "SELECT pg_is_in_recovery()"))

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                if predicate():
                    return
            except Exception as exc:  # not up yet
                last = exc
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what} ({last})")

    def wait_streaming(self, name: str) -> None:
        self.wait_until(lambda: self.status(name).streaming, f"{name} streaming", timeout=120)

    def create(self, instances: int) -> None:
        """The members, through the platform's own CreateMember actions: initdb for the first (a
        primary), pg_basebackup from it for the others."""
        primary = self.name(0)
        self.add(
            [act.CreateMember(primary, 0, act.Seed.INITDB, "r1")],
            lambda: self.status(primary).role == "primary" and self.status(primary).ready,
            f"{primary} running as the primary",
        )
        self.platform.current_primary = primary
        replicas = [
            act.CreateMember(self.name(ordinal), ordinal, act.Seed.BASEBACKUP, "r1", primary, primary)
            for ordinal in range(1, instances)
        ]
        self.add(
            replicas, lambda: all(self.status(a.member).streaming for a in replicas), "the replicas streaming"
        )

    def add(
        self, creates: list[act.CreateMember], done: Callable[[], bool], what: str, timeout: float = 180
    ) -> None:
        """CreateMember, issued again after each observation as the engine does while a member reports no
        data, until ``done``: its pod first, then (once its agent answers for the empty volume) the
        actuator's seed, in the member's worker, then idle. Timed out: the agents' last words in the
        error."""

        def created() -> bool:
            self.platform.observe_members()
            for action in creates:
                self.apply(action)
            return done()

        try:
            self.wait_until(created, what, timeout)
            for action in creates:  # the seed's answer (its worker) may come after its effect
                self.wait_idle(action.member)
        except AssertionError as exc:
            logs = [self.platform.pods.log_file(a.member) for a in creates]
            tails = [
                f"{log}:\n" + "\n".join(log.read_text().splitlines()[-15:]) for log in logs if log.exists()
            ]
            raise AssertionError("\n".join([str(exc), *tails])) from None

    def shut_down(self) -> None:
        for name in list(self.platform.members):
            with contextlib.suppress(AssertionError):
                self.wait_idle(name, timeout=60)
        for name in list(self.platform.members):
            with contextlib.suppress(Exception):
                self.platform.pods.kill(name)  # the agent and its PostgreSQL: nothing to keep
