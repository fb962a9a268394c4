"""The chart's alert rules (charts/pgherd/monitoring/alerts.yaml), checked and unit-tested by a real
promtool built from Prometheus' Go module (scripts/ensure-prometheus.sh, run by `make setup-kube`), and
held to what an on-call reader needs: a severity, a summary and a description, and a runbook_url whose
anchor is a section of docs/alerts.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "charts" / "pgherd" / "monitoring"
ALERTS = MONITORING / "alerts.yaml"
ALERTS_TEST = MONITORING / "alerts_test.yaml"
ALERTS_DOC = REPO / "docs" / "alerts.md"
RUNBOOK_PREFIX = "https://github.com/pgherd/pgherd/blob/main/docs/alerts.md#"
# The names dashboards, silences and the e2e checks rely on.
CONTRACT_ALERTS = {
    "PgherdNoPrimary",
    "PgherdQuorumLost",
    "PgherdMemberDown",
    "PgherdReplicationLagHigh",
    "PgherdWALArchivingFailing",
    "PgherdBackupFailed",
    "PgherdNoRecentBackup",
    "PgherdVolumeFillingUp",
    "PgherdConnectionsNearLimit",
    "PgherdXIDWraparound",
    "PgherdCertificateExpiresSoon",
    "PgherdOperatorDown",
}
SEVERITIES = {"critical", "warning"}


def run_promtool(promtool: Path, *args: str) -> None:
    result = subprocess.run(
        [str(promtool), *args], cwd=MONITORING, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, (
        f"promtool {' '.join(args)} failed (exit {result.returncode}):\n{result.stdout}{result.stderr}"
    )


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def doc_anchors() -> set[str]:
    headings = re.findall(r"^#+ (.+)$", ALERTS_DOC.read_text(), flags=re.MULTILINE)
    return {github_anchor(heading) for heading in headings}


def test_rules_pass_promtool_check(promtool: Path) -> None:
    run_promtool(promtool, "check", "rules", ALERTS.name)


def test_rules_pass_their_unit_tests(promtool: Path) -> None:
    run_promtool(promtool, "test", "rules", ALERTS_TEST.name)


def test_every_contract_alert_is_defined() -> None:
    missing = CONTRACT_ALERTS - {rule["alert"] for rule in alert_rules()}
    assert not missing, f"alerts.yaml lacks {sorted(missing)}"


def test_every_alert_has_severity_summary_description_and_runbook() -> None:
    anchors = doc_anchors()
    problems = []
    for rule in alert_rules():
        name, labels, annotations = rule["alert"], rule.get("labels", {}), rule.get("annotations", {})
        if labels.get("severity") not in SEVERITIES:
            problems.append(f"{name}: severity {labels.get('severity')!r}, not one of {sorted(SEVERITIES)}")
        for key in ("summary", "description"):
            if not str(annotations.get(key, "")).strip():
                problems.append(f"{name}: no {key} annotation")
        if "$labels.namespace" not in annotations.get("description", ""):
            problems.append(f"{name}: the description does not name the namespace")
        runbook = annotations.get("runbook_url", "")
        if not runbook.startswith(RUNBOOK_PREFIX):
            problems.append(f"{name}: runbook_url {runbook!r} does not start with {RUNBOOK_PREFIX}")
        elif runbook.removeprefix(RUNBOOK_PREFIX) != name.lower():
            problems.append(f"{name}: runbook_url anchor is not #{name.lower()}")
        elif name.lower() not in anchors:
            problems.append(f"{name}: docs/alerts.md has no heading '## {name}' (anchor #{name.lower()})")
    assert not problems, "\n".join(problems)


def test_every_runbook_section_is_an_alert() -> None:
    """No section left behind for an alert that was renamed or removed."""
    names = {rule["alert"] for rule in alert_rules()}
    sections = set(re.findall(r"^## (Pgherd\w+)\s*$", ALERTS_DOC.read_text(), flags=re.MULTILINE))
    assert sections == names, f"sections without alert: {sorted(sections - names)}"


def test_every_alert_is_unit_tested_firing_and_quiet() -> None:
    """alerts_test.yaml makes every alert fire and, at another time or on other series, stay quiet."""
    fires: set[str] = set()
    quiet: set[str] = set()
    for test in yaml.safe_load(ALERTS_TEST.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {rule["alert"] for rule in alert_rules()}
    assert names - fires == set(), f"never made to fire: {sorted(names - fires)}"
    assert names - quiet == set(), f"never checked quiet: {sorted(names - quiet)}"
