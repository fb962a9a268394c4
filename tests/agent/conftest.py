"""Fixtures for the instance agent: certificates from `pgherd instance certs`, and agents run by the
real CLI on free ports of 127.0.0.1 (stopped at the end, their PostgreSQL with them)."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from agent_helpers import Agent, Certs, make_certs


@pytest.fixture(scope="session")
def certs(work_root: Path) -> Certs:
    return make_certs(work_root / "agent-certs")


class Agents:
    """make(name, *flags) -> a started Agent whose volume is this test's (or module's) own."""

    def __init__(self, root: Path, certs: Certs) -> None:
        self.root = root
        self.certs = certs
        self.made: list[Agent] = []

    def __call__(
        self, name: str, *flags: str, start: bool = True, wait: bool = True, env: dict[str, str] | None = None
    ) -> Agent:
        agent = Agent(name, self.root / name, self.certs, flags=list(flags), env=env or {})
        self.made.append(agent)
        return agent.start(wait=wait) if start else agent

    def cleanup(self) -> None:
        for agent in self.made:
            agent.cleanup()
        shutil.rmtree(self.root, ignore_errors=True)  # a shared machine: give the disk space back now


def _agents(work_root: Path, certs: Certs, label: str) -> Iterator[Agents]:
    root = work_root / f"agents-{label[:40]}-{uuid.uuid4().hex[:6]}"
    root.mkdir(mode=0o755)
    agents = Agents(root, certs)
    try:
        yield agents
    finally:
        agents.cleanup()


@pytest.fixture
def agents(work_root: Path, certs: Certs, request: pytest.FixtureRequest) -> Iterator[Callable[..., Agent]]:
    yield from _agents(work_root, certs, request.node.name)


@pytest.fixture(scope="module")
def module_agents(work_root: Path, certs: Certs, request: pytest.FixtureRequest) -> Iterator[Agents]:
    yield from _agents(work_root, certs, request.module.__name__)
