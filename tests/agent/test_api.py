"""The agent's API on one pair of members (initdb primary, basebackup replica), shared by the module:
every endpoint, refusals, idempotency, TLS, and no credential in anything that leaves the agent."""

from __future__ import annotations

import json
import ssl
import subprocess

import pytest
from agent_helpers import MEMBERS, Agent, http_raw

from pgherd_backup.agent.client import AgentActionError, AgentAuthError, AgentClient, AgentUnreachable
from pgherd_backup.agent.wire import ACTIONS, Status, camel, lsn_value

STATUS_KEYS = {
    "member",
    "cluster",
    "role",
    "postmaster",
    "postmasterSince",
    "timeline",
    "receivedLSN",
    "replayedLSN",
    "flushedLSN",
    "heldLSN",
    "walReceiver",
    "upstream",
    "fenced",
    "dataPresent",
    "keptAside",
    "revision",
    "pendingRestart",
    "synchronousStandbyNames",
    "finalLSN",
    "shutdownClean",
    "terminating",
    "crashes",
    "lastCrashAt",
    "lastError",
    "action",
    "actionProgress",
    "lastAction",
    "startError",
    "serverVersion",
}

# Every answer the tests received, checked for credentials at the end of the module.
ANSWERS: list[str] = []


@pytest.fixture(scope="module")
def pair(module_agents) -> tuple[Agent, Agent]:
    primary = module_agents(MEMBERS[0], "--seed", "initdb", "--revision", "r1")
    # the replica holds only the token's digest: the same token opens it
    digest = str(primary.certs.folder / "token.sha256")
    replica = module_agents(
        MEMBERS[1],
        "--seed",
        "basebackup",
        "--upstream",
        primary.address,
        "--revision",
        "r1",
        "--token-file",
        digest,
    )
    replica.wait_streaming()
    return primary, replica


def _status(agent: Agent) -> Status:
    status = agent.status()
    ANSWERS.append(json.dumps(status.to_dict()))
    return status


def test_initdb_makes_a_primary_and_basebackup_a_streaming_replica(pair):
    primary, replica = pair
    first, second = _status(primary), _status(replica)
    assert (first.role, first.postmaster, first.ready, first.fenced) == ("primary", "running", True, False)
    assert first.data_present and first.timeline == 1 and first.revision == "r1"
    assert not primary.value("SELECT pg_is_in_recovery()")
    assert (second.role, second.postmaster, second.ready) == ("replica", "running", True)
    assert second.wal_receiver is not None
    assert second.wal_receiver.status == "streaming"
    assert second.wal_receiver.upstream == primary.address
    assert second.upstream == primary.address
    assert replica.value("SELECT pg_is_in_recovery()")
    primary.sql("CREATE TABLE IF NOT EXISTS seen (x int)")
    primary.sql("INSERT INTO seen VALUES (1)")
    replica.wait_until(
        lambda: replica.value("SELECT count(*) FROM pg_class WHERE relname = 'seen'") == 1, "replay"
    )


def test_the_status_document_has_every_key_in_camel_case(pair):
    primary, replica = pair
    raw = primary.client._call("GET", "/status", timeout=5)
    ANSWERS.append(json.dumps(raw))
    assert set(raw) >= STATUS_KEYS
    assert all("_" not in key for key in raw)
    assert raw["walReceiver"] is None and raw["keptAside"] == []
    status = _status(replica)
    assert Status.from_dict(status.to_dict()) == status
    # LSNs are PostgreSQL's text; held >= replayed; a running member has no final LSN
    assert lsn_value(status.held_lsn) >= lsn_value(status.replayed_lsn)
    assert status.final_lsn is None and status.shutdown_clean is None
    assert status.synchronous_standby_names == "" and status.pending_restart is False
    assert camel("received_lsn") == "receivedLSN" and camel("last_crash_at") == "lastCrashAt"
    # the running server's MAJOR.MINOR, from server_version_num: what status.members[].version shows
    number = int(primary.value("SHOW server_version_num"))
    assert raw["serverVersion"] == status.server_version == f"{number // 10000}.{number % 10000}"


def test_probes_answer_without_credentials(pair):
    primary, replica = pair
    anonymous = AgentClient(f"https://127.0.0.1:{primary.port}", ca_file=primary.certs.ca)
    for agent in pair:
        client = AgentClient(f"https://127.0.0.1:{agent.port}", ca_file=agent.certs.ca)
        assert [client.probe(p) for p in ("healthz", "readyz", "startupz")] == [200, 200, 200]
    code, body = http_raw(primary.port, "GET", "/readyz", ca=primary.certs.ca)
    assert (code, body["detail"]) == (200, "primary")
    code, body = http_raw(replica.port, "GET", "/readyz", ca=replica.certs.ca)
    assert (code, body["detail"]) == (200, "replica streaming")
    with pytest.raises(AgentAuthError):
        anonymous.status()


def test_a_caller_without_or_with_a_wrong_token_is_refused_and_changes_nothing(pair):
    _, replica = pair
    for headers, expected in (
        ({}, 401),
        ({"Authorization": "Bearer not-the-token"}, 403),
        ({"Authorization": "Basic x"}, 401),
    ):
        for method, path in (("GET", "/status"), ("POST", "/actions/promote"), ("POST", "/actions/fence")):
            code, body = http_raw(replica.port, method, path, headers, ca=replica.certs.ca)
            ANSWERS.append(json.dumps(body))
            assert code == expected, (method, path, body)
            assert body["reason"] in ("unauthorized", "forbidden")
    wrong = AgentClient(f"https://127.0.0.1:{replica.port}", ca_file=replica.certs.ca, token="wrong")
    with pytest.raises(AgentAuthError) as refused:
        wrong.promote()
    assert refused.value.status == 403
    # the refused promote and fence changed nothing
    status = _status(replica)
    assert (status.role, status.postmaster, status.fenced) == ("replica", "running", False)
    assert replica.value("SELECT pg_is_in_recovery()")


def test_unknown_actions_and_bad_requests_get_errors_a_person_can_act_on(pair):
    primary, _ = pair
    client = primary.client
    with pytest.raises(AgentActionError) as unknown:
        client._call("POST", "/actions/explode", {}, timeout=5)
    assert unknown.value.status == 404 and "promote" in unknown.value.message
    with pytest.raises(AgentActionError) as bad:
        client._call("POST", "/actions/unfence", {"primary": "yes"}, timeout=5)
    assert bad.value.status == 400 and "primary" in bad.value.message
    with pytest.raises(AgentActionError) as missing:
        client.rejoin("")
    assert missing.value.status == 409 and "upstream" in missing.value.message
    with pytest.raises(AgentActionError) as slot:
        client.drop_slot("")
    assert slot.value.status == 409
    ANSWERS.extend(str(e.value) for e in (unknown, bad, missing, slot))
    assert set(ACTIONS) == {
        "promote",
        "fence",
        "demote",
        "unfence",
        "rejoin",
        "restart",
        "set-sync",
        "checkpoint",
        "drop-slot",
        "seed",
        "restore",
        "upgrade",
    }


def test_tls_needs_the_cluster_ca_and_the_right_name(pair, tmp_path):
    primary, _ = pair
    no_ca = AgentClient(f"https://127.0.0.1:{primary.port}", token=primary.certs.token)
    with pytest.raises(AgentUnreachable) as untrusted:
        no_ca.status()
    assert "not trusted" in untrusted.value.message
    with pytest.raises(ssl.SSLCertVerificationError):
        http_raw(primary.port, "GET", "/healthz")
    # The certificate names the member: verified by name when connecting by address.
    named = AgentClient(
        f"https://127.0.0.1:{primary.port}",
        ca_file=primary.certs.ca,
        token=primary.certs.token,
        server_hostname=MEMBERS[0],
    )
    assert named.status().member == MEMBERS[0]
    other = AgentClient(
        f"https://127.0.0.1:{primary.port}",
        ca_file=primary.certs.ca,
        token=primary.certs.token,
        server_hostname=MEMBERS[1],
    )
    with pytest.raises(AgentUnreachable):
        other.status()
    # Plain HTTP to the TLS port gets nowhere.
    plain = AgentClient(f"http://127.0.0.1:{primary.port}", token=primary.certs.token)
    with pytest.raises((AgentUnreachable, AgentActionError)):
        plain.status()


def test_sql_actions_are_idempotent(pair):
    primary, replica = pair
    client = primary.client
    first = client.set_sync(f'ANY 1 ("{MEMBERS[1]}")')
    again = client.set_sync(f'ANY 1 ("{MEMBERS[1]}")')
    assert (first.changed, again.changed) == (True, False)
    assert _status(primary).synchronous_standby_names == f'ANY 1 ("{MEMBERS[1]}")'
    primary.sql("INSERT INTO seen VALUES (2)")  # a commit waits for the replica: it is streaming
    assert client.set_sync("").changed and not client.set_sync("").changed
    assert client.checkpoint().ok and replica.client.checkpoint().ok
    primary.sql("SELECT pg_create_physical_replication_slot('gone_member')")
    assert client.drop_slot("gone_member").changed
    assert not client.drop_slot("gone_member").changed
    # promote of the primary is a no-op; its fence flag stays clear
    promoted = client.promote()
    assert not promoted.changed and promoted.timeline == 1
    assert _status(primary).role == "primary"


def test_restart_at_a_revision_is_idempotent_and_keeps_the_role(pair):
    primary, replica = pair
    first = replica.client.restart(revision="r2")
    assert first.changed
    status = _status(replica)
    assert (status.revision, status.role) == ("r2", "replica")
    assert not replica.client.restart(revision="r2").changed
    replica.wait_streaming()
    # a replica is never restarted read-write: that is a promotion
    with pytest.raises(AgentActionError) as refused:
        replica.client.restart(revision="r3", primary=True)
    assert refused.value.status == 409 and "promote" in refused.value.message
    assert _status(replica).revision == "r2"
    # the primary, restarted with primary=True, comes back read-write at the new revision
    assert primary.client.restart(revision="r2", primary=True).changed
    status = _status(primary)
    assert (status.role, status.revision, status.timeline) == ("primary", "r2", 1)
    replica.wait_streaming()


def test_the_cli_refuses_to_start_without_tls_material(tmp_path):
    result = subprocess.run(
        [
            "pgherd",
            "instance",
            "run",
            "--cluster",
            "c",
            "--member",
            "c-0",
            "--pgdata",
            str(tmp_path / "data"),
            "--token-file",
            str(tmp_path / "token"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--tls-cert" in result.stderr and "pgherd instance certs" in result.stderr


def test_no_credential_in_logs_status_or_errors(pair):
    primary, replica = pair
    ANSWERS.append(json.dumps(primary.client._call("GET", "/status", timeout=5)))
    texts = [primary.log, replica.log, *ANSWERS]
    for path in (primary.pgdata / "postgresql.pgherd.conf", replica.pgdata / "postgresql.pgherd.conf"):
        texts.append(path.read_text())
    for secret in primary.certs.secrets:
        for text in texts:
            assert secret not in text
    assert "refused" in primary.log or "refused" in replica.log  # the refusals were logged, without the token


def test_no_tls_is_plain_http_with_a_loud_warning(module_agents):
    plain = module_agents(MEMBERS[5], "--no-tls")  # --seed none: waits for an order, no PostgreSQL
    client = AgentClient(f"http://127.0.0.1:{plain.port}", token=plain.certs.token)
    status = client.status()
    assert (status.data_present, status.postmaster) == (False, "stopped")
    assert client.probe("startupz") == 200
    assert "--no-tls" in plain.log and "clear text" in plain.log
