"""The chart's Grafana dashboard (charts/pgherd/monitoring/dashboard.json), held to what Grafana and the
exporters need without running either: a Grafana JSON model whose every panel and query reads the
`${datasource}` variable, panels that tile the grid, every query parsed by a real promtool (as a recording
rule), and only metric and label names that the members' agents and the operator export, read from their
collectors in this process. Whether each query returns data is e2e/dashboard.py's check on a real
Prometheus."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e import dashboard
from prometheus_client import ProcessCollector
from prometheus_client.core import Metric

from pgherd.kube import metrics as operator_metrics
from pgherd_backup.agent import metrics as agent_metrics
from pgherd_backup.agent import status

PANEL_TYPES = {"stat", "timeseries", "table", "state-timeline"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# The sections the dashboard promises (docs/monitoring.md, "Dashboard").
ROWS = [
    "Cluster overview",
    "WAL and archiving",
    "Backups and recoverability",
    "Connections and transactions",
    "Volumes",
    "Members' agents",
    "The operator",
]
GRID_WIDTH = 24
# What a scrape adds to every series: the PodMonitors' target labels (e2e/localkube/prometheus.py), and
# Prometheus' own `up` for the operator's job.
TARGET_LABELS = {"namespace", "pod", "container", "endpoint", "job", "instance"}
PROMETHEUS_METRICS = {"up": TARGET_LABELS}
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"} | {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_SELECTOR = re.compile(r"([a-zA-Z_:][\w:]*)?\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENTIFIER = re.compile(r"(?<![\w.])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


# -- the names the exporters export ------------------------------------------------------------------


def a_complete_reading() -> agent_metrics.Reading:
    """A member's reading with every figure present, so that every family has samples."""
    live = status.Live(
        in_recovery=False,
        received=1,
        replayed=1,
        flushed=1,
        timeline=1,
        receiver=None,
        sync="",
        archiving_healthy=True,
        pending_restart=False,
        system_identifier="1",
        server_version="16.4",
    )
    figures = agent_metrics.Figures(
        archived_at=1.0,
        archive_failures=0,
        archive_pending=0,
        max_connections=100,
        oldest_xid_age=1,
        started_at=1.0,
        lag_bytes=0.0,
        lag_seconds=0.0,
        standby_lag={"pg-1": 0.0},
        connections={},
        database_sizes={"postgres": 1},
        checkpoints_timed=0,
        checkpoints_requested=0,
    )
    return agent_metrics.Reading(
        taken_at=0.0,
        key=(),
        duration=0.0,
        runs=1,
        error=None,
        live=live,
        figures=figures,
        volume=agent_metrics.Volume(size=2, used=1, available=1),
        fenced=False,
        crashes=0,
        pending_restart=False,
    )


def sample_names(family: Metric) -> set[str]:
    """The series names a family exposes, whether or not it has samples yet."""
    suffixes = {
        "counter": ["_total"],
        "histogram": ["_bucket", "_count", "_sum"],
        "summary": ["_count", "_sum"],
    }
    return {family.name + suffix for suffix in suffixes.get(family.type, [""])} | {
        sample.name for sample in family.samples
    }


def add_families(known: dict[str, set[str]], families: Iterable[Metric], extra_labels: set[str]) -> None:
    for family in families:
        labels = {label for sample in family.samples for label in sample.labels} | extra_labels
        for name in sample_names(family):
            known.setdefault(name, set()).update(labels)


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Every series name the members and the operator export, with the labels it can carry once scraped."""
    known: dict[str, set[str]] = {name: set(labels) for name, labels in PROMETHEUS_METRICS.items()}
    member = agent_metrics.families(a_complete_reading(), ["pg", "pg-0"])
    add_families(known, member, TARGET_LABELS)
    # The agent's own process figures, as its metrics server registers them (agent/metrics.py).
    add_families(known, ProcessCollector(namespace="pgherd_agent", registry=None).collect(), TARGET_LABELS)
    # A cluster as one tick of its loop records it, so that the per-cluster families have samples.
    namespace, cluster = "dashboard-test", "pg"
    operator_metrics.record(
        namespace,
        cluster,
        {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}], "instances": 3},
        last_backup_at=datetime.now(UTC),
        schedule=False,
        operation=None,
        failed_backups=[],
        certificates={"server": datetime.now(UTC)},
    )
    try:
        add_families(known, operator_metrics.REGISTRY.collect(), TARGET_LABELS)
    finally:
        operator_metrics.CLUSTERS.forget(namespace, cluster)
    # The operator's counters and histograms by call or code have no sample before their first use.
    for name in ("pgherd_api_requests_total",):
        known[name] |= {"verb", "code"}
    for name in ("pgherd_agent_call_duration_seconds_bucket", "pgherd_agent_call_duration_seconds_count"):
        known[name] |= {"call", "outcome", "le"}
    return known


# -- reading PromQL, as far as the checks below need ------------------------------------------------


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (selectors by name; functions and keywords left out)."""
    text = _STRING.sub('""', expr)
    names = {m[1] for m in _SELECTOR.finditer(text) if m[1]}
    text = _SELECTOR.sub(lambda m: f" {m[1] or ''} ", text)
    text = _RANGE.sub(" ", _GROUPING.sub(" ", text))
    return names | {m for m in _IDENTIFIER.findall(text) if m.lower() not in PROMQL_WORDS}


def matched_labels(expr: str) -> dict[str, set[str]]:
    """Metric name -> the label names its selectors match on."""
    out: dict[str, set[str]] = {}
    for match in _SELECTOR.finditer(_STRING.sub('""', expr)):
        out.setdefault(match[1] or "", set()).update(_MATCHER.findall(match[2]))
    return out


def grouping_labels(expr: str) -> set[str]:
    return {
        label.strip()
        for clause in _GROUPING.findall(_STRING.sub('""', expr))
        for label in clause.split(",")
        if label.strip()
    }


def test_reading_promql() -> None:
    expr = (
        'max by (member) (rate(a_total{namespace="x", state=~"idle (in)"}[5m]) + on (job) group_left (member)'
        ' (0 * b{cluster="$c"})) / histogram_quantile(0.5, sum by (le) (c_bucket)) > 1.5e9 and time() - d'
    )
    assert metric_names(expr) == {"a_total", "b", "c_bucket", "d"}
    assert matched_labels(expr) == {"a_total": {"namespace", "state"}, "b": {"cluster"}}
    assert grouping_labels(expr) == {"member", "job", "le"}


# -- the tests -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> dict[str, Any]:
    return dashboard.load()


@pytest.fixture(scope="module")
def queries(model: dict[str, Any]) -> list[dashboard.Query]:
    return dashboard.queries(dashboard.grafana_values("databases", "shop"), model)


def test_it_is_a_grafana_json_model(model: dict[str, Any]) -> None:
    assert model["uid"] == "pgherd" and model["title"] == "pgherd"
    assert model["schemaVersion"] >= 39
    assert dashboard.rows(model) == ROWS
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert list(variables) == ["datasource", "namespace", "cluster"]
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    for name in ("namespace", "cluster"):
        assert variables[name]["datasource"] == DATASOURCE
        # Also offered while the operator is down (members' series) or every member is (operator's).
        assert "pgherd_cluster_members|pgherd_postgres_up" in variables[name]["query"]["query"]
    inside_rows = [child for row in model["panels"] for child in row.get("panels", [])]
    ids = [p["id"] for p in [*model["panels"], *inside_rows]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert {p["type"] for p in dashboard.panels(model)} <= PANEL_TYPES


def test_panels_tile_the_grid(model: dict[str, Any]) -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in model["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= GRID_WIDTH, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in taken, f"{panel['title']!r} overlaps {taken[(x, y)]!r}"
                taken[(x, y)] = panel["title"]


def test_every_panel_and_query_reads_the_datasource_variable(model: dict[str, Any]) -> None:
    annotations = [a for a in model["annotations"]["list"] if not a.get("builtIn")]
    for item in [*dashboard.panels(model), *annotations]:
        assert item["datasource"] == DATASOURCE, f"{item.get('title') or item.get('name')}"
        for target in item.get("targets", []):
            assert target["datasource"] == DATASOURCE, f"{item['title']} {target['refId']}"
            assert target["expr"].strip(), f"{item['title']} {target['refId']}: no query"
    assert all(p.get("targets") for p in dashboard.panels(model)), "a panel without a query"


def test_every_query_parses(
    promtool: Path, tmp_path: Path, model: dict[str, Any], queries: list[dashboard.Query]
) -> None:
    """Each query and variable selector, its variables filled in, as a recording rule promtool checks."""
    variables = dashboard.variable_queries(dashboard.grafana_values("databases", "shop"), model)
    exprs = [q.expr for q in queries] + [v.selector for v in variables]
    rules = [{"record": f"pgherd_dashboard:query_{i}", "expr": expr} for i, expr in enumerate(exprs)]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, width=1000))
    result = subprocess.run(
        [str(promtool), "check", "rules", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, f"promtool check rules:\n{result.stdout}{result.stderr}"
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_every_metric_and_label_is_exported(
    queries: list[dashboard.Query], exported: dict[str, set[str]]
) -> None:
    all_labels = set().union(*exported.values())
    problems = []
    for query in queries:
        for name in sorted(metric_names(query.expr) - set(exported)):
            problems.append(f"{query.where}: {name} is exported by neither the agents nor the operator")
        for name, labels in matched_labels(query.expr).items():
            unknown = labels - exported.get(name, all_labels) - {"__name__"}
            if unknown:
                problems.append(f"{query.where}: {name} has no label {sorted(unknown)}")
        for label in sorted(grouping_labels(query.expr) - all_labels):
            problems.append(f"{query.where}: no exported series has the label {label}")
    assert not problems, "\n".join(problems)


def test_every_legend_names_a_label_its_query_keeps(
    model: dict[str, Any], exported: dict[str, set[str]]
) -> None:
    all_labels = set().union(*exported.values())
    for panel in dashboard.panels(model):
        for target in panel["targets"]:
            for label in _LEGEND.findall(target.get("legendFormat", "")):
                assert label in all_labels, f"{panel['title']} {target['refId']}: legend {{{{{label}}}}}"
                kept = grouping_labels(target["expr"])
                if re.match(r"\s*(max|min|sum|count|avg)\b", target["expr"]) and kept:
                    assert label in kept, f"{panel['title']} {target['refId']}: {label} is aggregated away"


def test_only_known_variables_are_used(model: dict[str, Any]) -> None:
    """Every $variable of a query is the dashboard's or Grafana's (substitute raises on any other)."""
    filled = dashboard.queries(dashboard.grafana_values("n", "c"), model)
    assert filled
    for query in filled:
        assert "$" not in query.expr, f"{query.where}: {query.expr}"


def test_every_member_panel_is_scoped_to_the_cluster(queries: list[dashboard.Query]) -> None:
    """A selector of a per-cluster series names the cluster and its namespace: nothing of another
    cluster leaks into a panel."""
    operator_wide = {
        "up",
        "pgherd_leader",
        "pgherd_api_requests_total",
        "pgherd_reconcile_duration_seconds_bucket",
        "pgherd_agent_call_duration_seconds_bucket",
        "pgherd_agent_call_duration_seconds_count",
    }
    for query in queries:
        for match in _SELECTOR.finditer(query.expr):
            name, matchers = match[1], match[2]
            if name in operator_wide:
                continue
            assert 'namespace="databases"' in matchers, f"{query.where}: {name} not scoped to the namespace"
            # The agent's process figures carry no cluster: they are joined to its members by target.
            if not name.startswith("pgherd_agent_process_"):
                assert 'cluster="shop"' in matchers, f"{query.where}: {name} not scoped to the cluster"
