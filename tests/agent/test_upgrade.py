"""The agent's major upgrade (POST /actions/upgrade) on real PostgreSQL, 16 to 17 (the pinned PyPI wheels
of one release, which `make setup` fetches): the preflight against a live primary, a refused
preflight that changes nothing, pg_upgrade --link with the data and extensions kept, the old data
directory kept aside, statistics rebuilt in the background, and a replica of the old major re-cloned
from the upgraded primary."""

from __future__ import annotations

from pathlib import Path

from agent_helpers import MEMBERS, Agent

from pgherd.local.postgres.resolve import resolve
from pgherd_backup.agent.wire import ActionOutcome
from pgherd_backup.postgres.binaries import data_major

OLD, NEW = 16, 17


def _env(*majors: int) -> dict[str, str]:
    """The variables that give an agent these majors' programs, the first as its default (as the sandbox
    does: PG_BIN and each fetched major in the cache)."""
    installs = [resolve(major) for major in majors]
    env = installs[0].environment()
    for install in installs:
        env[f"PG_BIN_{install.major}"] = str(install.bindir)
    return env


def _outcome(agent: Agent, request_id: str, timeout: float = 180) -> ActionOutcome:
    found: list[ActionOutcome] = []

    def ended() -> bool:
        last = agent.status().last_action
        if last is not None and last.request_id == request_id:
            found.append(last)
            return True
        return False

    agent.wait_until(ended, f"the end of {request_id}", timeout=timeout)
    return found[-1]


def _primary(agents, name: str, *flags: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    """A new primary of PostgreSQL 16 seeded by initdb (the tests' template is this machine's major)."""
    primary = agents(name, "--seed", "initdb", *flags, env=env or _env(OLD, NEW))
    primary.wait_until(lambda: primary.status().role == "primary", "the primary")
    assert primary.status().data_major == OLD
    return primary


def test_upgrade_check_then_link_upgrade_and_replica_recloned(agents):
    old_major, new_major = OLD, NEW
    env = _env(OLD, NEW)
    primary = _primary(agents, MEMBERS[0], env=env)
    primary.sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    primary.sql("INSERT INTO t SELECT g, md5(g::text) FROM generate_series(1, 5000) g")
    primary.sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    replica = agents(MEMBERS[1], "--seed", "basebackup", "--upstream", primary.address, env=env)
    replica.wait_streaming()

    # A preflight the old data fails: a reg* column pg_upgrade cannot carry. Nothing changes.
    primary.sql("CREATE TABLE bad (p regproc)")
    assert primary.client.upgrade(new_major, check=True, request_id="check-1").in_progress
    refused = _outcome(primary, "check-1")
    assert not refused.ok and "pg_upgrade --check failed" in str(refused.error), refused
    assert refused.detail == "nothing was changed"
    status = primary.status()
    assert (status.role, status.fenced, status.data_major) == ("primary", False, old_major)
    primary.sql("INSERT INTO t VALUES (5001, 'written after the refused check')")

    # The same check once the column is gone: passes, the primary serving writes all along.
    primary.sql("DROP TABLE bad")
    primary.client.upgrade(new_major, check=True, request_id="check-2")
    passed = _outcome(primary, "check-2")
    assert passed.ok and "MiB free" in passed.detail, passed
    primary.sql("INSERT INTO t VALUES (5002, 'written after the check')")
    assert primary.status().data_major == old_major

    # The upgrade needs writes stopped: refused on a running, unfenced primary (and nothing changes).
    primary.client.upgrade(new_major, request_id="too-early")
    early = _outcome(primary, "too-early")
    assert not early.ok and "fenced" in str(early.error)
    assert primary.status().role == "primary"

    final = primary.client.fence(reason="writes stopped for the upgrade").final_lsn
    replica.wait_until(lambda: replica.status().received_lsn == final, "the replica holding every write")
    replica.client.fence(reason="kept on the old major")
    primary.client.upgrade(new_major, request_id="upgrade-1")
    done = _outcome(primary, "upgrade-1")
    assert done.ok, done
    assert done.kept_aside and "pg_upgrade --link" in done.detail
    status = primary.status()
    assert (status.role, status.fenced, status.data_major) == ("primary", False, new_major)
    assert status.server_version is not None and status.server_version.startswith(f"{new_major}.")
    assert primary.value("SELECT count(*) FROM t") == 5002
    assert primary.value("SELECT count(*) FROM pg_extension WHERE extname = 'pg_stat_statements'") == 1
    primary.sql("INSERT INTO t VALUES (5003, 'on the new major')")
    # the old data directory is kept aside (its pg_control renamed by --link: it cannot start by mistake)
    assert data_major(done.kept_aside) == old_major
    # statistics: analyzed in the background, then /status says so no more
    primary.wait_until(lambda: not primary.status().analyzing, "the end of the analyze", timeout=120)
    assert primary.value("SELECT count(*) FROM pg_stats WHERE tablename = 't'") > 0
    # asked again with the same id: the answer of the upgrade done, never a second upgrade
    assert not primary.client.upgrade(new_major, request_id="upgrade-1").changed

    # the replica kept on the old major is untouched until it is rejoined: then re-cloned (no rewind
    # across majors), its old data kept aside, and it streams the new major
    kept = replica.status()
    assert (kept.fenced, kept.data_major, kept.postmaster) == (True, old_major, "stopped")
    rejoined = replica.client.rejoin(primary.address, reason="the upgrade is confirmed")
    assert rejoined.method == "reclone" and rejoined.kept_aside, rejoined
    status = replica.wait_streaming()
    assert status.data_major == new_major and str(status.server_version).startswith(f"{new_major}.")
    replica.wait_until(lambda: replica.value("SELECT count(*) FROM t") == 5003, "the new major's rows")


def test_upgrade_refused_without_the_new_major_changes_nothing(agents):
    old_major = OLD
    primary = _primary(agents, MEMBERS[0], env=_env(OLD))
    missing = 19  # no such programs anywhere here
    primary.client.upgrade(missing, check=True, request_id="nowhere")
    refused = _outcome(primary, "nowhere")
    assert not refused.ok and f"PostgreSQL {missing}'s programs are not here" in str(refused.error)
    primary.client.upgrade(old_major, check=True, request_id="same")
    same = _outcome(primary, "same")
    assert not same.ok and "goes to a later major" in str(same.error)
    status = primary.status()
    assert (status.role, status.fenced, status.data_major) == ("primary", False, old_major)


def test_a_setting_the_new_major_removed_fails_the_check_before_writes_stop(agents):
    setting = "old_snapshot_threshold=-1"  # accepted by 16, removed in 17 (its server refuses to start)
    primary = _primary(agents, MEMBERS[0], "--parameter", setting)
    primary.client.upgrade(NEW, check=True, request_id="settings")
    refused = _outcome(primary, "settings")
    name = setting.split("=")[0]
    assert not refused.ok and f"does not know these settings of the cluster: {name}" in str(refused.error)
    assert primary.status().role == "primary"
    primary.sql("CREATE TABLE still_writable (x int)")


def _waiting(agent: Agent) -> set[str]:
    """The WAL files of the agent's data directory that wait for the archiver."""
    status = agent.pgdata / "pg_wal" / "archive_status"
    return {mark.name.removesuffix(".ready") for mark in status.glob("*.ready")}


def _archived(s3_store) -> set[str]:  # type: ignore[no-untyped-def]
    """The WAL files in the test's store (whatever the agents' cluster name)."""
    client, bucket = s3_store.endpoint.client(), s3_store.endpoint.bucket
    prefix = s3_store.url.split("/", 3)[3] + "/"
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    keys = [item["Key"] for page in pages for item in page.get("Contents", [])]
    return {key.rsplit("/", 1)[-1] for key in keys if "/wal/" in key}


def test_the_old_majors_archive_holds_every_segment_the_stop_left_behind(agents, s3_store, s3_proxy):
    """An archive slower than the writes: the check waits until the archive caught up, and the segments a
    fast shutdown cut short by --stop-timeout left waiting are archived by the upgrade, before pg_upgrade:
    the old major's archive ends where its WAL ends (up to the segment the shutdown wrote in)."""
    env = {
        **_env(OLD, NEW),
        **s3_store.endpoint.env(),
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3_proxy.port}",
    }
    primary = _primary(agents, MEMBERS[0], "--store", s3_store.url, "--stop-timeout", "2", env=env)
    primary.sql("CREATE TABLE t (id int)")

    def backlog(segments: int) -> set[str]:
        for n in range(segments):
            primary.sql(f"INSERT INTO t VALUES ({n})")
            primary.sql("SELECT pg_switch_wal()")
        waiting = _waiting(primary)
        assert len(waiting) >= 2, waiting  # the archiver is behind: what the test is about
        return waiting

    s3_proxy.request_delay = 1.0
    behind = backlog(4)
    primary.client.upgrade(NEW, check=True, request_id="check")
    checked = _outcome(primary, "check")
    assert checked.ok and "the archive caught up" in checked.detail, checked
    assert behind <= _archived(s3_store)

    s3_proxy.request_delay = 4.0  # 4 s per archived file: the fast shutdown cannot wait for them
    behind = backlog(4)
    primary.client.fence(reason="writes stopped for the upgrade")
    left = _waiting(primary)
    assert left and not left <= _archived(s3_store), left  # the stop left segments unarchived
    s3_proxy.request_delay = 0.0
    primary.client.upgrade(NEW, request_id="upgrade")
    done = _outcome(primary, "upgrade")
    assert done.ok, done
    assert (behind | left) <= _archived(s3_store)
    assert done.kept_aside is not None
    assert not list((Path(done.kept_aside) / "pg_wal" / "archive_status").glob("*.ready"))
