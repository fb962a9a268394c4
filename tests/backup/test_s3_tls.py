"""S3 over HTTPS with a private CA (spec.backup.store.s3.endpointCA; AWS_CA_BUNDLE in the data plane):
a real `rclone serve s3 --cert --key` whose certificate a CA made by the test signs.

Every S3 client of the data plane verifies the endpoint against that CA alone, through both backends
(the small client of the WAL hot path, and boto3): WAL archived and fetched, a snapshot taken and
restored by a PostgreSQL that archives through it. Without the CA, with another CA, or with a CA file
that is not there, every command fails at once with one line that names the endpoint and says what does
not verify it, never a traceback nor a retried "cannot reach".
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping

import pytest
from backup_helpers import TRACEBACK, fill, set_port

from pgherd.local.s3server import S3Tls
from pgherd_backup.restore import agent_executable

SEGMENT = "000000010000000000000042"
SYSTEM_ID = "7000000000000000001"
BACKENDS = {"lite": "1", "boto3": "0"}  # PGHERD_S3_LITE


@pytest.fixture
def run(tls_s3_store) -> Callable[..., subprocess.CompletedProcess[str]]:
    """pgherd-backup against this test's HTTPS store; `env` entries replace the store's (None removes)."""

    def call(*args: str, env: Mapping[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
        full = {**os.environ, **tls_s3_store.env(), "PGHERD_S3_RETRIES": "3"}
        for key, value in (env or {}).items():
            if value is None:
                full.pop(key, None)
            else:
                full[key] = value
        return subprocess.run(
            [agent_executable(), *args], capture_output=True, text=True, env=full, timeout=120
        )

    return call


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    assert TRACEBACK not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pgherd-backup: error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_wal_round_trip_over_https_verified_by_the_private_ca(tmp_path, run, tls_s3_store, backend):
    lite = {"PGHERD_S3_LITE": BACKENDS[backend]}
    wal = tmp_path / SEGMENT
    wal.write_bytes(os.urandom(1 << 20) + bytes(15 << 20))
    pushed = run("wal-push", "--system-id", SYSTEM_ID, str(wal), env=lite)
    assert pushed.returncode == 0, pushed.stderr
    fetched = tmp_path / "RECOVERYXLOG"
    result = run("wal-fetch", "--system-id", SYSTEM_ID, SEGMENT, str(fetched), env=lite)
    assert result.returncode == 0, result.stderr
    assert fetched.read_bytes() == wal.read_bytes()
    assert len(tls_s3_store.keys("/wal/")) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_system_cas_refuse_the_endpoint_with_a_clear_message(tmp_path, run, tls_s3_store, backend):
    """Without the CA (the system's CAs): refused at once, naming the endpoint and what to set."""
    wal = tmp_path / SEGMENT
    wal.write_bytes(bytes(16 << 20))
    refused = run(
        "wal-push",
        "--system-id",
        SYSTEM_ID,
        str(wal),
        env={"AWS_CA_BUNDLE": None, "PGHERD_S3_LITE": BACKENDS[backend]},
    )
    line = one_line_error(refused)
    assert tls_s3_store.endpoint.endpoint_url in line
    assert "certificate" in line and "the system's CA certificates do not verify" in line
    assert "endpointCA" in line and "AWS_CA_BUNDLE" in line
    assert "cannot reach" not in line
    assert tls_s3_store.keys("/wal/") == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_another_ca_refuses_the_endpoint_naming_its_file(tmp_path, run, tls_s3_store, backend):
    other = S3Tls.issue(tmp_path / "other-ca")
    listed = run("list", env={"AWS_CA_BUNDLE": str(other.ca), "PGHERD_S3_LITE": BACKENDS[backend]})
    line = one_line_error(listed)
    assert tls_s3_store.endpoint.endpoint_url in line
    assert f"the CA bundle {other.ca}" in line and "does not verify" in line


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_ca_file_missing_or_without_a_certificate_is_named(tmp_path, run, backend):
    missing = tmp_path / "mounted" / "ca.crt"  # an optional Secret volume whose Secret is missing
    line = one_line_error(
        run("list", env={"AWS_CA_BUNDLE": str(missing), "PGHERD_S3_LITE": BACKENDS[backend]})
    )
    assert f"the CA bundle {missing}" in line and "does not exist" in line and "endpointCA" in line

    empty = tmp_path / "empty.crt"
    empty.write_text("not a certificate\n")
    line = one_line_error(run("list", env={"AWS_CA_BUNDLE": str(empty), "PGHERD_S3_LITE": BACKENDS[backend]}))
    assert f"the CA bundle {empty}" in line and "no PEM certificate" in line


def test_snapshot_and_restore_through_an_archiving_postgres_over_https(pg_factory, tls_s3_store, run):
    """A primary archives through archive_command over HTTPS, a snapshot is streamed there and restored
    with WAL fetched back: every step trusts the private CA through AWS_CA_BUNDLE alone."""
    primary = pg_factory("primary", env=tls_s3_store.env()).initdb(archive=True).start()
    fill(primary, rows=3000)
    snap = run("snapshot", "--source", primary.dsn, "--verify")
    assert snap.returncode == 0, snap.stderr
    primary.sql("INSERT INTO events (note) VALUES ('after the snapshot')")
    primary.switch_and_wait_archived()
    after = primary.table_checksums()

    restored = pg_factory("restored", env=tls_s3_store.env())
    result = run("restore", "--pgdata", str(restored.pgdata))
    assert result.returncode == 0, result.stderr
    set_port(restored)
    restored.start()
    restored.wait_promoted()
    assert restored.table_checksums() == after
    assert restored.timeline() == 2


def test_the_ca_bundle_flag_takes_precedence_over_the_variable(tmp_path, run, tls_s3_store):
    other = S3Tls.issue(tmp_path / "other-ca")
    listed = run(
        "list", "--ca-bundle", str(tls_s3_store.endpoint.ca_bundle), env={"AWS_CA_BUNDLE": str(other.ca)}
    )
    assert listed.returncode == 0, listed.stderr
