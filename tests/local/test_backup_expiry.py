"""Backups that tell the truth, in the sandbox: retention deletes a Backup's snapshot (a real prune task
against the real S3 server, after real snapshots of a real member) and that Backup becomes Expired, with
when and which retention; a restore naming it is then refused at once, before any member is touched."""

from __future__ import annotations

import time
from typing import Any

from local_helpers import LocalCluster

from pgherd.engine import actions as act
from pgherd.engine.backups import unrestorable
from pgherd.engine.view import JobKind, JobState
from pgherd.local.jobs import Job


def _wait_done(job: Job, what: str, timeout: float = 180) -> int:
    deadline = time.monotonic() + timeout
    while job.rc is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} still running after {timeout:.0f}s")
        time.sleep(0.2)
    return job.rc


def _backup(cluster: LocalCluster, name: str) -> dict[str, Any]:
    found = cluster.platform.objects.backup(name)
    assert found is not None
    return dict(found.get("status") or {})


def _take_backup(cluster: LocalCluster, name: str) -> str:
    """A Backup object, its snapshot job, its Completed status (and verify task), as the engine drives it."""
    platform = cluster.platform
    platform.objects.apply(
        {
            "apiVersion": "pgherd.io/v1alpha1",
            "kind": "Backup",
            "metadata": {"name": name},
            "spec": {"cluster": {"name": platform.state.cluster}},
        }
    )
    member = cluster.name(0)
    cluster.apply(act.StartSnapshot(name, member, reason="test"))
    job = platform.backups.jobs.job(JobKind.SNAPSHOT, name)
    assert _wait_done(job, f"snapshot {name}") == 0, job.error_text()
    cluster.apply(act.UpdateBackup(name, "Completed", source_member=member))
    assert _wait_done(platform.backups.jobs.task(f"verify-{name}"), f"verify {name}") == 0
    status = _backup(cluster, name)
    assert status["phase"] == "Completed" and status["backupId"]
    return str(status["backupId"])


def test_retention_expires_the_backup_whose_snapshot_it_deleted(local_cluster: Any) -> None:
    cluster: LocalCluster = local_cluster(1)
    platform = cluster.platform
    member = cluster.name(0)
    first = _take_backup(cluster, "first")
    time.sleep(1.1)  # snapshot ids are stamped to the second
    second = _take_backup(cluster, "second")
    assert first != second

    # Retention keepLast 1 after "second", as the engine asks once "second" completed.
    cluster.apply(act.Prune(keep_last=1, keep_within=None, reason="after second"))
    (task,) = platform.backups.jobs.tasks("prune-")
    assert _wait_done(task, "prune") == 0, task.error_text()
    assert (task.stdout_json() or {}).get("deleted_snapshots") == [first]
    platform.advance_retention()  # the supervisor's tick

    expired = _backup(cluster, "first")
    assert expired["phase"] == "Expired"
    assert expired["backupId"] == first  # what it was, kept
    assert expired["expiredAt"].endswith("Z")
    assert expired["message"] == (
        f"its snapshot {first} was deleted by retention (keepLast: 1) after Backup second"
    )
    assert _backup(cluster, "second")["phase"] == "Completed"
    platform.advance_retention()  # read once: nothing changes
    assert _backup(cluster, "first") == expired

    # The engine sees it Expired, with the time: never restored, never `latest`.
    view, _ = platform.view(cluster.spec, None)
    backup = view.backup("first")
    assert backup is not None and backup.phase == "Expired" and backup.expired_at is not None
    refusal = (
        f"Backup first is Expired (its snapshot was deleted by retention at {expired['expiredAt']});"
        " choose another Backup"
    )
    assert unrestorable(backup, "first") == refusal

    # A restore order naming it (an engine that had not seen it yet) is refused by the platform at once:
    # its job fails with the reason, and the member is left as it was, primary.
    platform.objects.apply(
        {
            "apiVersion": "pgherd.io/v1alpha1",
            "kind": "Restore",
            "metadata": {"name": "back"},
            "spec": {"cluster": {"name": platform.state.cluster}, "backup": "first"},
        }
    )
    cluster.apply(act.StartRestore("back", member, "first", None, None, reason="Restore back"))
    (job,) = [j for j in platform.backups.job_views() if j.kind is JobKind.RESTORE]
    assert job.state is JobState.FAILED and job.message == refusal
    assert cluster.status(member).role == "primary" and not cluster.status(member).fenced
