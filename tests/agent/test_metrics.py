"""Every member's agent serves Prometheus metrics on its own plain-HTTP port: the contract's names with
sane values on a primary and its replica, scraped over HTTP and parsed by prometheus_client's parser;
read as pgherd_monitor alone (no fallback to the superuser); a flood of scrapes runs the queries once;
users' own queries from a file, a bad one reported without breaking the rest."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from agent_helpers import CLUSTER, MEMBERS, Agent
from prometheus_client.parser import text_string_to_metric_families

from pgherd.local.ports import free_port
from pgherd_backup.agent import custom_queries

# The metric names of the contract (docs/monitoring.md), each with the member's labels.
CONTRACT = (
    "pgherd_postgres_up",
    "pgherd_postgres_in_recovery",
    "pgherd_timeline",
    "pgherd_replication_lag_bytes",
    "pgherd_replication_lag_seconds",
    "pgherd_wal_archive_last_success_timestamp_seconds",
    "pgherd_wal_archive_failures_total",
    "pgherd_wal_archive_pending_segments",
    "pgherd_volume_used_bytes",
    "pgherd_volume_size_bytes",
    "pgherd_connections",
    "pgherd_max_connections",
    "pgherd_oldest_xid_age",
    "pgherd_checkpoints_total",
    "pgherd_database_size_bytes",
    "pgherd_agent_scrape_duration_seconds",
    "pgherd_agent_metrics_queries_total",
)
FLOOD = 200


@dataclass
class Scrape:
    """One exposition, parsed: samples by name (a counter's under its `_total` name)."""

    text: str
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    families: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        for family in text_string_to_metric_families(self.text):
            self.families.add(family.name)
            for sample in family.samples:
                self.samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))

    def value(self, name: str, **labels: str) -> float:
        found = [v for have, v in self.samples.get(name, []) if labels.items() <= have.items()]
        assert len(found) == 1, f"{name}{labels}: {found} in\n{self.text}"
        return found[0]

    def values(self, name: str, label: str) -> dict[str, float]:
        return {have[label]: v for have, v in self.samples.get(name, [])}


def fetch(port: int, timeout: float = 10) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as answer:
        assert answer.status == 200
        assert answer.headers["Content-Type"].startswith("text/plain")
        return str(answer.read().decode())


def scrape(agent: Agent) -> Scrape:
    return Scrape(fetch(agent.metrics_port))


def fresh_scrape(agent: Agent) -> Scrape:
    """A scrape answered from a new reading (the cached one is at most a second old)."""
    time.sleep(1.1)
    return scrape(agent)


def wait_for(agent: Agent, predicate, what: str, timeout: float = 60) -> Scrape:  # type: ignore[no-untyped-def]
    got: list[Scrape] = []

    def check() -> bool:
        got[:] = [scrape(agent)]
        return bool(predicate(got[0]))

    agent.wait_until(check, what, timeout)
    return got[0]


@pytest.fixture(scope="module")
def pair(module_agents) -> Iterator[tuple[Agent, Agent]]:  # type: ignore[no-untyped-def]
    primary = module_agents.primary(MEMBERS[0])
    replica = module_agents(MEMBERS[1], "--seed", "basebackup", "--upstream", primary.address)
    replica.wait_streaming()
    yield primary, replica


def test_a_primary_and_its_replica_export_every_metric_of_the_contract(pair):
    primary, replica = pair
    primary.sql("CREATE DATABASE shop")
    first = {a.name: wait_for(a, lambda s: s.value("pgherd_postgres_up") == 1, "up") for a in pair}
    for agent in pair:
        metrics = first[agent.name]
        missing = [name for name in CONTRACT if name not in metrics.samples]
        assert not missing, f"{agent.name}: {missing}"
        for name in CONTRACT:
            for labels, _ in metrics.samples[name]:
                assert (labels["cluster"], labels["member"]) == (CLUSTER, agent.name), name
        assert metrics.value("pgherd_timeline") == 1
        assert metrics.value("pgherd_max_connections") == 30
        size, used = metrics.value("pgherd_volume_size_bytes"), metrics.value("pgherd_volume_used_bytes")
        assert 0 < used <= size
        assert metrics.value("pgherd_volume_available_bytes") <= size - used
        assert metrics.value("pgherd_oldest_xid_age") > 0
        assert set(metrics.values("pgherd_checkpoints_total", "kind")) == {"timed", "requested"}
        assert {"active", "idle"} <= set(metrics.values("pgherd_connections", "state"))
        assert metrics.value("pgherd_agent_metrics_queries_total") >= 1
        assert 0 < metrics.value("pgherd_agent_scrape_duration_seconds") < 1.5
        assert metrics.value("pgherd_agent_metrics_error", reason="connect") == 0
        assert metrics.value("pgherd_fenced") == 0
        assert metrics.value("pgherd_wal_archive_failures_total") == 0
        assert metrics.value("pgherd_wal_archive_pending_segments") == 0
        assert metrics.value("pgherd_wal_archive_last_success_timestamp_seconds") == 0  # no store: never
        assert metrics.value("pgherd_agent_process_resident_memory_bytes") > 0
    assert first[primary.name].value("pgherd_postgres_in_recovery") == 0
    assert first[replica.name].value("pgherd_postgres_in_recovery") == 1
    assert first[primary.name].value("pgherd_wal_receiver_streaming") == 0
    assert first[replica.name].value("pgherd_wal_receiver_streaming") == 1
    assert first[primary.name].value("pgherd_replication_lag_bytes") == 0
    # database sizes: every database that takes connections, as PostgreSQL counts them
    sizes = fresh_scrape(primary).values("pgherd_database_size_bytes", "database")
    assert set(sizes) == {"postgres", "template1", "shop"}, sizes
    assert sizes["shop"] == primary.value("SELECT pg_database_size('shop')")
    # the primary reports its standby by name
    standbys = first[primary.name].values("pgherd_standby_lag_bytes", "standby")
    assert list(standbys) == [replica.name] and standbys[replica.name] >= 0


def test_lag_after_a_write_on_the_primary(pair):
    primary, replica = pair
    replica.sql("SELECT pg_wal_replay_pause()")
    try:
        primary.sql("CREATE TABLE IF NOT EXISTS written (x text)")
        primary.sql("INSERT INTO written SELECT repeat('x', 1000) FROM generate_series(1, 2000)")
        behind = wait_for(
            replica,
            lambda s: (
                s.value("pgherd_replication_lag_bytes") > 1_000_000
                and s.value("pgherd_replication_lag_seconds") > 0
            ),
            "the replica's lag to show",
        )
        assert behind.value("pgherd_postgres_in_recovery") == 1
        wait_for(
            primary,
            lambda s: s.values("pgherd_standby_lag_bytes", "standby").get(replica.name, 0) > 1_000_000,
            "the primary to see its standby behind",
        )
    finally:
        replica.sql("SELECT pg_wal_replay_resume()")
    wait_for(
        replica,
        lambda s: (
            s.value("pgherd_replication_lag_bytes") == 0 and s.value("pgherd_replication_lag_seconds") == 0
        ),
        "the replica to catch up",
    )
    wait_for(
        primary,
        lambda s: s.values("pgherd_standby_lag_bytes", "standby").get(replica.name) == 0,
        "the primary to see its standby caught up",
    )


def test_the_queries_run_as_pgherd_monitor_on_one_kept_session(pair):
    primary, _ = pair
    fresh_scrape(primary)
    fresh_scrape(primary)
    sessions = primary.sql(
        "SELECT usename, (SELECT rolsuper FROM pg_roles WHERE rolname = usename) FROM pg_stat_activity"
        " WHERE application_name = 'pgherd-metrics'"
    )
    assert sessions == [("pgherd_monitor", False)]


def test_a_flood_of_scrapes_runs_the_queries_once(pair):
    primary, _ = pair
    with psycopg.connect(primary.dsn(), autocommit=True) as watcher:

        def figure(query: str) -> int:
            row = watcher.execute(query).fetchone()
            return int(row[0]) if row else 0

        def backends() -> int:
            return figure("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'")

        def sessions() -> int:
            return figure("SELECT sum(sessions) FROM pg_stat_database")

        before = fresh_scrape(primary).value("pgherd_agent_metrics_queries_total")
        baseline, sessions_before = backends(), sessions()
        time.sleep(1.1)  # the reading is stale: the flood's first scrape takes another
        most = [baseline]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                most.append(backends())
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        start = threading.Barrier(FLOOD)

        def one(_: int) -> str:
            start.wait()
            return fetch(primary.metrics_port, timeout=30)

        began = time.monotonic()
        try:
            with ThreadPoolExecutor(FLOOD) as pool:
                answers = [Scrape(text) for text in pool.map(one, range(FLOOD))]
        finally:
            done.set()
            sampler.join()
        took = time.monotonic() - began
        time.sleep(1.1)  # each backend's counters reach pg_stat_database within a second
        started_sessions = sessions() - sessions_before
    runs = {a.value("pgherd_agent_metrics_queries_total") - before for a in answers}
    report = (
        f"{FLOOD} scrapes in {took:.2f}s: readings {sorted(runs)}; client backends {baseline} before, at"
        f" most {max(most)} during; {started_sessions} sessions started"
    )
    print(report)
    assert len(answers) == FLOOD and all(a.value("pgherd_postgres_up") == 1 for a in answers), report
    # one reading (two if the flood outlived a second), not one per scrape
    assert runs <= {1, 2} and 1 in runs, report
    assert max(most) <= baseline + 1 and started_sessions == 0, report


def test_postgres_up_is_0_while_the_member_is_fenced(agents):
    primary = agents.primary(MEMBERS[2])
    assert scrape(primary).value("pgherd_postgres_up") == 1
    primary.client.fence(reason="test: metrics of a stopped PostgreSQL")
    stopped = scrape(primary)  # a fence makes the last reading stale at once
    assert stopped.value("pgherd_postgres_up") == 0
    assert stopped.value("pgherd_agent_metrics_error", reason="not_running") == 1
    assert stopped.value("pgherd_fenced") == 1
    assert stopped.value("pgherd_volume_used_bytes") > 0  # the agent's own, without PostgreSQL
    assert "pgherd_timeline" not in stopped.samples  # nothing from PostgreSQL
    primary.client.unfence(primary=True, reason="test")
    wait_for(primary, lambda s: s.value("pgherd_postgres_up") == 1, "up again")


def test_no_fallback_to_the_superuser_when_pgherd_monitor_cannot_log_in(agents):
    primary = agents.primary(MEMBERS[3])
    primary.sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'pgherd_monitor'")
    primary.sql("DROP ROLE pgherd_monitor")  # a cluster made before the role existed
    down = fresh_scrape(primary)
    assert down.value("pgherd_postgres_up") == 0
    assert down.value("pgherd_agent_metrics_error", reason="connect") == 1
    assert "cannot log in as pgherd_monitor" in primary.log
    assert not primary.sql("SELECT 1 FROM pg_stat_activity WHERE application_name = 'pgherd-metrics'")
    # the probes' view creates the role (as the superuser, its job); the metrics then read as it
    assert primary.client.probe("readyz") == 200
    wait_for(primary, lambda s: s.value("pgherd_postgres_up") == 1, "the metrics to read as pgherd_monitor")


def test_archive_failures_are_counted_and_segments_wait(agents):
    nowhere = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "AWS_ACCESS_KEY_ID": "nobody",
        "AWS_SECRET_ACCESS_KEY": "nothing",
        "AWS_REGION": "us-east-1",
        "PGHERD_S3_RETRIES": "1",
        "PGHERD_S3_CONNECT_TIMEOUT": "1",
    }
    primary = agents.primary(MEMBERS[4], "--store", "s3://nowhere/archive", env=nowhere)
    primary.sql("CREATE TABLE t AS SELECT 1 AS x")
    primary.sql("SELECT pg_switch_wal()")
    failing = wait_for(
        primary,
        lambda s: (
            s.value("pgherd_wal_archive_failures_total") >= 1
            and s.value("pgherd_wal_archive_pending_segments") >= 1
        ),
        "an archive failure counted",
        timeout=90,
    )
    assert failing.value("pgherd_wal_archive_last_success_timestamp_seconds") == 0
    assert failing.value("pgherd_postgres_up") == 1


CUSTOM = """
- name: activity
  help: Backends and commits by database.
  query: >-
    SELECT datname, numbackends AS backends, xact_commit AS commits, NULL::int AS nothing
    FROM pg_stat_database WHERE datname IS NOT NULL
  metrics:
    - {column: datname, usage: label}
    - {column: backends, usage: gauge}
    - {column: commits, usage: counter}
    - {column: nothing, usage: gauge}
- name: transaction
  query: SELECT (current_setting('transaction_read_only') = 'on')::int AS read_only;
  metrics: [{column: read_only, usage: gauge}]
- name: broken
  query: SELECT 1/0 AS x
  metrics: [{column: x, usage: gauge}]
- name: two_statements
  query: SELECT 1 AS x; CREATE TABLE written_by_a_metric (x int)
  metrics: [{column: x, usage: gauge}]
- name: writer
  query: CREATE TABLE written_by_a_metric (x int)
  metrics: [{column: x, usage: gauge}]
- name: slow
  query: SELECT 1 AS x FROM pg_sleep(30)
  metrics: [{column: x, usage: gauge}]
- name: twice
  query: SELECT 'a' AS l, 1 AS v UNION ALL SELECT 'a', 2
  metrics: [{column: l, usage: label}, {column: v, usage: gauge}]
- name: Bad-Name
  query: SELECT 1 AS x
  metrics: [{column: x, usage: gauge}]
- name: labels_only
  query: SELECT 'a' AS x
  metrics: [{column: x, usage: label}]
"""


def test_custom_queries_from_a_file_a_bad_one_reported_and_the_rest_served(agents, work_root: Path):
    queries = work_root / f"custom-queries-{time.monotonic_ns()}.yaml"
    queries.write_text(CUSTOM)
    primary = agents.primary(MEMBERS[5], "--custom-queries", str(queries))
    started = time.monotonic()
    metrics = fresh_scrape(primary)
    took = time.monotonic() - started - 1.1
    assert took < 5, "the slow query is cut by its statement_timeout (2 s)"
    backends = metrics.values("pgherd_custom_activity_backends", "datname")
    assert backends["postgres"] >= 1 and "template1" in backends
    assert metrics.value("pgherd_custom_activity_commits_total", datname="postgres") > 0
    assert "pgherd_custom_activity_nothing" not in metrics.samples  # NULL: no sample
    assert metrics.value("pgherd_custom_transaction_read_only") == 1
    errors = metrics.values("pgherd_custom_query_errors_total", "query")
    assert set(errors) == {"broken", "two_statements", "writer", "slow", "twice"}, errors
    assert metrics.value("pgherd_custom_queries_loaded") == 7
    assert metrics.value("pgherd_custom_queries_refused") == 2  # Bad-Name, labels_only
    assert "Bad-Name" in primary.log and "no column is a gauge or a counter" in primary.log
    assert not primary.sql("SELECT 1 FROM pg_class WHERE relname = 'written_by_a_metric'")
    # the agent's own metrics are all there, from the same reading
    assert metrics.value("pgherd_postgres_up") == 1
    assert all(name in metrics.samples for name in CONTRACT)
    # a changed file is read again (a ConfigMap's update)
    queries.write_text(CUSTOM.split("- name: transaction")[0])
    changed = wait_for(primary, lambda s: s.value("pgherd_custom_queries_loaded") == 1, "the file read again")
    assert changed.value("pgherd_custom_queries_refused") == 0
    assert "pgherd_custom_transaction_read_only" not in changed.samples


def test_a_missing_file_and_other_paths(agents, work_root: Path):
    primary = agents.primary(MEMBERS[6], "--custom-queries", str(work_root / "no-such-file.yaml"))
    metrics = scrape(primary)
    assert metrics.value("pgherd_custom_queries_refused") == 1
    assert metrics.value("pgherd_postgres_up") == 1
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{primary.metrics_port}/status", timeout=10)
    assert refused.value.code == 404


def test_the_custom_queries_file_is_checked_entry_by_entry():
    text = """
- {name: ok, query: SELECT 1 AS x, metrics: [{column: x, usage: gauge}]}
- {name: ok, query: SELECT 2 AS y, metrics: [{column: y, usage: gauge}]}
- {name: ok_x, query: SELECT 1 AS y, metrics: [{column: y, usage: counter}], help: 'clash? no'}
- {name: a, query: SELECT 1 AS b_c, metrics: [{column: b_c, usage: gauge}]}
- {name: a_b, query: SELECT 1 AS c, metrics: [{column: c, usage: gauge}]}
- {name: lab, query: 'SELECT 1 AS member, 2 AS v', metrics: [{column: member, usage: label}, {column: v, usage: gauge}]}
- {name: kind, query: SELECT 1 AS v, metrics: [{column: v, usage: histogram}]}
- {name: extra, query: SELECT 1 AS v, metrics: [{column: v, usage: gauge}], database: shop}
- {name: __reserved, query: SELECT 1 AS v, metrics: [{column: v, usage: gauge}]}
- {name: empty, query: ' ', metrics: [{column: v, usage: gauge}]}
- just a string
- {name: queries, query: SELECT 1 AS loaded, metrics: [{column: loaded, usage: gauge}]}
- {name: c, query: SELECT 1 AS n_total, metrics: [{column: n_total, usage: gauge}]}
- {name: c_n, query: SELECT 1 AS x, metrics: [{column: x, usage: gauge}]}
- {name: d, query: SELECT 1 AS n, metrics: [{column: n, usage: counter}]}
- {name: d_n, query: SELECT 1 AS total, metrics: [{column: total, usage: gauge}]}
"""
    queries, problems = custom_queries.parse(text, "q.yaml")
    assert [q.name for q in queries] == ["ok", "ok_x", "a", "c", "c_n", "d"]
    assert queries[2].metric_name(queries[2].values[0]) == "pgherd_custom_a_b_c"
    expected = [
        "q.yaml: query #2 (ok): another query has the name 'ok'",
        "q.yaml: query #5 (a_b): pgherd_custom_a_b_c (with or without _total) already made",
        "q.yaml: query #6 (lab): column member: the agent sets the label 'member' itself",
        "q.yaml: query #7 (kind): column v: usage 'histogram', expected one of gauge, counter, label",
        "q.yaml: query #8 (extra): unknown key(s) database",
        "q.yaml: query #9 (__reserved): name '__reserved' is not a metric name",
        "q.yaml: query #10 (empty): query: a SELECT is required",
        "q.yaml: query #11: expected a mapping {name, query, help, metrics}, got a string",
        "q.yaml: query #12 (queries): pgherd_custom_queries_loaded is the agent's own metric",
        "q.yaml: query #16 (d_n): pgherd_custom_d_n (with or without _total) already made",
    ]
    assert len(problems) == len(expected), problems
    for problem, start in zip(problems, expected, strict=True):
        assert problem.startswith(start), problem
    assert custom_queries.parse("{a: 1}", "q.yaml") == (
        (),
        ["q.yaml: expected a list of queries ({name, query, help, metrics}), got a mapping"],
    )
    assert custom_queries.parse("", "q.yaml") == ((), [])
    assert custom_queries.parse("- [", "q.yaml")[1][0].startswith("q.yaml: not YAML")
