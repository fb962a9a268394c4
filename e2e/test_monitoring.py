"""Monitoring on a real Prometheus (localkube's `up --prometheus`), which scrapes the pods as the chart's
PodMonitors select them and evaluates the chart's alert rules.

One cluster of three for the module, the tests in order: every member and the operator are scraped
(targets up, the members' and the operator's series there); healthy, no alert of the cluster fires;
after a failover, pgherd_failovers_total rose and the old primary reports pgherd_postgres_in_recovery
1; with the backup store down and WAL being written, PgherdWALArchivingFailing fires (and archiving
catches up once the store is back); with a Completed Backup, every panel of the dashboard
(charts/pgherd/monitoring/dashboard.json) answers with data; with a majority of the members down,
PgherdQuorumLost fires.

The alerts are loaded with their durations divided by COMPRESSION (e2e/monitoring.py), so that each
fires in seconds rather than minutes: the same expressions on the same series. promtool's unit tests
(tests/chart/test_alerts.py) prove the real durations."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from e2e import manifests
from e2e.checks import insert_ids
from e2e.dashboard import check_dashboard
from e2e.driver import NewCluster, backup_phase, healthy, replicas, unless_failed
from e2e.drivers.localkube import LocalKubeDriver
from e2e.localkube.prometheus import MEMBERS_JOB, OPERATOR_JOB
from e2e.monitoring import Prometheus, compress_rules

DRIVER = os.environ.get("PGHERD_E2E_DRIVER", "local")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        DRIVER != "localkube",
        reason="the Prometheus scenarios run on localkube (`up --prometheus`): PGHERD_E2E_DRIVER=localkube",
    ),
]

NAME = "e2e-monitoring"
BACKUP = "e2e-monitoring-backup"
INSTANCES = 3
COMPRESSION = 20  # 5m -> 15 s, 2m -> 6 s
SCRAPE_WAIT = 90.0
ALERT_WAIT = 150.0


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, pg_version: int) -> LocalKubeDriver:
    driver = new_cluster(manifests.cluster(NAME, postgres_version=pg_version, instances=INSTANCES))
    assert isinstance(driver, LocalKubeDriver)
    return driver


@pytest.fixture(scope="module")
def prometheus(cluster: LocalKubeDriver) -> Iterator[Prometheus]:
    url = cluster.localkube.prometheus_url
    if url is None:
        pytest.skip("this localkube has no Prometheus: scripts/ensure-prometheus.sh, then `up --prometheus`")
    server = Prometheus(url)
    rules = cluster.localkube.dir / "prometheus" / "rules" / "alerts.yaml"
    original = rules.read_text()
    server.load_rules(rules, compress_rules(original, COMPRESSION))
    yield server
    server.load_rules(rules, original)


def selector(cluster: LocalKubeDriver, **labels: str) -> str:
    pairs = {"namespace": cluster.namespace, "cluster": NAME, **labels}
    return "{" + ",".join(f'{k}="{v}"' for k, v in pairs.items()) + "}"


def eventually(what: str, check: Callable[[], Any], timeout: float, every: float = 2.0) -> Any:
    """`check()`'s first truthy result within `timeout`, else a failure naming `what` and the last."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s (last: {last!r})")
        time.sleep(every)


def record(cluster: LocalKubeDriver, scenario: str, start: float, **details: Any) -> None:
    """The scenario's window, in DIR/prometheus/scenarios.json: scripts/monitoring_plots.py draws the
    series of docs/monitoring.md from the cluster's Prometheus over it."""
    path = cluster.localkube.dir / "prometheus" / "scenarios.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    known[scenario] = {
        "start": start, "end": time.time() + 15, "namespace": cluster.namespace, "cluster": NAME, **details
    }  # fmt: skip
    path.write_text(json.dumps(known, indent=2) + "\n")


def per_member(prometheus: Prometheus, expr: str) -> dict[str, float]:
    return {r["metric"]["member"]: float(r["value"][1]) for r in prometheus.query(expr)}


def firing(
    prometheus: Prometheus, cluster: LocalKubeDriver, alert: str | None = None
) -> list[dict[str, Any]]:
    namespace = cluster.namespace
    return [
        a
        for a in prometheus.alerts("firing")
        if a["labels"].get("namespace") == namespace and alert in (None, a["labels"]["alertname"])
    ]


def test_every_member_and_the_operator_are_scraped(cluster: LocalKubeDriver, prometheus: Prometheus) -> None:
    status = cluster.wait_for(unless_failed(healthy(INSTANCES)), 300, "a healthy cluster")
    members = {m["name"] for m in status["members"]}
    namespace = cluster.namespace

    def scraped() -> bool:
        up = {
            t["labels"].get("pod")
            for t in prometheus.targets()
            if t["labels"]["job"] == MEMBERS_JOB
            and t["labels"].get("namespace") == namespace
            and t["health"] == "up"
        }
        operator = [
            t for t in prometheus.targets() if t["labels"]["job"] == OPERATOR_JOB and t["health"] == "up"
        ]
        return members <= up and bool(operator)

    eventually(f"targets up for {sorted(members)} and the operator", scraped, SCRAPE_WAIT)
    # A scrape from before the members were all ready may say 0: the next ones say 1.
    eventually(
        "pgherd_postgres_up 1 from every member",
        lambda: (
            per_member(prometheus, f"pgherd_postgres_up{selector(cluster)}") == dict.fromkeys(members, 1.0)
        ),
        SCRAPE_WAIT,
    )
    roles = {m: (0.0 if m == status["primary"] else 1.0) for m in members}
    eventually(
        "pgherd_postgres_in_recovery 0 from the primary, 1 from the replicas",
        lambda: per_member(prometheus, f"pgherd_postgres_in_recovery{selector(cluster)}") == roles,
        SCRAPE_WAIT,
    )
    assert eventually(
        "the operator's pgherd_cluster_members",
        lambda: prometheus.value(f"pgherd_cluster_members{selector(cluster)}"),
        SCRAPE_WAIT,
    ) == float(INSTANCES)
    # The operator's gauges are those of its last scrape, which may predate the phase the status shows.
    eventually(
        "the operator's pgherd_cluster_phase Running 1",
        lambda: prometheus.value(f"pgherd_cluster_phase{selector(cluster, phase='Running')}") == 1.0,
        SCRAPE_WAIT,
    )
    eventually(
        "one operator replica leads",
        lambda: prometheus.value(f'max(pgherd_leader{{job="{OPERATOR_JOB}"}})') == 1.0,
        SCRAPE_WAIT,
    )


def test_a_healthy_cluster_fires_no_alert(cluster: LocalKubeDriver, prometheus: Prometheus) -> None:
    cluster.wait_for(unless_failed(healthy(INSTANCES)), 120, "a healthy cluster")
    # The `for` of every alert a healthy cluster could trip (5 min / COMPRESSION) passes twice over.
    time.sleep(35)
    assert firing(prometheus, cluster) == []
    assert [a for a in prometheus.alerts("firing") if a["labels"]["alertname"] == "PgherdOperatorDown"] == []


def test_a_failover_is_counted_and_the_old_primary_reports_recovery(
    cluster: LocalKubeDriver, prometheus: Prometheus
) -> None:
    status = cluster.wait_for(unless_failed(healthy(INSTANCES)), 120, "a healthy cluster")
    old = str(status["primary"])
    started = time.time() - 30
    before = prometheus.value(f"pgherd_failovers_total{selector(cluster)}") or 0.0
    # Kept down until a replica is promoted (a crashed container the kubelet restarts at once may be
    # promoted in place again, which is no failover), then back as a replica.
    cluster.kill(old, keep_down=True)
    try:
        cluster.wait_for(unless_failed(lambda s: s.get("primary") not in (None, old)), 120, "a new primary")
    finally:
        cluster.bring_back(old)
    status = cluster.wait_for(unless_failed(healthy(INSTANCES)), 240, f"{old} back as a replica")
    eventually(
        "pgherd_failovers_total to rise",
        lambda: (prometheus.value(f"pgherd_failovers_total{selector(cluster)}") or 0.0) > before,
        SCRAPE_WAIT,
    )
    eventually(
        f"pgherd_postgres_in_recovery 1 from the old primary {old}",
        lambda: prometheus.value(f"pgherd_postgres_in_recovery{selector(cluster, member=old)}") == 1.0,
        SCRAPE_WAIT,
    )
    # Its last scrape may predate the promotion (every 5 s, of a reading up to 1 s old): the failover
    # and the old primary's return now fit in less.
    new = str(status["primary"])
    eventually(
        f"pgherd_postgres_in_recovery 0 from the new primary {new}",
        lambda: prometheus.value(f"pgherd_postgres_in_recovery{selector(cluster, member=new)}") == 0.0,
        SCRAPE_WAIT,
    )
    record(cluster, "failover", started, old=old, new=str(status["primary"]))


def test_archiving_to_an_unreachable_store_fires_its_alert(
    cluster: LocalKubeDriver, prometheus: Prometheus
) -> None:
    cluster.wait_for(unless_failed(healthy(INSTANCES)), 120, "a healthy cluster")
    assert firing(prometheus, cluster, "PgherdWALArchivingFailing") == []
    ids = iter(range(1, 1_000_000))
    started = time.time() - 30
    with cluster.store_unreachable():

        def writes_then_fires() -> list[dict[str, Any]]:
            insert_ids(cluster.rw_dsn(), [next(ids)])
            cluster.superuser_value("SELECT pg_switch_wal()")  # a segment to archive
            return firing(prometheus, cluster, "PgherdWALArchivingFailing")

        alerts = eventually("PgherdWALArchivingFailing to fire", writes_then_fires, ALERT_WAIT, every=3.0)
    primary = str(cluster.status()["primary"])
    assert {a["labels"].get("member") for a in alerts} == {primary}, alerts
    eventually(
        "archiving to catch up once the store is back",
        lambda: (
            prometheus.value(f"pgherd_wal_archive_pending_segments{selector(cluster, member=primary)}") == 0
        ),
        ALERT_WAIT,
    )
    record(cluster, "archiving", started, member=primary)


def test_every_panel_of_the_dashboard_has_data(cluster: LocalKubeDriver, prometheus: Prometheus) -> None:
    cluster.apply(manifests.backup(BACKUP, NAME))
    status = cluster.wait_for(
        lambda s: backup_phase(s, BACKUP) in ("Completed", "Failed"), 240, f"Backup {BACKUP}"
    )
    assert backup_phase(status, BACKUP) == "Completed", status.get("backups")
    # The operator reports the Backup at its next tick, Prometheus at its next scrape.
    deadline = time.monotonic() + SCRAPE_WAIT
    while (
        problems := check_dashboard(prometheus.url, cluster.namespace, NAME)
    ) and time.monotonic() < deadline:
        time.sleep(5.0)
    assert not problems, "\n".join(problems)


def test_a_majority_down_fires_quorum_lost(cluster: LocalKubeDriver, prometheus: Prometheus) -> None:
    status = cluster.wait_for(unless_failed(healthy(INSTANCES)), 120, "a healthy cluster")
    down = sorted(replicas(status))
    assert len(down) == INSTANCES - 1
    for member in down:
        cluster.kill(member, keep_down=True)
    try:
        eventually(
            "PgherdQuorumLost to fire", lambda: firing(prometheus, cluster, "PgherdQuorumLost"), ALERT_WAIT
        )
    finally:
        for member in down:
            cluster.bring_back(member)
    cluster.wait_for(unless_failed(healthy(INSTANCES)), 300, "the cluster healthy again")
