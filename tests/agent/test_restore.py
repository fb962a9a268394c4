"""POST /actions/restore: a fenced member restores a snapshot into its own volume, in place. Real
PostgreSQL, a real S3 server (reached through a proxy that can be made slow, so that a restore is
still in progress when the tests ask again), snapshots taken by `pgherd-backup snapshot`."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from agent_helpers import CLUSTER, MEMBERS, Agent

from pgherd_backup.agent.client import AgentActionError, AgentBusy
from pgherd_backup.agent.wire import ActionOutcome, Status


@pytest.fixture
def primary(agents, s3_store, s3_proxy) -> Agent:
    """A primary archiving to this test's store through the proxy, with rows 1..100 in table t."""
    env = {**s3_store.endpoint.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3_proxy.port}"}
    agent = agents.primary(MEMBERS[0], "--store", s3_store.url, env=env)
    agent.sql("CREATE TABLE t AS SELECT generate_series(1, 100) AS x")
    return agent


def _archive(agent: Agent) -> None:
    """Close the current WAL segment and wait until it is archived."""
    segment = str(agent.value("SELECT pg_walfile_name(pg_switch_wal())"))
    agent.wait_until(
        lambda: str(agent.value("SELECT coalesce(last_archived_wal, '') FROM pg_stat_archiver")) >= segment,
        f"the archiving of {segment}",
    )


def _snapshot(agent: Agent, run) -> str:
    taken = run("snapshot", "--cluster", CLUSTER, "--source", agent.dsn())
    assert taken.returncode == 0, taken.stderr
    return str(taken.json()["id"])


def _kept(agent: Agent) -> list[Path]:
    kept = agent.volume / "kept"
    return sorted(kept.iterdir()) if kept.is_dir() else []


def _outcome(agent: Agent, request_id: str, timeout: float = 120) -> ActionOutcome:
    """Wait until /status says how the restore `request_id` ended."""
    seen: list[Status] = []

    def ended() -> bool:
        status = agent.status()
        seen.append(status)
        last = status.last_action
        return status.action is None and last is not None and last.request_id == request_id

    agent.wait_until(ended, f"the end of restore {request_id}", timeout=timeout)
    outcome = seen[-1].last_action
    assert outcome is not None and outcome.name == "restore"
    return outcome


def test_a_member_that_is_not_fenced_is_refused_and_nothing_changes(primary):
    with pytest.raises(AgentActionError) as refused:
        primary.client.restore(request_id="r0", reason="test")
    assert refused.value.status == 409 and refused.value.reason == "refused"
    assert "not fenced" in refused.value.message
    status = primary.status()
    assert (status.role, status.postmaster, status.fenced) == ("primary", "running", False)
    assert status.action is None and status.last_action is None and status.kept_aside == ()
    assert _kept(primary) == [] and primary.value("SELECT count(*) FROM t") == 100
    # a malformed target is a bad request, answered before anything else
    primary.client.fence(reason="test")
    with pytest.raises(AgentActionError) as bad:
        primary.client.restore(target="yesterday", request_id="r0")
    assert bad.value.status == 400 and "recovery target" in bad.value.message
    assert primary.status().last_action is None and _kept(primary) == []


def test_restore_to_a_target_keeps_the_old_data_aside_and_promotes(primary, agent, s3_proxy):
    _archive(primary)
    snapshot = _snapshot(primary, agent)
    primary.sql("INSERT INTO t SELECT generate_series(101, 200)")  # before the target
    target = str(primary.value("SELECT pg_current_wal_lsn()"))
    primary.sql("INSERT INTO t SELECT generate_series(201, 300)")  # after it: must not come back
    _archive(primary)
    timeline = primary.status().timeline
    primary.client.fence(reason="a disaster")
    (primary.pgdata / "pgherd-test-marker").write_text("the old data\n")

    s3_proxy.delay = 1.5  # every new S3 connection waits: the restore is still running below
    started = primary.client.restore(snapshot="latest", target=f"lsn:{target}", request_id="r1")
    assert started.in_progress and started.changed
    again = primary.client.restore(snapshot="latest", target=f"lsn:{target}", request_id="r1")
    assert again.in_progress and not again.changed  # the same order: its progress, not a second restore
    with pytest.raises(AgentBusy):
        primary.client.restore(snapshot=snapshot, request_id="r2")
    running = primary.status()
    assert running.action == "restore" and running.action_progress is not None
    assert running.action_progress.request_id == "r1" and running.action_progress.stage == "restoring"
    assert running.data_present  # never "no data" while the action replaces it

    stages = set()

    def progressed() -> bool:
        status = primary.status()
        if status.action_progress is not None:
            stages.add(status.action_progress.stage)
            if status.action_progress.stage == "replaying":
                s3_proxy.delay = 0.0  # the archive's WAL at full speed
            if status.action_progress.bytes_total:
                assert status.action_progress.snapshot == snapshot
                assert 0 <= (status.action_progress.bytes_done or 0) <= status.action_progress.bytes_total
                stages.add("sized")
        return status.action is None

    primary.wait_until(progressed, "the end of the restore", timeout=180)
    s3_proxy.delay = 0.0
    outcome = _outcome(primary, "r1")
    assert outcome.ok, outcome.error
    assert outcome.snapshot == snapshot and outcome.target == f"lsn:{target}"
    assert {"restoring", "replaying", "sized"} <= stages, stages

    # The old data is kept on the volume, the restored member is the primary on a new timeline, with
    # the rows written before the target and none after it.
    (kept,) = _kept(primary)
    assert (kept / "pgherd-test-marker").read_text() == "the old data\n"
    assert (kept / "PG_VERSION").exists() and outcome.kept_aside == str(kept)
    assert not (primary.pgdata / "pgherd-test-marker").exists()
    status = primary.status()
    assert (status.role, status.postmaster, status.fenced, status.demoted) == (
        "primary",
        "running",
        False,
        False,
    )
    assert status.upstream is None and status.kept_aside == (str(kept),)
    assert outcome.timeline == status.timeline and timeline is not None and status.timeline > timeline
    assert primary.value("SELECT count(*) FROM t") == 200 and primary.value("SELECT max(x) FROM t") == 200
    primary.sql("INSERT INTO t VALUES (301)")  # writable
    state = json.loads((primary.volume / "agent" / "state.json").read_text())
    assert state["restore"] is None and state["role_at_fence"] is None

    # Asked again with its id once done: its outcome, and nothing restored again.
    done = primary.client.restore(snapshot="latest", target=f"lsn:{target}", request_id="r1")
    assert not done.changed and not done.in_progress and done.timeline == outcome.timeline
    assert len(_kept(primary)) == 1 and primary.value("SELECT count(*) FROM t") == 201
    # A new restore of a member that runs as the primary again is refused: it is not fenced.
    with pytest.raises(AgentActionError) as refused:
        primary.client.restore(request_id="r3")
    assert refused.value.status == 409


def test_a_failed_restore_leaves_the_member_fenced_with_its_data(primary, agent):
    _archive(primary)
    _snapshot(primary, agent)
    primary.client.fence(reason="test")
    before = sorted(p.name for p in primary.pgdata.iterdir())

    assert primary.client.restore(snapshot="20000101T000000Z", request_id="missing").in_progress
    outcome = _outcome(primary, "missing")
    assert not outcome.ok and "20000101T000000Z" in (outcome.error or "")
    status = primary.status()
    assert status.fenced and status.postmaster == "stopped" and status.data_present
    assert status.last_error is not None and "20000101T000000Z" in status.last_error
    assert sorted(p.name for p in primary.pgdata.iterdir()) == before  # nothing moved, nothing deleted
    assert _kept(primary) == [] and status.kept_aside == ()
    assert primary.client.probe("healthz") == 200  # fenced: stopped on purpose
    # The same id again: its failure, never a second attempt; another id may try again.
    with pytest.raises(AgentActionError) as failed:
        primary.client.restore(snapshot="20000101T000000Z", request_id="missing")
    assert failed.value.status == 500 and "another requestId" in failed.value.message
    # The member is still usable: unfenced, it is the primary it was, with its rows.
    primary.client.unfence(primary=True)
    assert primary.value("SELECT count(*) FROM t") == 100


def test_a_restore_cut_short_by_the_agents_death_is_reported_and_its_partial_files_removed(
    primary, agent, s3_proxy
):
    _archive(primary)
    _snapshot(primary, agent)
    primary.client.fence(reason="test")
    state_file = primary.volume / "agent" / "state.json"

    s3_proxy.delay = 3.0  # each download connection waits: the agent dies while it writes the files
    assert primary.client.restore(request_id="cut").in_progress
    primary.wait_until(
        lambda: (json.loads(state_file.read_text()).get("restore") or {}).get("stage") == "restoring",
        "the restore's files being written",
    )
    assert primary.process is not None
    primary.process.send_signal(signal.SIGKILL)  # a lost pod: no clean-up of its own
    primary.wait_exit()
    s3_proxy.delay = 0.0

    primary.start()
    outcome = primary.status().last_action
    assert outcome is not None and outcome.request_id == "cut" and not outcome.ok
    assert "interrupted" in (outcome.error or "")
    status = primary.status()
    assert status.fenced and not status.data_present and status.postmaster == "stopped"
    assert not primary.pgdata.exists() or not any(primary.pgdata.iterdir())
    (kept,) = _kept(primary)
    assert (kept / "PG_VERSION").exists() and status.kept_aside == (str(kept),)
    assert json.loads(state_file.read_text())["restore"] is None
