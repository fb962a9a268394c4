"""Fixtures for the instance agent: certificates from `pgherd instance certs`, and agents run by the
real CLI on free ports of 127.0.0.1 (stopped at the end, their PostgreSQL with them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from agent_helpers import MEMBERS, Agent, Certs, SlowProxy, make_certs

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:  # e2e.testca (a CA of the test's own); the `pytest` script does not put it there
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def certs(work_root: Path) -> Certs:
    return make_certs(work_root / "agent-certs")


@pytest.fixture(scope="session")
def template(work_root: Path, certs: Certs) -> Iterator[Path]:
    """A volume whose member was seeded by initdb, then fenced as the primary and its agent stopped.
    Tests that need a primary but not its initdb start from a copy (initdb's fsyncs cost seconds on a
    busy disk) and unfence it as the primary: an order the agent obeys, on timeline 1."""
    agent = Agent(MEMBERS[7], work_root / "agent-template", certs, flags=["--seed", "initdb"])
    try:
        agent.start()
        agent.client.fence(reason="the template of the tests' primaries")
    finally:
        agent.cleanup()
    yield agent.volume


class Agents:
    """make(name, *flags) -> a started Agent whose volume is this test's (or module's) own;
    primary(name, *flags) -> a started primary copied from the template."""

    def __init__(
        self,
        root: Path,
        certs: Certs,
        template: Path | None = None,
        discard: Callable[[Path], None] | None = None,
    ) -> None:
        self.root = root
        self.certs = certs
        self.template = template
        self.discard = discard
        self.made: list[Agent] = []

    def primary(self, name: str, *flags: str, env: dict[str, str] | None = None) -> Agent:
        assert self.template is not None, "primary() needs the template fixture"
        volume = self.root / name
        (volume / "agent").mkdir(parents=True)
        os.chmod(volume, 0o755)
        subprocess.run(["cp", "-a", str(self.template / "data"), str(volume / "data")], check=True)
        shutil.copy(self.template / "agent" / "state.json", volume / "agent" / "state.json")
        agent = self(name, *flags, env=env)
        assert agent.status().postmaster == "stopped"  # fenced: nothing starts before an order
        agent.client.unfence(primary=True, reason="a test's primary")
        return agent

    def __call__(
        self, name: str, *flags: str, start: bool = True, wait: bool = True, env: dict[str, str] | None = None
    ) -> Agent:
        agent = Agent(name, self.root / name, self.certs, flags=list(flags), env=env or {})
        self.made.append(agent)
        return agent.start(wait=wait) if start else agent

    def cleanup(self) -> None:
        stopping = [threading.Thread(target=agent.cleanup) for agent in self.made]  # all at once
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()
        # A shared machine: give the disk space back now (in the background while the next test runs).
        if self.discard is not None:
            self.discard(self.root)
        else:
            shutil.rmtree(self.root, ignore_errors=True)


def _agents(
    work_root: Path,
    certs: Certs,
    label: str,
    template: Path | None = None,
    discard: Callable[[Path], None] | None = None,
) -> Iterator[Agents]:
    root = work_root / f"agents-{label[:40]}-{uuid.uuid4().hex[:6]}"
    root.mkdir(mode=0o755)
    agents = Agents(root, certs, template, discard)
    try:
        yield agents
    finally:
        agents.cleanup()


@pytest.fixture
def agents(
    work_root: Path,
    certs: Certs,
    template: Path,
    discard: Callable[[Path], None],
    request: pytest.FixtureRequest,
) -> Iterator[Agents]:
    yield from _agents(work_root, certs, request.node.name, template, discard)


@pytest.fixture(scope="module")
def module_agents(
    work_root: Path,
    certs: Certs,
    template: Path,
    discard: Callable[[Path], None],
    request: pytest.FixtureRequest,
) -> Iterator[Agents]:
    yield from _agents(work_root, certs, request.module.__name__, template, discard)


@pytest.fixture
def s3_proxy(s3_store):
    """The test's S3 server behind a proxy (no delay until a test sets one)."""
    port = int(s3_store.endpoint.endpoint_url.rsplit(":", 1)[1])
    proxy = SlowProxy(port, 0.0)
    yield proxy
    proxy.close()
