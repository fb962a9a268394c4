"""Users' own metric queries (`--custom-queries FILE`, from spec.monitoring.customQueries' ConfigMap).

The file is a YAML list of queries:

    - name: orders_waiting            # [a-z_][a-z0-9_]*
      help: Orders not shipped yet, by warehouse.
      query: SELECT warehouse, count(*) AS orders FROM shop.orders WHERE shipped_at IS NULL GROUP BY 1
      metrics:
        - {column: warehouse, usage: label}
        - {column: orders, usage: gauge}      # gauge | counter | label

exported as `pgherd_custom_<name>_<column>` (a counter gets `_total`). Each query runs in the
`postgres` database as pgherd_monitor, in a READ ONLY transaction that is rolled back (its SETs go with
it), through a cursor (one SELECT; DECLARE refuses anything else) with a statement_timeout. A query that
fails is counted and its metrics left out: the others and the agent's own metrics are served all the same.
The file is read again when it changes (a ConfigMap's update); an entry that does not validate is
refused alone (logged, and counted in the `refused` figure).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal, cast

import psycopg
import yaml

log = logging.getLogger("pgherd.agent")

NAME = re.compile(r"[a-z_][a-z0-9_]*\Z")
PREFIX = "pgherd_custom_"
USAGES = ("gauge", "counter", "label")
QUERY_KEYS = frozenset({"name", "query", "help", "metrics"})
COLUMN_KEYS = frozenset({"column", "usage"})
RESERVED_LABELS = frozenset({"cluster", "member"})  # the agent's own labels on every metric
# The agent's own metrics about these queries (metrics.py), as exposed without a counter's _total.
RESERVED_METRICS = frozenset(
    f"{PREFIX}{name}" for name in ("query_errors", "queries_loaded", "queries_refused")
)
TIMEOUT = 2.0  # seconds, each query's statement_timeout
MAX_ROWS = 1000  # more is a cardinality accident, not a metric: the query fails
CURSOR = "pgherd_custom_query"

Usage = Literal["gauge", "counter", "label"]


@dataclass(frozen=True)
class Column:
    column: str
    usage: Usage

    @property
    def metric(self) -> bool:
        return self.usage != "label"


@dataclass(frozen=True)
class CustomQuery:
    name: str
    query: str
    help: str
    metrics: tuple[Column, ...]

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(c.column for c in self.metrics if not c.metric)

    @property
    def values(self) -> tuple[Column, ...]:
        return tuple(c for c in self.metrics if c.metric)

    def metric_name(self, column: Column) -> str:
        return f"{PREFIX}{self.name}_{column.column}"


@dataclass(frozen=True)
class Result:
    """One run of a query: a row per sample, its label values and its values (None: NULL, left out)."""

    query: CustomQuery
    rows: tuple[tuple[tuple[str, ...], tuple[float | None, ...]], ...]


class QueryError(Exception):
    pass


def parse(text: str, source: str) -> tuple[tuple[CustomQuery, ...], list[str]]:
    """The valid queries of a file, and a problem (a sentence naming the entry) per entry refused; a
    file that is not a YAML list is one problem and no query."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return (), [f"{source}: not YAML ({str(exc).splitlines()[0]})"]
    if document is None:
        return (), []
    if not isinstance(document, list):
        return (), [
            f"{source}: expected a list of queries ({{name, query, help, metrics}}), got a {_kind(document)}"
        ]
    queries: list[CustomQuery] = []
    metric_names: set[str] = set()
    problems: list[str] = []
    for index, entry in enumerate(document, start=1):
        where = f"{source}: query #{index}"
        if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
            where += f" ({entry['name']})"
        try:
            query = _query(entry)
        except QueryError as exc:
            problems.append(f"{where}: {exc}")
            continue
        names = {_exposed(query.metric_name(c)) for c in query.values}
        if any(q.name == query.name for q in queries):
            problems.append(f"{where}: another query has the name {query.name!r}")
        elif names & RESERVED_METRICS:
            problems.append(
                f"{where}: {', '.join(sorted(names & RESERVED_METRICS))} is the agent's own metric"
            )
        elif names & metric_names:
            problems.append(
                f"{where}: {', '.join(sorted(names & metric_names))} (with or without _total) already made"
                " by another query"
            )
        else:
            queries.append(query)
            metric_names |= names
    return tuple(queries), problems


def _exposed(name: str) -> str:
    """A metric's name as two families could clash on: a counter is exposed with _total."""
    return name.removesuffix("_total")


_KINDS: dict[type, str] = {dict: "mapping", list: "list", str: "string"}


def _kind(value: object) -> str:
    return _KINDS.get(type(value), type(value).__name__)


def _name(value: object, what: str) -> str:
    if not isinstance(value, str) or not NAME.match(value) or value.startswith("__"):
        raise QueryError(
            f"{what} {value!r} is not a metric name: lowercase letters, digits and '_', not starting"
            " with a digit nor '__'"
        )
    return value


def _query(entry: object) -> CustomQuery:
    if not isinstance(entry, Mapping):
        raise QueryError(f"expected a mapping {{name, query, help, metrics}}, got a {_kind(entry)}")
    unknown = set(entry) - QUERY_KEYS
    if unknown:
        raise QueryError(
            f"unknown key(s) {', '.join(sorted(map(str, unknown)))} (expected {', '.join(sorted(QUERY_KEYS))})"
        )
    name = _name(entry.get("name"), "name")
    query = entry.get("query")
    if not isinstance(query, str) or not query.strip():
        raise QueryError("query: a SELECT is required")
    help_text = entry.get("help", "")
    if not isinstance(help_text, str):
        raise QueryError("help: expected a string")
    metrics = entry.get("metrics")
    if not isinstance(metrics, Sequence) or isinstance(metrics, str) or not metrics:
        raise QueryError("metrics: expected a list of {column, usage}")
    columns: list[Column] = []
    for item in metrics:
        if not isinstance(item, Mapping) or set(item) - COLUMN_KEYS:
            raise QueryError(f"metrics: each item is {{column, usage}}, got {item!r}")
        column = _name(item.get("column"), "column")
        usage = item.get("usage")
        if usage not in USAGES:
            raise QueryError(f"column {column}: usage {usage!r}, expected one of {', '.join(USAGES)}")
        if any(c.column == column for c in columns):
            raise QueryError(f"column {column} is listed twice")
        if usage == "label" and column in RESERVED_LABELS:
            raise QueryError(
                f"column {column}: the agent sets the label {column!r} itself; rename the column"
            )
        columns.append(Column(column, cast(Usage, usage)))
    if not any(c.metric for c in columns):
        raise QueryError("metrics: no column is a gauge or a counter")
    return CustomQuery(name, query.strip().rstrip(";").strip(), help_text.strip(), tuple(columns))


class CustomQueries:
    """The file's queries, read again whenever it changes (its inode, size or time: a ConfigMap swaps a
    symbolic link). Used by one thread at a time (the metrics' refresh)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.queries: tuple[CustomQuery, ...] = ()
        self.refused = 0  # entries refused at the last reading (the whole file: 1)
        self._signature: tuple[int, int, int] | None = None
        self._read_once = False

    def load(self) -> tuple[CustomQuery, ...]:
        """The queries in force: the file's, read again if it changed since."""
        try:
            stat = os.stat(self.path)
        except OSError as exc:
            if self._signature is not None or not self._read_once:
                log.warning(
                    "custom queries: cannot read %s (%s): none run until it exists (is the ConfigMap "
                    "of spec.monitoring.customQueries there, with that key?)",
                    self.path,
                    exc.strerror,
                )
            self._signature, self._read_once = None, True
            self.queries, self.refused = (), 1
            return self.queries
        signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if signature == self._signature:
            return self.queries
        self._signature, self._read_once = signature, True
        queries: tuple[CustomQuery, ...] = ()
        try:
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            problems = [f"{self.path}: cannot read it ({exc})"]
        else:
            queries, problems = parse(text, str(self.path))
        for problem in problems:
            log.warning("custom queries: %s: refused", problem)
        log.info(
            "custom queries: %d in force from %s%s",
            len(queries),
            self.path,
            f", {len(problems)} refused" if problems else "",
        )
        self.queries, self.refused = queries, len(problems)
        return queries


def run(conn: psycopg.Connection[Any], query: CustomQuery, timeout: float = TIMEOUT) -> Result:
    """One query on `conn` (autocommit): READ ONLY, rolled back, bounded in time and rows."""
    with conn.transaction(force_rollback=True):
        conn.execute("SET TRANSACTION READ ONLY")
        milliseconds = max(1, int(timeout * 1000))  # 0 would be no timeout at all
        conn.execute("SELECT set_config('statement_timeout', %s, true)", (str(milliseconds),))
        with conn.cursor(name=CURSOR) as cursor:
            cursor.execute(query.query)  # DECLARE: one SELECT, or an error
            rows = cursor.fetchmany(MAX_ROWS + 1)
            columns = [d.name for d in cursor.description or ()]
    if len(rows) > MAX_ROWS:
        raise QueryError(f"more than {MAX_ROWS} rows")
    missing = [c.column for c in query.metrics if c.column not in columns]
    if missing:
        raise QueryError(f"no column {', '.join(missing)} in its result ({', '.join(columns)})")
    position = {name: columns.index(name) for name in (c.column for c in query.metrics)}
    out = []
    seen: set[tuple[str, ...]] = set()
    for row in rows:
        labels = tuple("" if row[position[n]] is None else str(row[position[n]]) for n in query.labels)
        if labels in seen:  # two samples of one series: Prometheus would drop them
            raise QueryError(f"two rows with the same labels {dict(zip(query.labels, labels, strict=True))}")
        seen.add(labels)
        values = tuple(_number(row[position[c.column]], c.column) for c in query.values)
        out.append((labels, values))
    return Result(query, tuple(out))


def _number(value: object, column: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool | int | float | Decimal):
        return float(value)
    raise QueryError(f"column {column}: {type(value).__name__} is not a number (cast it, or make it a label)")
