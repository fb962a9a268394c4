"""The commands that ask the operator for something, and how `--wait` follows each to its end:
switchover, restart (rolling, or one member), pause, resume, upgrade confirm and rollback, backup and
restore."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, TextIO

from pgherd.api.annotations import RESTART
from pgherd.api.backup import human_size
from pgherd.engine.status import OperationKind
from pgherd.kube import names
from pgherd.plugin import manifests, requests
from pgherd.plugin.document import now_text
from pgherd.plugin.errors import PluginError
from pgherd.plugin.explain import engine_status
from pgherd.plugin.follow import Progress, follow
from pgherd.plugin.gather import cluster_events, member_selector
from pgherd.plugin.kube import Kube, NotFound
from pgherd.plugin.version import require_operator

JSON = dict[str, Any]


def _said(out: TextIO, text: str) -> None:
    print(text, file=out, flush=True)


def _state(cluster: Mapping[str, Any]) -> str:
    status = cluster.get("status") or {}
    phase = status.get("phase") or "Pending"
    message = status.get("message")
    return f"{phase}: {message}" if message else str(phase)


# -- switchover ---------------------------------------------------------------------------------------------


def switchover(
    kube: Kube, name: str, to: str | None, *, wait: bool, timeout: float, out: TextIO = sys.stdout
) -> None:
    cluster = kube.cluster(name)
    request = requests.switchover(cluster, to)
    require_operator(kube)
    old = (cluster.get("status") or {}).get("currentPrimary")
    asked_at = now_text()
    kube.patch_cluster(name, request.patch)
    _said(out, f"asked: {request.said}")
    if not wait:
        return

    def progress() -> Progress:
        now = kube.cluster(name)
        status = now.get("status") or {}
        pending = ((now.get("metadata") or {}).get("annotations") or {}).get(names.ANNOTATION_SWITCHOVER)
        primary = status.get("currentPrimary")
        if pending:
            return Progress(_state(now))
        if primary != old and (to is None or primary == to):
            return Progress(f"switched over: {primary} is the primary ({_state(now)})", done=True)
        said = [
            e["message"]
            for e in cluster_events(kube, name)
            if e["reason"] == "Switchover" and (e["time"] or "")[:19] >= asked_at[:19]
        ]
        why = said[-1] if said else f"the switchover did not happen: {_state(now)}"
        return Progress(why, done=True, failed=why)

    follow(progress, timeout=timeout, out=out, what=f"the switchover of {name}")


# -- restart -----------------------------------------------------------------------------------------------


def _template_revision(kube: Kube, name: str) -> str | None:
    sts = kube.statefulset(names.statefulset(name))
    labels = (((sts.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}
    value = labels.get(names.LABEL_REVISION)
    return None if value is None else str(value)


def restart(
    kube: Kube, name: str, member: str | None, *, wait: bool, timeout: float, out: TextIO = sys.stdout
) -> None:
    cluster = kube.cluster(name)
    if member is not None:
        _restart_member(kube, cluster, member, wait=wait, timeout=timeout, out=out)
        return
    request = requests.rolling_restart(cluster, datetime.now(UTC))
    require_operator(kube)
    before = _template_revision(kube, name) if wait else None
    kube.patch_cluster(name, request.patch)
    _said(out, f"asked: {request.said}")
    if not wait:
        return
    asked = request.patch["metadata"]["annotations"][RESTART]

    def progress() -> Progress:
        now = kube.cluster(name)
        status = now.get("status") or {}
        template = _template_revision(kube, name)
        engine = engine_status(status)
        aborted = engine.aborted if engine is not None else None
        if template == before:
            return Progress(f"waiting for the operator to take the request ({_state(now)})")
        if aborted is not None and aborted.kind is OperationKind.ROLLOUT and aborted.revision == template:
            why = f"the rolling restart was aborted: {aborted.failed}"
            return Progress(why, done=True, failed=why)
        pods = kube.pods(member_selector(name))
        restarted = [
            p for p in pods if (p["metadata"].get("labels") or {}).get(names.LABEL_REVISION) == template
        ]
        line = f"{len(restarted)}/{len(pods)} members restarted; {_state(now)}"
        operation = engine.operation if engine is not None else None
        if len(restarted) == len(pods) and operation is None and status.get("phase") == "Running":
            return Progress(f"restarted ({RESTART}={asked}): {line}", done=True)
        return Progress(line)

    follow(progress, timeout=timeout, out=out, what=f"the rolling restart of {name}")


def _restart_member(
    kube: Kube, cluster: Mapping[str, Any], member: str, *, wait: bool, timeout: float, out: TextIO
) -> None:
    name = str(cluster["metadata"]["name"])
    pod = requests.member_restart(cluster, member)
    require_operator(kube)
    uid = kube.pod(pod)["metadata"].get("uid")
    primary = (cluster.get("status") or {}).get("currentPrimary") == member
    kube.delete_pod(pod)
    note = ": its agent waits for the engine to switch over first" if primary else ""
    _said(out, f"asked: restart of {member} (its pod deleted; the StatefulSet makes it again){note}")
    if not wait:
        return

    def progress() -> Progress:
        now = kube.cluster(name)
        try:
            current = kube.pod(pod)
        except NotFound:
            return Progress(f"{pod} being made again; {_state(now)}")
        member_status = next(
            (m for m in requests.members_of(now.get("status") or {}) if m.get("name") == member), {}
        )
        fresh = current["metadata"].get("uid") != uid
        if fresh and member_status.get("ready") and (now.get("status") or {}).get("phase") == "Running":
            return Progress(f"{member} restarted and ready; {_state(now)}", done=True)
        return Progress(f"{member} {'starting' if fresh else 'stopping'}; {_state(now)}")

    follow(progress, timeout=timeout, out=out, what=f"the restart of {member}")


# -- pause, resume, upgrades -------------------------------------------------------------------------------


def pause(kube: Kube, name: str, paused: bool, out: TextIO = sys.stdout) -> None:
    request = requests.pause(kube.cluster(name), paused)
    if request is None:
        _said(out, f"{name} is already {'paused' if paused else 'not paused'}: nothing changed")
        return
    kube.patch_cluster(name, request.patch)
    _said(out, request.said)


def upgrade(kube: Kube, name: str, action: str, out: TextIO = sys.stdout) -> None:
    cluster = kube.cluster(name)
    request = requests.upgrade_confirm(cluster) if action == "confirm" else requests.upgrade_rollback(cluster)
    require_operator(kube)
    kube.patch_cluster(name, request.patch)
    _said(out, f"asked: {request.said}")


# -- backup and restore ------------------------------------------------------------------------------------


def _backup_progress(kube: Kube, name: str) -> Progress:
    backup = kube.get_custom(names.PLURAL_BACKUPS, name)
    status = backup.get("status") or {}
    phase = status.get("phase") or "Pending"
    if phase == "Pending":
        return Progress(
            "Pending: waiting for the operator to start its snapshot Job (it needs a healthy primary)"
        )
    if phase == "Running":
        source = status.get("sourceMember")
        return Progress(f"Running: snapshot Job streaming from {source or 'a member'} to the store")
    if phase == "Failed":
        why = f"Backup {name} Failed: {status.get('error') or status.get('message') or 'no reason recorded'}"
        return Progress(why, done=True, failed=why)
    verified = (
        {True: ", verified", False: ", NOT verified"}.get(bool(status["verified"]), "")
        if status.get("verified") is not None
        else ""
    )
    return Progress(
        f"{phase}: snapshot {status.get('backupId')}, {status.get('size')} ({status.get('storedSize')} stored),"
        f" WAL {status.get('startLSN')} to {status.get('endLSN')} on timeline {status.get('timeline')}{verified}",
        done=True,
    )


def backup(
    kube: Kube,
    name: str,
    backup_name: str | None,
    target: str | None,
    *,
    wait: bool,
    timeout: float,
    out: TextIO = sys.stdout,
) -> None:
    cluster = kube.cluster(name)
    chosen = backup_name or manifests.backup_name(name, datetime.now(UTC))
    body = manifests.backup(cluster, chosen, target)
    require_operator(kube)
    kube.create_custom(names.PLURAL_BACKUPS, body)
    _said(out, f"Backup {chosen} of {name} created")
    if wait:
        follow(lambda: _backup_progress(kube, chosen), timeout=timeout, out=out, what=f"Backup {chosen}")


def _restore_progress(kube: Kube, cluster: str, name: str) -> Progress:
    restore = kube.get_custom(names.PLURAL_RESTORES, name)
    status = restore.get("status") or {}
    phase = status.get("phase") or "Pending"
    if phase == "Failed":
        why = f"Restore {name} Failed: {status.get('error') or 'no reason recorded'}"
        return Progress(why, done=True, failed=why)
    if phase == "Completed":
        kept = status.get("keptData")
        aside = f"; the members' old data kept aside: {', '.join(kept)}" if kept else ""
        return Progress(
            f"Completed: {cluster} restored on timeline {status.get('restoredTimeline')}{aside}", done=True
        )
    progress = status.get("progress") or {}
    done, total = progress.get("bytesDone"), progress.get("bytesTotal")
    # Bytes count while the snapshot is fetched; replaying and rebuilding have no such measure.
    amount = (
        f" ({100 * int(done or 0) // int(total)}% of {human_size(int(total))})"
        if total and phase == "Restoring"
        else ""
    )
    return Progress(f"{phase}{amount}; the cluster: {_state(kube.cluster(cluster))}")


def restore(
    kube: Kube,
    name: str,
    *,
    backup_name: str | None,
    snapshot: str | None,
    time: str | None,
    lsn: str | None,
    wait: bool,
    timeout: float,
    yes: bool = False,
    out: TextIO = sys.stdout,
) -> None:
    cluster = kube.cluster(name)
    backup = None
    if backup_name is not None:
        try:
            backup = kube.get_custom(names.PLURAL_BACKUPS, backup_name)
        except NotFound:
            backup = None
    restore_name = f"{name}-restore-{datetime.now(UTC):%Y%m%d%H%M%S}"
    body = manifests.restore(
        cluster, restore_name, backup=backup, backup_name=backup_name, snapshot=snapshot, time=time, lsn=lsn
    )
    require_operator(kube)
    check_confirmed(
        yes, f"restore {name} in place from {backup_name or snapshot}? Its writes stop until it is rebuilt"
    )
    kube.create_custom(names.PLURAL_RESTORES, body)
    target = f" to {time or lsn}" if time or lsn else " to the end of the archived WAL"
    _said(
        out,
        f"Restore {restore_name} created: {name} is restored in place from {backup_name or snapshot}{target}"
        " (writes stop; the members' current data is kept aside, never deleted)",
    )
    if wait:
        follow(
            lambda: _restore_progress(kube, name, restore_name),
            timeout=timeout,
            out=out,
            what=f"Restore {restore_name}",
        )


def check_confirmed(confirmed: bool, question: str) -> None:
    """A destructive request asked at a terminal: the person says yes first (``--yes`` skips it)."""
    if confirmed or not sys.stdin.isatty():
        return
    answer = input(f"{question} [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        raise PluginError("not confirmed: nothing was changed")
