"""The WAL service: restore_command answers "not archived" without starting the agent when the
service says so, and behaves exactly as before whenever the service cannot answer."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from backup_helpers import recording_agent, run_restore_command

from pgherd_backup.postgres import config
from pgherd_backup.postgres.control import read_system_id
from pgherd_backup.restore import agent_executable
from pgherd_backup.store import S3Settings, Store, StoreLocation
from pgherd_backup.walservice import WalService, socket_path_for

SEGMENT = "000000010000000000000042"


@dataclass
class Archived:
    pgdata: Path  # a real data directory (initdb), whose system id keys the archive
    segment: bytes  # what SEGMENT holds in the archive
    service: WalService  # serving the data directories beside pgdata


@pytest.fixture
def archived(tmp_path, pg_factory, s3_store, agent) -> Iterator[Archived]:
    member = pg_factory("member").initdb()
    wal = tmp_path / SEGMENT
    wal.write_bytes(os.urandom(1 << 16) * 16)
    assert agent("wal-push", "--system-id", read_system_id(member.pgdata), str(wal)).returncode == 0
    store = Store(StoreLocation.parse(s3_store.url, s3_store.cluster), S3Settings.from_env(s3_store.env()))
    service = WalService(store, socket_path_for(tmp_path), member.pgdata.parent).start()
    try:
        yield Archived(member.pgdata, wal.read_bytes(), service)
    finally:
        service.stop()


def test_the_service_answers_misses_and_restore_command_falls_back_without_it(tmp_path, archived):
    fake_agent, calls = recording_agent(tmp_path)
    command = config.restore_command(fake_agent, wal_service=str(archived.service.socket_path))
    # Not archived: answered by the service, the agent never starts.
    assert run_restore_command(command, "000000010000000000000043", archived.pgdata) == 1
    assert run_restore_command(command, "00000002.history", archived.pgdata) == 1
    assert not calls.exists()
    # Archived: the agent fetches it (download, checks, prefetch), as without the service.
    assert run_restore_command(command, SEGMENT, archived.pgdata) == 1  # the stand-in answers 1
    assert calls.read_text().splitlines() == [f"wal-fetch {SEGMENT} pg_wal/RECOVERYXLOG"]

    # A data directory the service was not started for gets no answer (400).
    outside = tmp_path.parent / "elsewhere"
    asked = subprocess.run(
        [
            "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
            "--unix-socket", str(archived.service.socket_path),
            f"http://pgherd/wal/{SEGMENT}?pgdata={outside}",
        ],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert asked.stdout == "400"

    # No service: every call goes to the agent again; nothing is answered wrongly.
    archived.service.stop()
    assert not archived.service.socket_path.exists()
    assert run_restore_command(command, "000000010000000000000043", archived.pgdata) == 1
    assert calls.read_text().splitlines()[-1] == "wal-fetch 000000010000000000000043 pg_wal/RECOVERYXLOG"


def test_a_real_restore_command_fetches_through_the_service(archived, s3_store):
    """With the real agent: an archived segment arrives intact, a missing one is a quiet miss."""
    command = config.restore_command(agent_executable(), wal_service=str(archived.service.socket_path))
    env = s3_store.env()
    assert run_restore_command(command, SEGMENT, archived.pgdata, env=env) == 0
    assert (archived.pgdata / "pg_wal" / "RECOVERYXLOG").read_bytes() == archived.segment
    assert run_restore_command(command, "000000010000000000000050", archived.pgdata, env=env) == 1


def test_a_miss_is_answered_again_for_a_moment_then_asked_anew(tmp_path, archived, s3_store, agent):
    """A standby asks for the same missing segment at every retry: the store is asked once per
    miss_ttl, and a file archived meanwhile is found once it has passed."""
    store = Store(StoreLocation.parse(s3_store.url, s3_store.cluster), S3Settings.from_env(s3_store.env()))
    service = WalService(store, tmp_path / "ttl.sock", archived.pgdata.parent, miss_ttl=1.0)
    service.start()
    try:
        name = "000000010000000000000044"
        command = config.restore_command(agent_executable(), wal_service=str(service.socket_path))

        def answer() -> str:
            asked = subprocess.run(
                [
                    "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--unix-socket", str(service.socket_path),
                    f"http://pgherd/wal/{name}?pgdata={archived.pgdata}",
                ],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            return asked.stdout

        # A data directory in archive recovery (a restore: its first miss ends it) is never answered
        # from a remembered miss; a standby's (which asks again) is.
        (archived.pgdata / "recovery.signal").touch()
        assert answer() == "404"
        wal = tmp_path / name
        wal.write_bytes(os.urandom(1 << 16) * 16)
        assert agent("wal-push", "--system-id", read_system_id(archived.pgdata), str(wal)).returncode == 0
        assert answer() == "200"
        (archived.pgdata / "recovery.signal").unlink()
        (archived.pgdata / "standby.signal").touch()
        name = "000000010000000000000045"
        assert answer() == "404"
        wal = tmp_path / name
        wal.write_bytes(os.urandom(1 << 16) * 16)
        assert agent("wal-push", "--system-id", read_system_id(archived.pgdata), str(wal)).returncode == 0
        assert answer() == "404"  # remembered: the store was not asked again
        time.sleep(1.1)
        assert answer() == "200"
        assert answer() == "200"  # a hit is never remembered as one
        assert run_restore_command(command, name, archived.pgdata, env=s3_store.env()) == 0

        # A history file's miss is never remembered: a promotion picks a timeline the archive lacks.
        name = "00000007.history"
        assert answer() == "404"
        history = tmp_path / name
        history.write_text("6\t0/3000000\tno recovery target specified\n")
        assert agent("wal-push", "--system-id", read_system_id(archived.pgdata), str(history)).returncode == 0
        assert answer() == "200"
    finally:
        service.stop()
