"""A cluster whose run was killed before `down` (its processes gone, its bridge still there) must not
block the next `up` on the machine: `up` brings down what it left from its state.json. A cluster whose
processes still run is refused, never torn down. Played with a bridge of the test's own name, so that
nothing of a real cluster is touched; runs as root with no other localkube cluster on the machine."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.localkube import host, lock, up
from e2e.localkube.processes import start_time
from e2e.localkube.settings import Layout, Ports, Settings
from e2e.localkube.state import State

BRIDGE = "lkstale0"
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or host.bridge_exists("lk0"),
    reason="needs root, iproute2, and no localkube cluster on the machine (bridge lk0)",
)


@pytest.fixture
def lock_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "localkube.lock"
    monkeypatch.setattr(lock, "LOCK_FILE", path)
    yield path
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)


def former_cluster(directory: Path, settings: Settings, pid: int, ticks: int) -> None:
    directory.mkdir()
    State(Layout(directory)).update(
        dir=str(directory), settings=settings.to_json(), bridge=settings.bridge,
        processes={"etcd": {"pid": pid, "startTime": ticks}},
    )  # fmt: skip
    subprocess.run(["ip", "link", "add", settings.bridge, "type", "bridge"], check=True)


def settings() -> Settings:
    return Settings(bridge=BRIDGE, ports=Ports(base=29400))


def test_the_remains_of_a_killed_cluster_are_brought_down(tmp_path: Path, lock_file: Path) -> None:
    owner = tmp_path / "former"
    former_cluster(owner, settings(), pid=2**22 + 1, ticks=1)  # above pid_max's default: no such process
    with lock.held(timeout=5) as fd:
        lock.set_owner(fd, owner)
        up.claim_machine(fd, tmp_path / "next", settings())
        assert lock.owner(fd) is None
    assert not host.bridge_exists(BRIDGE)


def test_a_cluster_that_runs_is_refused_and_left_alone(tmp_path: Path, lock_file: Path) -> None:
    owner = tmp_path / "running"
    ticks = start_time(os.getpid())
    assert ticks is not None
    former_cluster(owner, settings(), pid=os.getpid(), ticks=ticks)  # this test's process: alive
    with lock.held(timeout=5) as fd:
        lock.set_owner(fd, owner)
        with pytest.raises(lock.Busy, match="only one can run on a machine"):
            up.claim_machine(fd, tmp_path / "next", settings())
        assert lock.owner(fd) == owner
    assert host.bridge_exists(BRIDGE)
