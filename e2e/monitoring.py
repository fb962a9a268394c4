"""The e2e side of a real Prometheus (`python -m e2e.localkube up --prometheus`): its HTTP API, and the
chart's alert rules with their durations compressed, so that a scenario sees an alert fire in seconds.

Compression divides every duration of the rules by one factor: each rule's `for`, every range selector
(`[10m]`, `[26h:1h]`) and every number of seconds written as `N * 60`, `N * 3600` or `N * 86400` (the thresholds
on ages). Nothing else changes: the same expressions, on the same series, with the same labels. The
rules' real durations are proven by promtool's unit tests (charts/pgherd/monitoring/alerts_test.yaml)."""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from e2e.driver import DriverError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_RANGE = re.compile(r"\[(\d+)([smhd])(?::(\d+)([smhd]))?\]")  # a range, or a subquery's range:step
_SECONDS = re.compile(r"\b(\d+(?:\.\d+)?)\s*\*\s*(60|3600|86400)\b")
_DURATION = re.compile(r"^(\d+)([smhd])$")


def _seconds(value: float) -> str:
    return f"{max(1, round(value))}s"


def compress_expr(expr: str, factor: float) -> str:
    def scaled(m: re.Match[str]) -> str:
        window = _seconds(int(m[1]) * _UNITS[m[2]] / factor)
        return f"[{window}:{_seconds(int(m[3]) * _UNITS[m[4]] / factor)}]" if m[3] else f"[{window}]"

    expr = _RANGE.sub(scaled, expr)
    return _SECONDS.sub(lambda m: f"{float(m[1]) * int(m[2]) / factor:g}", expr)


def compress_rules(text: str, factor: float) -> str:
    """The rules file `text` with every duration divided by `factor`."""
    document = yaml.safe_load(text)
    for group in document["groups"]:
        for rule in group["rules"]:
            rule["expr"] = compress_expr(rule["expr"], factor)
            if "for" in rule:
                match = _DURATION.match(str(rule["for"]))
                if match is None:
                    raise ValueError(f"{rule.get('alert')}: for {rule['for']!r} is not N[smhd]")
                rule["for"] = _seconds(int(match[1]) * _UNITS[match[2]] / factor)
    return str(yaml.safe_dump(document, sort_keys=False, width=1000))


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise DriverError(f"Prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector `expr` evaluates to now (a PromQL error raises)."""
        data = self._get("/api/v1/query", query=expr)
        return list(data["result"]) if data["resultType"] == "vector" else [{"value": data["result"]}]

    def value(self, expr: str) -> float | None:
        """The single value of `expr`, or None when it has no series."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        data = self._get("/api/v1/query_range", query=expr, start=str(start), end=str(end), step=str(step))
        return list(data["result"])

    def label_values(self, label: str, match: str = "") -> list[str]:
        """The values `label` takes on the series `match` selects (all series when empty)."""
        params = {"match[]": match} if match else {}
        return [str(v) for v in self._get(f"/api/v1/label/{urllib.parse.quote(label)}/values", **params)]

    def targets(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/targets", state="active")["activeTargets"])

    def alerts(self, state: str = "firing") -> list[dict[str, Any]]:
        return [a for a in self._get("/api/v1/alerts")["alerts"] if a["state"] == state]

    def rule_groups(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/rules")["groups"])

    def reload(self) -> None:
        request = urllib.request.Request(f"{self.url}/-/reload", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            if response.status != 200:
                raise DriverError(f"Prometheus reload: HTTP {response.status}")

    def load_rules(self, path: Path, text: str) -> None:
        """Replace the rules file Prometheus evaluates and reload it."""
        path.write_text(text)
        self.reload()
