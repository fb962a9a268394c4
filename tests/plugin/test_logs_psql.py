"""What `logs` and `psql` do without a pod: log lines parsed, made readable and interleaved by time;
psql's member, argv and exit status. (With pods: e2e/test_plugin.py, on localkube.)"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from pgherd.plugin import certificates, logs, psql
from pgherd.plugin.errors import PluginError

from . import phases


def test_plain_and_json_lines_interleave_by_the_api_servers_time() -> None:
    pg0 = [
        "2026-01-01T12:00:00.000000001Z starting",
        '2026-01-01T12:00:02.5Z {"time": "x", "level": "info", "logger": "pgherd.agent", "msg": "promoted", "timeline": 2}',
    ]
    pg1 = [
        "2026-01-01T12:00:01.999999999Z LOG:  redo starts at 0/3000028",
        "2026-01-01T12:00:02.25Z plain again",
    ]
    merged = list(
        logs.interleave([[logs.parse("pg-0", r) for r in pg0], [logs.parse("pg-1", r) for r in pg1]])
    )
    assert [(line.member, logs.readable(line.text)) for line in merged] == [
        ("pg-0", "starting"),
        ("pg-1", "LOG:  redo starts at 0/3000028"),
        ("pg-1", "plain again"),
        ("pg-0", "INFO pgherd.agent: promoted timeline=2"),
    ]
    shown = logs.format_line(merged[1], 4)
    assert shown.startswith("pg-1 2026-01-01T12:00:01.999999Z") and shown.endswith("redo starts at 0/3000028")


def test_postgresql_jsonlog_and_odd_lines_stay_readable() -> None:
    jsonlog = json.dumps(
        {"timestamp": "t", "error_severity": "WARNING", "message": "checkpoints are too frequent", "pid": 7}
    )
    assert logs.readable(jsonlog) == "WARNING: checkpoints are too frequent pid=7"
    assert logs.readable("{not json}") == "{not json}"
    assert logs.readable('["a list"]') == '["a list"]'
    no_stamp = logs.parse("pg-0", "a continuation line")
    assert no_stamp.text == "a continuation line" and no_stamp.key == ""


def test_pgherd_json_lines_read_as_level_logger_and_message() -> None:
    """`--log-format json` (pgherd_backup.logformat): the namespace, cluster and member are the line's
    prefix already; a traceback follows the message on lines of its own."""
    import io
    import logging

    from pgherd_backup.logformat import JsonFormatter, LogContext

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(LogContext("shop", "pg", "pg-0")))
    logger = logging.getLogger("pgherd.agent.test-plugin")
    logger.handlers[:], logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    logger.info("PostgreSQL runs as primary")
    try:
        raise OSError("disk full")
    except OSError:
        logger.exception("checkpoint failed")
    plain, failed = stream.getvalue().splitlines()
    assert logs.readable(plain) == "INFO pgherd.agent.test-plugin: PostgreSQL runs as primary"
    head, *trace = logs.readable(failed).splitlines()
    assert head == "ERROR pgherd.agent.test-plugin: checkpoint failed"
    assert trace[0] == "Traceback (most recent call last):" and trace[-1] == "OSError: disk full"
    # Other keys are kept, but not those that are null.
    line = json.dumps({"level": "info", "message": "m", "member": None, "lsn": "0/3", "x": None})
    assert logs.readable(line) == "INFO: m lsn=0/3"


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("10m", 600), ("1h30m", 5400), ("2d", 172800)])
def test_since(text: str, seconds: int) -> None:
    assert logs.since_seconds(text) == seconds


def test_since_refuses_what_it_cannot_read() -> None:
    with pytest.raises(PluginError, match="--since '10 minutes'"):
        logs.since_seconds("10 minutes")


def test_psql_connects_to_the_primary_on_the_local_socket_as_the_superuser() -> None:
    cluster = phases.running()["cluster"]
    member = psql.choose_member(cluster)
    assert member["name"] == "pg-0"
    argv = psql.command(member, ["-Atc", "select 1"])
    assert argv == [
        "/usr/lib/postgresql/16/bin/psql",
        "-h",
        "/var/lib/pgherd/agent/run",
        "-p",
        "5432",
        "-U",
        "postgres",
        "-Atc",
        "select 1",
    ]
    assert psql.command({"name": "pg-1"}, [])[0] == "psql"  # version unknown: the image's PATH


def test_psql_member_choice() -> None:
    cluster = phases.upgrading()["cluster"]  # pg-1 10 bytes behind, pg-2 100
    assert psql.choose_member(cluster, replica=True)["name"] == "pg-1"
    assert psql.choose_member(cluster, member="pg-2")["name"] == "pg-2"
    with pytest.raises(PluginError, match="has no member pg-5"):
        psql.choose_member(cluster, member="pg-5")
    with pytest.raises(PluginError, match="no primary now"):
        psql.choose_member(phases.creating()["cluster"])


def test_psql_exit_status_from_the_exec_error_channel() -> None:
    assert psql.exit_code("") == 0
    assert psql.exit_code(json.dumps({"status": "Success"})) == 0
    failure = {"status": "Failure", "details": {"causes": [{"reason": "ExitCode", "message": "3"}]}}
    assert psql.exit_code(json.dumps(failure)) == 3
    assert psql.exit_code("garbage") == 1


def test_certificates_expiry_from_pem_alone() -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pg-headless.apps.svc")])
    start = datetime(2026, 1, 1, tzinfo=UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(start)
        .not_valid_after(start + timedelta(days=825))
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(Encoding.PEM).decode()
    (record,) = certificates.records(pem, "pg-agent tls.crt", "Secret pg-agent")
    assert record["not_after"] == "2028-04-05T00:00:00Z" and record["subject"] == "CN=pg-headless.apps.svc"
    assert len(certificates.records(pem + pem, "chain", "x")) == 2
    reported = certificates.from_status([{"name": "server", "notAfter": "2027-01-01T00:00:00Z"}])
    assert reported == [
        {"name": "server", "subject": "", "not_after": "2027-01-01T00:00:00Z", "source": "status"}
    ]
