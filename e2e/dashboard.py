"""The chart's Grafana dashboard (charts/pgherd/monitoring/dashboard.json) as PromQL, and its check on a real
Prometheus: every query of its panels, of its annotations and of its template variables, with Grafana's
variables filled in as Grafana would fill them for one cluster.

`check_dashboard(url, namespace, cluster)` runs each panel query through /api/v1/query and lists what is
wrong: an error, or no data. The annotations' queries must run without error (they mark promotions, and
a healthy cluster has none to mark); the variables' `label_values` must offer the cluster's namespace
and name. A query answers with data only once what it reads exists, so a cluster checked this way has:
three members (a standby's lag as the primary sees it), WAL archived at least once, a Completed Backup
(the backup panels), the operator scraped (its job `pgherd-operator` or `<namespace>/pgherd-operator`),
and two scrapes of every target inside `rate_interval` (rates and increases)."""

from __future__ import annotations

import json
import re
import urllib.error
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.driver import DriverError
from e2e.monitoring import Prometheus

DASHBOARD = Path(__file__).resolve().parents[1] / "charts" / "pgherd" / "monitoring" / "dashboard.json"
DATASOURCE = "${datasource}"  # every panel's and query's datasource uid: the dashboard's variable

_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_LABEL_VALUES = re.compile(
    r"^\s*label_values\(\s*(?:(?P<selector>.+?)\s*,\s*)?(?P<label>\w+)\s*\)\s*$", re.DOTALL
)
_DURATION = re.compile(r"^(\d+)([smhd])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class Query:
    """One PromQL expression of the dashboard; `where` names it for a person (panel, query letter)."""

    where: str
    expr: str
    needs_data: bool = True


@dataclass(frozen=True)
class VariableQuery:
    """A template variable's `label_values(selector, label)`, its variables filled in."""

    name: str
    selector: str
    label: str


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel but the rows, those a collapsed row holds included."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def rows(dashboard: Mapping[str, Any]) -> list[str]:
    return [panel["title"] for panel in dashboard.get("panels", []) if panel.get("type") == "row"]


def substitute(text: str, values: Mapping[str, str]) -> str:
    """`text` with `$name`, `${name}` and `${name:format}` replaced by their values; an unknown variable
    raises KeyError (the dashboard would use a variable nobody defines)."""

    def value(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        if name not in values:
            raise KeyError(
                f"${name} is not a variable of the dashboard nor one of Grafana's ({sorted(values)})"
            )
        return values[name]

    return _VARIABLE.sub(value, text)


def grafana_values(
    namespace: str,
    cluster: str,
    *,
    rate_interval: str = "1m",
    interval: str = "15s",
    time_range: str = "1h",
) -> dict[str, str]:
    """What Grafana puts in the variables the dashboard uses, for one cluster and time range."""
    match = _DURATION.match(time_range)
    if match is None:
        raise ValueError(f"time_range {time_range!r} is not N[smhd]")
    range_seconds = int(match[1]) * _SECONDS[match[2]]
    return {
        "datasource": DATASOURCE,
        "namespace": namespace,
        "cluster": cluster,
        "__rate_interval": rate_interval,
        "__interval": interval,
        "__range": time_range,
        "__range_s": str(range_seconds),
    }


def queries(values: Mapping[str, str], dashboard: Mapping[str, Any] | None = None) -> list[Query]:
    """Every panel's and annotation's expression, variables filled in from `values` (grafana_values)."""
    dashboard = load() if dashboard is None else dashboard
    out = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            if "expr" in target:
                where = f"panel {panel.get('id')} {panel.get('title')!r} query {target.get('refId')}"
                out.append(Query(where, substitute(target["expr"], values)))
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if "expr" in annotation:
            where = f"annotation {annotation.get('name')!r}"
            out.append(Query(where, substitute(annotation["expr"], values), needs_data=False))
    return out


def variable_queries(
    values: Mapping[str, str], dashboard: Mapping[str, Any] | None = None
) -> list[VariableQuery]:
    """The `label_values(...)` of the query variables, variables filled in from `values` (grafana_values)."""
    dashboard = load() if dashboard is None else dashboard
    out = []
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        match = _LABEL_VALUES.match(text)
        if match is None:
            raise ValueError(
                f"variable {variable.get('name')}: {text!r} is not label_values(selector, label)"
            )
        selector = substitute(match["selector"] or "", values)
        out.append(VariableQuery(str(variable["name"]), selector, match["label"]))
    return out


def _error(exc: Exception) -> str:
    """Prometheus' own words for a refused query (HTTP 400 with a JSON body), else the exception."""
    if isinstance(exc, urllib.error.HTTPError):
        try:
            body = json.loads(exc.read())
            return f"{body.get('errorType')}: {body.get('error')}"
        except (ValueError, OSError):
            pass
    return f"{type(exc).__name__}: {exc}"


def check_dashboard(
    url: str,
    namespace: str,
    cluster: str,
    *,
    rate_interval: str = "1m",
    interval: str = "15s",
    time_range: str = "1h",
) -> list[str]:
    """What is wrong with the dashboard on the Prometheus at `url` for one cluster: each panel query that
    fails or has no data, each annotation query that fails, each variable that does not offer the
    cluster. Empty: every panel shows data. `rate_interval` stands for Grafana's $__rate_interval: at
    least twice the scrape interval."""
    prometheus = Prometheus(url)
    values = grafana_values(
        namespace, cluster, rate_interval=rate_interval, interval=interval, time_range=time_range
    )
    wanted = {"namespace": namespace, "cluster": cluster}
    problems = []
    for variable in variable_queries(values):
        try:
            offered = prometheus.label_values(variable.label, variable.selector)
        except (DriverError, OSError) as exc:
            problems.append(
                f"variable {variable.name}: {_error(exc)}\n  label_values({variable.selector}, {variable.label})"
            )
            continue
        if variable.name in wanted and wanted[variable.name] not in offered:
            problems.append(
                f"variable {variable.name}: {wanted[variable.name]!r} is not offered (only {offered})\n"
                f"  label_values({variable.selector}, {variable.label})"
            )
    for query in queries(values):
        try:
            result = prometheus.query(query.expr)
        except (DriverError, OSError) as exc:
            problems.append(f"{query.where}: {_error(exc)}\n  {query.expr}")
            continue
        if query.needs_data and not result:
            problems.append(f"{query.where}: no data\n  {query.expr}")
    return problems
