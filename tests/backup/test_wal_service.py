"""The WAL service: restore_command answers "not archived" without starting the agent when the
service says so, and behaves exactly as before whenever the service cannot answer."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from backup_helpers import recording_agent, run_restore_command

from pgherd_backup.layout import Layout
from pgherd_backup.postgres import config
from pgherd_backup.postgres.control import read_system_id
from pgherd_backup.restore import agent_executable
from pgherd_backup.store import S3Settings, Store, StoreLocation
from pgherd_backup.walservice import MISS_TTL, WalService, socket_path_for

SEGMENT = "000000010000000000000042"


def ask(socket_path: Path, name: str, pgdata: Path) -> str:
    """The service's answer (its HTTP status) to `GET /wal/<name>?pgdata=<pgdata>`, as restore_command asks."""
    asked = subprocess.run(
        [
            "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--unix-socket", str(socket_path),
            f"http://pgherd/wal/{name}?pgdata={pgdata}",
        ],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return asked.stdout


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
    assert ask(archived.service.socket_path, SEGMENT, outside) == "400"

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
            return ask(service.socket_path, name, archived.pgdata)

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


def test_the_service_asks_the_store_over_one_kept_connection(archived):
    """Each request is answered in a thread of its own: the store's connection is kept between them
    (not a TCP and TLS handshake per restore_command), and one the server closed meanwhile is replaced."""

    def answer(name: str) -> str:
        return ask(archived.service.socket_path, name, archived.pgdata)

    backend = archived.service.store.backend
    made = backend.connections_made
    for i in range(5):
        assert answer(f"0000000100000000000000{0x50 + i:02X}") == "404"
    assert answer(SEGMENT) == "200"
    assert backend.connections_made - made <= 1
    # The kept connection broken (as when the server closes it): the next request is answered all the
    # same, on a new one.
    for idle in backend._idle.values():
        for conn in idle:
            conn.sock.shutdown(socket.SHUT_RDWR)
    assert answer("000000010000000000000060") == "404"
    assert answer(SEGMENT) == "200"


def test_archive_command_pushes_through_the_service_and_falls_back_without_it(tmp_path, archived, s3_store):
    """archive_command asks the service to push (no process started); a refusal, a file PostgreSQL has
    not handed over (no .ready mark) and a stopped service each leave it to wal-push."""
    store = Store(StoreLocation.parse(s3_store.url, s3_store.cluster), S3Settings.from_env(s3_store.env()))
    failure = tmp_path / "archive-failure"
    failure.write_text("the last push failed")
    service = WalService(store, tmp_path / "push.sock", archived.pgdata.parent, failure_file=failure).start()
    fake_agent, calls = recording_agent(tmp_path)
    command = config.archive_command(fake_agent, wal_service=str(service.socket_path))
    wal = archived.pgdata / "pg_wal"

    def archive(name: str, content: bytes, ready: bool = True) -> int:
        (wal / name).write_bytes(content)
        mark = wal / "archive_status" / f"{name}.ready"
        if ready:
            mark.touch()
        try:
            return run_restore_command(command, name, archived.pgdata, dest=f"pg_wal/{name}")
        finally:
            mark.unlink(missing_ok=True)

    try:
        name = "000000010000000000000070"
        content = os.urandom(1 << 16) * 8
        assert archive(name, content) == 0
        assert not calls.exists()
        assert not failure.exists()  # the note of the last failure goes with a success
        # In the archive as wal-push stores it: the real restore_command gets the same bytes back.
        restore = config.restore_command(agent_executable(), wal_service=str(archived.service.socket_path))
        assert run_restore_command(restore, name, archived.pgdata, env=s3_store.env()) == 0
        assert (wal / "RECOVERYXLOG").read_bytes() == content
        assert archive(name, content) == 0  # again: already archived, the same content

        # Different content under an archived name: refused, and wal-push says why.
        assert archive(name, os.urandom(1 << 16)) == 1
        assert calls.read_text().splitlines() == [f"wal-push pg_wal/{name}"]
        # Not handed over by PostgreSQL (a segment still being written): never pushed by the service.
        assert archive("000000010000000000000071", content, ready=False) == 1
        assert calls.read_text().splitlines()[-1] == "wal-push pg_wal/000000010000000000000071"
        assert not store.exists(
            Layout(store.location, read_system_id(archived.pgdata)).wal_key("000000010000000000000071")
        )
        service.stop()
        assert archive("000000010000000000000072", content) == 1
        assert calls.read_text().splitlines()[-1] == "wal-push pg_wal/000000010000000000000072"
    finally:
        service.stop()


def test_a_standby_switching_timeline_is_told_segments_are_not_archived_for_a_moment(archived):
    """Right after a standby's WAL receiver stored a new timeline's history (its upstream promoted), the
    standby asks the archive for the segment it reads on the new timeline and on the old one before it
    streams again; its upstream has both. For miss_ttl after that history file landed, a segment is
    answered "not archived" without asking the store (an S3 HEAD each, slowed by the new primary's own
    uploads of that moment); a history file is always asked, and a restore (no standby.signal) too."""
    service = WalService(
        archived.service.store, archived.pgdata.parent / "switch.sock", archived.pgdata.parent
    )
    service.start()

    def answer() -> str:
        return ask(service.socket_path, SEGMENT, archived.pgdata)

    try:
        history = archived.pgdata / "pg_wal" / "00000002.history"
        history.write_text("1\t0/42000000\tno recovery target specified\n")
        assert answer() == "200"  # not a standby: a restore is always told the truth
        (archived.pgdata / "standby.signal").touch()
        assert answer() == "404"
        backend = archived.service.store.backend
        asked = backend.requests_made
        assert answer() == "404"
        assert backend.requests_made == asked  # the store was not asked
        past = time.time() - 2 * MISS_TTL
        os.utime(history, (past, past))
        assert answer() == "200"
    finally:
        service.stop()


def test_a_standby_being_promoted_is_told_what_the_archive_holds(archived):
    """While the agent promotes its PostgreSQL, neither a remembered miss nor a timeline switch's answers
    a request: the end of recovery reads what the archive holds."""
    promoting = [False]
    service = WalService(
        archived.service.store,
        archived.pgdata.parent / "promote.sock",
        archived.pgdata.parent,
        promoting=lambda: promoting[0],
    ).start()

    def answer() -> str:
        return ask(service.socket_path, SEGMENT, archived.pgdata)

    try:
        (archived.pgdata / "standby.signal").touch()
        (archived.pgdata / "pg_wal" / "00000002.history").write_text("1\t0/42000000\tno recovery target\n")
        assert answer() == "404"  # a timeline switch's answer
        promoting[0] = True
        assert answer() == "200"
    finally:
        service.stop()


def test_while_its_skip_file_exists_a_standby_asks_the_archive_nothing_but_its_local_history(
    tmp_path, archived
):
    """Instance.skip_archive's file (a replica following a member's promotion, for a moment): every
    question is "not archived" at once, the service and the agent unasked, except a history file its
    WAL receiver already brought; gone, the command asks as before."""
    fake_agent, calls = recording_agent(tmp_path)
    skip = tmp_path / "run dir" / "skip-archive%"  # quoted and %-escaped like any path in the command
    skip.parent.mkdir()
    command = config.restore_command(
        fake_agent, wal_service=str(archived.service.socket_path), skip_archive=str(skip)
    )
    history = archived.pgdata / "pg_wal" / "00000002.history"
    history.write_text("1\t0/3000000\tno recovery target specified\n")
    skip.touch()
    archived.service.stop()  # a question to it would fall back to the agent, which records it
    assert run_restore_command(command, SEGMENT, archived.pgdata) == 1
    assert run_restore_command(command, "00000003.history", archived.pgdata) == 1
    assert (
        run_restore_command(command, "00000002.history", archived.pgdata, dest="pg_wal/RECOVERYHISTORY") == 0
    )
    assert (archived.pgdata / "pg_wal" / "RECOVERYHISTORY").read_text() == history.read_text()
    assert not calls.exists()
    skip.unlink()
    assert run_restore_command(command, SEGMENT, archived.pgdata) == 1
    assert calls.read_text().splitlines() == [f"wal-fetch {SEGMENT} pg_wal/RECOVERYXLOG"]
