"""The WAL service: restore_command answers "not archived" without starting the agent when the
service says so, and behaves exactly as before whenever the service cannot answer."""

from __future__ import annotations

import os
import subprocess

from backup_helpers import recording_agent, run_restore_command

from pgherd_backup.postgres import config
from pgherd_backup.postgres.control import read_system_id
from pgherd_backup.restore import agent_executable
from pgherd_backup.store import S3Settings, Store, StoreLocation
from pgherd_backup.walservice import WalService, socket_path_for

SEGMENT = "000000010000000000000042"


def test_the_service_answers_misses_and_restore_command_falls_back_without_it(
    tmp_path, pg_factory, s3_store, agent
):
    member = pg_factory("member").initdb()
    system_id = read_system_id(member.pgdata)
    wal = tmp_path / SEGMENT
    wal.write_bytes(os.urandom(1 << 16) * 16)
    assert agent("wal-push", "--system-id", system_id, str(wal)).returncode == 0

    store = Store(StoreLocation.parse(s3_store.url, s3_store.cluster), S3Settings.from_env(s3_store.env()))
    service = WalService(store, socket_path_for(tmp_path), member.pgdata.parent).start()
    fake_agent, calls = recording_agent(tmp_path)
    command = config.restore_command(fake_agent, wal_service=str(service.socket_path))
    try:
        # Not archived: answered by the service, the agent never starts.
        assert run_restore_command(command, "000000010000000000000043", member.pgdata) == 1
        assert run_restore_command(command, "00000002.history", member.pgdata) == 1
        assert not calls.exists()
        # Archived: the agent fetches it (download, checks, prefetch), as without the service.
        assert run_restore_command(command, SEGMENT, member.pgdata) == 1  # the stand-in answers 1
        assert calls.read_text().splitlines() == [f"wal-fetch {SEGMENT} pg_wal/RECOVERYXLOG"]

        # A data directory the service was not started for gets no answer (400).
        outside = tmp_path.parent / "elsewhere"
        asked = subprocess.run(
            [
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--unix-socket",
                str(service.socket_path),
                f"http://pgherd/wal/{SEGMENT}?pgdata={outside}",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        assert asked.stdout == "400"
    finally:
        service.stop()
    # No service: every call goes to the agent again; nothing is answered wrongly.
    assert run_restore_command(command, "000000010000000000000043", member.pgdata) == 1
    assert calls.read_text().splitlines()[-1] == "wal-fetch 000000010000000000000043 pg_wal/RECOVERYXLOG"
    assert not service.socket_path.exists()


def test_a_real_restore_command_fetches_through_the_service(tmp_path, pg_factory, s3_store, agent):
    """With the real agent: an archived segment arrives intact, a missing one is a quiet miss."""
    member = pg_factory("member").initdb()
    system_id = read_system_id(member.pgdata)
    wal = tmp_path / SEGMENT
    wal.write_bytes(os.urandom(1 << 16) * 16)
    assert agent("wal-push", "--system-id", system_id, str(wal)).returncode == 0
    store = Store(StoreLocation.parse(s3_store.url, s3_store.cluster), S3Settings.from_env(s3_store.env()))
    service = WalService(store, socket_path_for(tmp_path), member.pgdata.parent).start()
    command = config.restore_command(agent_executable(), wal_service=str(service.socket_path))
    try:
        assert run_restore_command(command, SEGMENT, member.pgdata, env=s3_store.env()) == 0
        assert (member.pgdata / "pg_wal" / "RECOVERYXLOG").read_bytes() == wal.read_bytes()
        assert (
            run_restore_command(command, "000000010000000000000050", member.pgdata, env=s3_store.env()) == 1
        )
    finally:
        service.stop()
