"""The agent's pure parts: wire documents, the token check, upstreams, parameters, certificates, state."""

from __future__ import annotations

import os
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest
from cryptography import x509

from pgherd_backup.agent.auth import Verdict, check_bearer, token_digest
from pgherd_backup.agent.credentials import Credentials, SecretFile, ensure_secret
from pgherd_backup.agent.instance import Refused, describe_upstream, upstream_params
from pgherd_backup.agent.options import read_parameters
from pgherd_backup.agent.state import AgentState
from pgherd_backup.agent.tls import client_context, issue, server_context
from pgherd_backup.agent.upstream import ProcessExit
from pgherd_backup.agent.wire import (
    ACTIONS,
    ActionOutcome,
    ActionProgress,
    ActionResult,
    RejoinRequest,
    Status,
    WalReceiver,
    WireError,
    lsn_value,
)
from pgherd_backup.errors import UsageError


def test_documents_round_trip_in_camel_case():
    status = Status(
        member="c-1",
        cluster="c",
        role="replica",
        received_lsn="0/3000060",
        wal_receiver=WalReceiver("streaming", "10.0.0.5:5432", 2),
        kept_aside=("/v/kept/a",),
        last_crash_at="2025-01-01T00:00:00Z",
    )
    raw = status.to_dict()
    assert raw["receivedLSN"] == "0/3000060" and raw["walReceiver"]["receivedTimeline"] == 2
    assert raw["keptAside"] == ["/v/kept/a"] and raw["lastCrashAt"].endswith("Z")
    assert Status.from_dict(raw) == status
    assert Status.from_dict({**raw, "somethingNew": 1}) == status  # a newer agent may say more
    assert lsn_value(status.received_lsn) == 0x3000060 and lsn_value(None) is None
    assert status.streaming and not status.running
    result = ActionResult("rejoin", method="reclone", kept_aside="/v/kept/b")
    assert ActionResult.from_dict(result.to_dict()) == result
    assert RejoinRequest.from_dict({"upstream": "h:5432"}) == RejoinRequest(upstream="h:5432")
    # a long action: its progress and its outcome, in /status
    restoring = Status(
        member="c-0",
        cluster="c",
        action="restore",
        action_progress=ActionProgress("restore", "restoring", "r1", "20250101T000000Z", None, 10, 99),
        last_action=ActionOutcome("restore", False, "r0", error="no snapshot 'x'"),
    )
    raw = restoring.to_dict()
    assert raw["actionProgress"]["requestId"] == "r1" and raw["actionProgress"]["bytesTotal"] == 99
    assert raw["lastAction"] == {
        **raw["lastAction"],
        "ok": False,
        "requestId": "r0",
        "error": "no snapshot 'x'",
    }
    assert Status.from_dict(raw) == restoring
    restore = ACTIONS["restore"].from_dict({"snapshot": "latest", "target": "immediate", "requestId": "r1"})
    assert restore.to_dict() == {
        "reason": "",
        "snapshot": "latest",
        "target": "immediate",
        "requestId": "r1",
    }
    assert ActionResult.from_dict({"action": "restore", "inProgress": True}).in_progress


def test_documents_of_the_wrong_shape_are_refused_with_the_key_named():
    with pytest.raises(WireError, match="member"):
        Status.from_dict({"cluster": "c"})
    with pytest.raises(WireError, match="fenced"):
        Status.from_dict({"member": "m", "cluster": "c", "fenced": "yes"})
    with pytest.raises(WireError, match="crashes"):
        Status.from_dict({"member": "m", "cluster": "c", "crashes": True})
    with pytest.raises(WireError, match="reclone"):
        ACTIONS["rejoin"].from_dict({"upstream": "h", "reclone": 1})
    with pytest.raises(WireError):
        ACTIONS["promote"].from_dict([])  # type: ignore[arg-type]


def test_the_bearer_token_check():
    assert check_bearer(None, "t0ken") is Verdict.MISSING
    assert check_bearer("", "t0ken") is Verdict.MISSING
    assert check_bearer("Basic dXNlcg==", "t0ken") is Verdict.MISSING
    assert check_bearer("Bearer ", "t0ken") is Verdict.MISSING
    assert check_bearer("Bearer t0ken", "t0ken") is Verdict.ALLOWED
    assert check_bearer("bearer t0ken", "t0ken") is Verdict.ALLOWED
    assert check_bearer("Bearer t0ke", "t0ken") is Verdict.WRONG
    assert check_bearer("Bearer anything", "") is Verdict.WRONG
    digest = token_digest("t0ken")
    assert digest.startswith("sha256:")
    assert check_bearer("Bearer t0ken", digest) is Verdict.ALLOWED
    assert check_bearer("Bearer " + digest, digest) is Verdict.WRONG  # the digest is not the credential


def test_secrets_are_read_from_files_and_redacted(tmp_path):
    token = tmp_path / "token"
    assert ensure_secret(token) and not ensure_secret(token)
    assert token.stat().st_mode & 0o777 == 0o600
    password = tmp_path / "pw"
    password.write_text("s3cr3t-pw\n")
    credentials = Credentials(SecretFile(token, "token"), superuser_password=SecretFile(password, "pw"))
    text = f"conninfo password=s3cr3t-pw token {token.read_text().strip()}"
    assert credentials.redact(text) == "conninfo password=*** token ***"
    password.write_text("rotated\n")  # a rotated Secret is read again
    assert credentials.superuser_password is not None
    assert credentials.superuser_password.value() == "rotated"
    with pytest.raises(UsageError, match="pgherd instance certs"):
        SecretFile(tmp_path / "missing", "operator token")


def test_upstreams_as_address_or_conninfo():
    assert upstream_params("10.0.0.5:5433") == ({"host": "10.0.0.5", "port": "5433"}, False)
    assert upstream_params("c-0.c-headless") == ({"host": "c-0.c-headless", "port": "5432"}, False)
    params, explicit = upstream_params("host=a port=6 user=r password=pw")
    assert explicit and params["password"] == "pw"
    assert sorted(describe_upstream("host=a port=6 user=r password=pw").split()) == [
        "host=a",
        "port=6",
        "user=r",
    ]
    assert describe_upstream("c-0.c-headless:5432") == "c-0.c-headless:5432"
    with pytest.raises(Refused):
        upstream_params("host:notaport")


def test_parameters_files(tmp_path):
    path = tmp_path / "params"
    path.write_text(
        "# comment\nwork_mem = 4MB  # inline\nlog_line_prefix = '%m # [%p] it''s'\n\nmax_connections=50\n"
    )
    assert read_parameters(path) == {
        "work_mem": "4MB",
        "log_line_prefix": "%m # [%p] it's",
        "max_connections": "50",
    }
    path.write_text("port = 5433\n")
    with pytest.raises(UsageError, match="owned by the operator"):
        read_parameters(path)
    path.write_text("= nothing\n")
    with pytest.raises(UsageError, match="name = value"):
        read_parameters(path)


def test_certificates_name_the_member_and_chain_to_the_cluster_ca(tmp_path):
    files = issue(tmp_path / "tls", "c", ["c-0"], ips=["10.1.2.3"], headless_service="c-hl.ns")
    ca_before = files.ca_cert.read_bytes()
    cert = x509.load_pem_x509_certificate(files.members["c-0"][0].read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"c-0", "localhost", "c-0.c-hl.ns", "c-0.c-hl.ns.svc"} <= set(
        names.get_values_for_type(x509.DNSName)
    )
    assert {"127.0.0.1", "10.1.2.3"} <= {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in (tmp_path / "tls").iterdir())
    again = issue(tmp_path / "tls", "c", ["c-1"])  # a member added later: same CA
    assert again.ca_cert.read_bytes() == ca_before
    # a TLS handshake over a socket pair: verified with the CA, by the member's name
    server = server_context(*files.members["c-0"])
    client = client_context(files.ca_cert)
    import socket

    left, right = socket.socketpair()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            with server.wrap_socket(left, server_side=True):
                pass
        except (ssl.SSLError, OSError) as exc:
            errors.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    with client.wrap_socket(right, server_hostname="c-0") as tls:
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
    thread.join()


def test_an_unreadable_state_file_keeps_the_member_fenced(tmp_path: Path):
    path = tmp_path / "state.json"
    assert AgentState.load(path) == AgentState()
    state = AgentState(fenced=True, role_at_fence="primary", upstream="h:1", kept_aside=["/k"])
    state.save(path)
    assert AgentState.load(path) == state
    path.write_text("{not json")
    assert AgentState.load(path).fenced


def test_a_stale_postmaster_pid_naming_a_thread_is_removed(tmp_path: Path) -> None:
    """A container made again: the old postmaster's pid is now a thread of the new agent. PostgreSQL
    only asks whether the pid exists, and refused to start at every restart ("lock file postmaster.pid
    already exists", seen on a real kubelet); the agent removes a lock no postgres process holds."""
    from pgherd_backup.postgres import postmaster

    started = threading.Event()
    done = threading.Event()
    tids: list[int] = []

    def thread() -> None:
        tids.append(threading.get_native_id())
        started.set()
        done.wait(10)

    worker = threading.Thread(target=thread)
    worker.start()
    try:
        started.wait(10)
        (tmp_path / "postmaster.pid").write_text(f"{tids[0]}\n{tmp_path}\n1700000000\n5432\n")
        assert postmaster.postmaster_pid(tmp_path) is None  # a thread of this process, not a postmaster
        assert postmaster.remove_stale_lock(tmp_path) == tids[0]
        assert not (tmp_path / "postmaster.pid").exists()
        assert postmaster.remove_stale_lock(tmp_path) is None  # nothing to remove
    finally:
        done.set()
        worker.join()


def test_only_a_stale_socket_lock_of_this_data_directory_is_removed(tmp_path: Path) -> None:
    from pgherd_backup.postgres import postmaster

    pgdata, sockets = tmp_path / "data", tmp_path / "run"
    pgdata.mkdir()
    sockets.mkdir()
    ours = sockets / ".s.PGSQL.5432.lock"
    ours.write_text(f"{os.getpid()}\n{pgdata}\n1700000000\n5432\n{sockets}\n")  # a pid, not a postgres
    other = sockets / ".s.PGSQL.5433.lock"
    other.write_text(f"{os.getpid()}\n{tmp_path / 'elsewhere'}\n1700000000\n5433\n{sockets}\n")
    assert postmaster.remove_stale_socket_locks(pgdata, [sockets]) == [ours]
    assert not ours.exists() and other.exists()
    assert postmaster.remove_stale_socket_locks(pgdata, [sockets]) == []


def test_the_upstream_is_heard_from_its_receiver_and_its_loss_dated_at_the_first_sample_without_it():
    from pgherd_backup.agent.upstream import Heard, next_heard, silence_now

    up = "127.0.0.1:5432"
    streaming = next_heard(None, up, 1.5, at=100.0)  # the receiver's own silence
    assert streaming == Heard(up, 98.5, receiving=True)
    assert silence_now(streaming, up, now=100.3) == 0.0  # gone since the last sample: dated now at most
    lost = next_heard(streaming, up, None, at=100.2)  # the first sample without the row dates the loss
    assert lost == Heard(up, 100.2, receiving=False)
    assert next_heard(lost, up, None, at=100.4) == lost  # and it ages
    assert silence_now(lost, up, now=103.2) == 3.0
    # Never earlier than a date already given, whatever the last row said.
    assert next_heard(Heard(up, 100.5, receiving=True), up, None, at=100.4) == Heard(up, 100.5, False)
    # Another upstream configured: nothing heard from it; none configured: nothing at all.
    assert next_heard(lost, "10.0.0.9:5432", None, at=101.0) is None
    assert silence_now(lost, "10.0.0.9:5432", now=101.0) is None
    assert next_heard(streaming, None, 0.5, at=101.0) is None
    assert next_heard(None, up, None, at=101.0) is None


def test_a_process_exit_wakes_its_watcher_at_once() -> None:
    """The WAL receiver watch's wake (agent/upstream.py): a process's end ends the wait well before its
    timeout; a live one's wait lasts the timeout, as does one that cannot be watched."""
    child = subprocess.Popen(["sleep", "0.3"])
    watched = ProcessExit(child.pid)
    try:
        assert not watched.wait(0.05)  # still running
        started = time.monotonic()
        assert watched.wait(10)
        assert time.monotonic() - started < 5
        child.wait()
        assert watched.wait(10)  # stays readable: the watch forgets it after one wake
    finally:
        watched.close()
        child.kill()
        child.wait()
    gone = ProcessExit(child.pid)  # reaped: no such process, left to the next sample
    assert not gone.wait(0.05)
    gone.close()
