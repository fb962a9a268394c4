"""The summary as text, for a person on call: the phase and why first, then what runs, the members,
replication, archiving, backups, certificates, what is not True, and what happened lately.

The one renderer of a cluster's status: `kubectl pgherd status` and `pgherd sandbox status` print
with it. ``verbose`` adds every condition's reason, each member's replayed LSN, and more Events.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from pgherd.api.backup import human_size
from pgherd.engine.view import parse_time
from pgherd.plugin.explain import ago

JSON = dict[str, Any]
MARKS = {"done": "[x]", "current": "[>]", "todo": "[ ]"}


def _moment(value: Any, now: datetime) -> str:
    moment = parse_time(value)
    if moment is None:
        return "-" if value is None else str(value)
    return f"{value} ({ago(moment, now)})"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = []
    for row in [header, *rows]:
        lines.append(
            indent
            + "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    return lines


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if value is True:
        return "yes"
    if value is False:
        return "no"
    return str(value)


def render(summary: Mapping[str, Any], *, verbose: bool = False) -> str:
    now = parse_time(summary["readAt"])
    assert now is not None
    out: list[str] = []
    where = f" in namespace {summary['namespace']}" if summary.get("namespace") else ""
    out.append(f"PostgresCluster {summary['cluster']}{where}: {summary['phase']}")
    out += _why(summary, now)
    out += _overview(summary)
    out += _operation(summary.get("operation"), now)
    out += _members(summary["members"], verbose)
    out += _replication(summary["replication"])
    out += _archiving(summary["archiving"], now)
    out += _backups(summary["backups"], now)
    out += _restores(summary["restores"])
    if summary["certificates"] is not None or summary["platform"] != "sandbox":
        out += _certificates(summary["certificates"])
    out += _conditions(summary["conditions"], now)
    out += _events(summary["events"], now, verbose)
    if summary["notes"]:
        out.append("")
        out.append("Not shown:")
        out += [f"  {note}" for note in summary["notes"]]
    return "\n".join(out) + "\n"


def _why(summary: Mapping[str, Any], now: datetime) -> list[str]:
    why = summary["why"]
    out = []
    if why["reason"]:
        verb = "Waiting" if why["waiting"] else "Why"
        out.append(f"  {verb + ':':<9}{why['reason']}")
    out.append(f"  {'Means:':<9}{why['meaning']}")
    if why["since"]:
        out.append(f"  {'Since:':<9}{_moment(why['since'], now)}, {why['sinceWhat']}")
    for i, step in enumerate(why["next"]):
        out.append(f"  {'Next:' if i == 0 else '':<9}{step}")
    return out


def _overview(summary: Mapping[str, Any]) -> list[str]:
    instances = summary["instances"]
    version = summary["postgresVersion"]
    running, wanted = version.get("running"), version.get("wanted")
    pg = f"PostgreSQL {running or wanted or '?'}"
    if running and wanted and running != wanted:
        pg += f" (spec asks for {wanted})"
    primary = summary.get("primary") or "none"
    line = f"  Primary: {primary}"
    if summary.get("timeline") is not None:
        line += f" (timeline {summary['timeline']})"
    if summary.get("targetPrimary") and summary["targetPrimary"] != summary.get("primary"):
        line += f", becoming {summary['targetPrimary']}"
    line += (
        f"   Members: {instances['ready']}/{instances['members']} ready, {instances['wanted']} wanted   {pg}"
    )
    out = ["", line]
    if summary.get("image"):
        out.append(f"  Image: {summary['image']}")
    operator = summary.get("operator")
    if operator is not None:
        state = "ready" if operator["ready"] else "NOT READY"
        extra = f", {operator['version']}" if operator.get("version") else ""
        out.append(
            f"  Operator: {operator['name']} ({operator.get('image') or 'no image'}{extra}):"
            f" {operator['ready']}/{operator['wanted']} {state}"
        )
    elif summary.get("platform") == "kubernetes":
        out.append(
            "  Operator: none found (no Deployment labelled as the chart labels it): nothing acts on this cluster"
        )
    return out


def _operation(operation: Mapping[str, Any] | None, now: datetime) -> list[str]:
    if operation is None:
        return []
    out = ["", f"Operation: {operation['kind']}, started {_moment(operation['startedAt'], now)}"]
    if operation.get("reason"):
        out.append(f"  {operation['reason']}")
    for step in operation["steps"]:
        current = step["state"] == "current"
        since = (
            f" (since {_moment(operation['stepStartedAt'], now)})"
            if current and operation.get("stepStartedAt")
            else ""
        )
        out.append(f"  {MARKS.get(step['state'], '[?]')} {step['text']}{since}")
    return out


def _members(members: Sequence[Mapping[str, Any]], verbose: bool) -> list[str]:
    if not members:
        return ["", "Members: none yet"]
    header = ["MEMBER", "ROLE", "READY", "TL", "LSN", "LAG", "LAG TIME", "NODE", "RESTARTS", "VERSION"]
    if verbose:
        header.insert(5, "REPLAYED")
    rows = []
    for m in members:
        lag = m.get("lagBytes")
        lag_time = m.get("lagSeconds")
        row = [
            m["name"],
            m["role"],
            _cell(m["ready"])
            if m.get("reachable") or m["ready"]
            else "no" + (f" ({m['waiting']})" if m.get("waiting") else ""),
            _cell(m.get("timeline")),
            _cell(m.get("lsn")),
            "-" if lag is None else f"{lag} B",
            "-" if lag_time is None else f"{lag_time} s",
            _cell(m.get("node")),
            _cell(m.get("restarts")),
            _cell(m.get("version")),
        ]
        if verbose:
            row.insert(5, _cell(m.get("replayedLsn")))
        rows.append(row)
    return ["", "Members:", *_table(header, rows)]


def _replication(replication: Mapping[str, Any]) -> list[str]:
    out = ["", f"Replication: {replication['mode']}"]
    if replication.get("quorumCommit"):
        out[-1] += f" ({replication['quorumCommit']})"
    if replication["voters"]:
        health = replication.get("quorumMessage") or ""
        out.append(
            f"  Quorum: {', '.join(replication['voters'])}: {replication['needed']} needed"
            # The engine's "N of M" (then any note, "; synchronous standbys changing"): reachable ones.
            + (
                "; " + re.sub(r"^(\d+ of \d+)", r"\1 reachable", health)
                if health and replication.get("quorumHealthy") == "True"
                else ""
            )
        )
        if replication.get("quorumHealthy") == "False":
            out.append(f"  Quorum LOST: {health}")
    if replication.get("synchronousStandbyNames") is not None:
        out.append(f"  synchronous_standby_names: {replication['synchronousStandbyNames']}")
    if replication.get("pending"):
        out.append(f"  changing to: {replication['pending']} (asked, not yet seen on the primary)")
    return out


def _archiving(archiving: Mapping[str, Any], now: datetime) -> list[str]:
    reported = archiving.get("state")  # the condition's reason: Archiving, ArchiveFailing, Disabled
    if not archiving["enabled"] or reported == "Disabled":
        return ["", "Continuous archiving: off (no backup store, or backup.walArchiving false)"]
    state = "failing" if archiving.get("healthy") == "False" else "on"
    out = [
        "",
        f"Continuous archiving: {state}" + (f" ({archiving['message']})" if archiving.get("message") else ""),
    ]
    if not archiving["known"]:
        out.append(
            "  last archived segment, failures, segments waiting: unknown (not in the cluster's status)"
        )
        return out
    out.append(
        f"  last archived: {_cell(archiving.get('lastArchivedWal'))} at {_moment(archiving.get('lastArchivedAt'), now)}"
    )
    failed = archiving.get("failedCount")
    if failed:
        out.append(
            f"  failures: {failed}, last {_cell(archiving.get('lastFailedWal'))} at"
            f" {_moment(archiving.get('lastFailedAt'), now)}"
        )
    else:
        out.append("  failures: none")
    out.append(f"  segments waiting: {_cell(archiving.get('waiting'))}")
    return out


def _backups(backups: Mapping[str, Any], now: datetime) -> list[str]:
    if not backups["store"] and not backups["count"]:
        return ["", "Backups: no backup store (spec.backup.store)"]
    out = ["", f"Backups: {backups['count']} ({backups['store'] or 'no store'})"]
    last = backups.get("lastCompleted")
    if last:
        verified = (
            {True: ", verified", False: ", NOT verified"}.get(bool(last["verified"]), "")
            if last.get("verified") is not None
            else ""
        )
        out.append(
            f"  last Completed: {last['name']} at {_moment(last['completedAt'], now)}, {_cell(last.get('size'))}"
            f" ({_cell(last.get('storedSize'))} stored){verified}"
        )
    else:
        out.append("  last Completed: none")
    failed = backups.get("lastFailed")
    if failed:
        out.append(f"  last Failed: {failed['name']}: {failed.get('error') or 'no reason recorded'}")
    for running in backups["inProgress"]:
        out.append(
            f"  {running['phase']}: {running['name']} (since {_moment(running.get('startedAt') or running.get('createdAt'), now)})"
        )
    if backups.get("schedule"):
        due = backups.get("nextScheduled")
        out.append(f"  next scheduled ({backups['schedule']}): {_moment(due, now) if due else 'unknown'}")
    if backups.get("firstRecoverabilityPoint"):
        out.append(
            f"  first recoverability point: {_moment(backups['firstRecoverabilityPoint'], now)}"
            f" (from {backups['firstRecoverabilityFrom']})"
        )
    if backups.get("expired"):
        out.append(f"  expired by retention: {backups['expired']}")
    return out


def _restores(restores: Sequence[Mapping[str, Any]]) -> list[str]:
    if not restores:
        return []
    out = ["", "Restores:"]
    for r in restores[-5:]:
        progress = ""
        if r.get("bytesTotal"):
            progress = (
                f", {100 * int(r.get('bytesDone') or 0) // int(r['bytesTotal'])}%"
                f" of {human_size(int(r['bytesTotal']))}"
            )
        error = f": {r['error']}" if r.get("error") else ""
        out.append(f"  {r['name']}: {r['phase']} (from {r.get('from')}{progress}){error}")
    return out


def _certificates(certificates: Sequence[Mapping[str, Any]] | None) -> list[str]:
    if certificates is None:
        return ["", "Certificates: unknown (see below)"]
    if not certificates:
        return ["", "Certificates: none found"]
    out = ["", "Certificates:"]
    for c in certificates:
        state = {
            "expired": "EXPIRED {left} ago",
            "expiring": "EXPIRES in {left}",
            "ok": "expires in {left}",
        }.get(c["state"], "expiry unknown")
        subject = f", {c['subject']}" if c["subject"] else ""
        out.append(f"  {c['name']}: {state.format(left=c['left'])} ({c['notAfter'] or '-'}){subject}")
    return out


def _conditions(conditions: Sequence[Mapping[str, Any]], now: datetime) -> list[str]:
    if not conditions:
        return ["", "Conditions: all True"]
    out = ["", "Conditions not True:"]
    for c in conditions:
        out.append(
            f"  {c['type']} {c['status']} ({c['reason']}{', since ' + _moment(c['since'], now) if c.get('since') else ''}): {c['message']}"
        )
    return out


def _events(events: Sequence[Mapping[str, Any]], now: datetime, verbose: bool) -> list[str]:
    if not events:
        return []
    shown = events if verbose else events[-5:]
    out = ["", f"Events (last {len(shown)}):"]
    for e in shown:
        count = f" x{e['count']}" if e.get("count", 1) > 1 else ""
        moment = parse_time(e.get("time"))
        age = ago(moment, now) if moment is not None else "-"
        out.append(f"  {age:>10}  {e['type']:<7} {e['reason']}{count}: {e['message']}")
    return out
