"""`status` of every phase, from documents the engine itself produced (phases.py): the why-text names
what the engine waits for, since when, and what it does next and when; the operation shows its steps
done and to do; no golden output, only the phrases a person on call needs."""

from __future__ import annotations

import json

import pytest

from pgherd.api.cluster import Phase
from pgherd.plugin import requests
from pgherd.plugin.render import render
from pgherd.plugin.summary import summarize

from . import phases

# For each phase: phrases the text must hold (the engine's reason, what it waits for, what is next).
EXPECTED: dict[Phase, tuple[str, ...]] = {
    Phase.PENDING: ("Waiting:", "waiting for Backup nightly to complete", "creates the first member"),
    Phase.CREATING: ("initializing pg-0", "creates the other members from the primary"),
    Phase.RUNNING: (
        "Conditions: all True",
        "nothing: it watches",
        "a scheduled Backup (0 3 * * *) at 2026-01-02T03:00:00Z",
    ),
    Phase.DEGRADED: (
        "primary pg-0 unreachable for 2s; confirming for 5s before failing over",
        "fails over at 2026-01-01T12:00:05Z (in 3 s) at the earliest",
        "the primary was lost",
    ),
    Phase.SCALING: ("creating pg-3; creating pg-4", "joins the quorum once it streams", "5 wanted"),
    Phase.UPGRADING: (
        "restarting pg-2 (1 of 3)",
        "aborts at 2026-01-01T12:10:00Z (in 10 min)",
        "[>] restart pg-2",
        "[ ] restart pg-1",
        "[ ] switch over from pg-0 to an updated replica",
        "[ ] restart the old primary pg-0",
    ),
    Phase.SWITCHING_OVER: (
        "draining pg-0",
        "abandoned at 2026-01-01T12:00:30Z (in 30 s)",
        "[>] drain pg-0",
        "[ ] pg-1 catches up",
        "becoming pg-1",
    ),
    Phase.FAILING_OVER: (
        "fencing the old primary pg-0: waiting for evidence that it stopped",
        "[>] fence the old primary pg-0",
        "[ ] promote the reachable replica holding the most WAL",
        "primary pg-0 failed (unreachable 6s, confirmed by 2 members)",
    ),
    Phase.QUORUM_LOST: (
        "1 of 3 members reachable, 2 needed. Nothing is promoted",
        "waits for the members to return (recovery.onQuorumLoss: Wait)",
        "Quorum LOST",
    ),
    Phase.RECOVERING: (
        "fencing pg-2",
        "[>] fence every member",
        "restore pg-nightly-2",
        "restores once every member is fenced",
    ),
    Phase.RESTORING: (
        "fencing pg-0, pg-1, pg-2",
        "replay the archived WAL to time:2026-01-01T11:00:00Z",
        "r1: Fencing (from b1)",
    ),
    Phase.PAUSED: ("spec.paused is set", "nothing, not even a failover, until spec.paused is false"),
    Phase.FAILED: (
        "Rollout aborted: pg-2 was not Ready and caught up",
        "it starts again when the revision changes (a spec change, or kubectl pgherd restart)",
        "Progressing False (RolloutAborted",
    ),
    Phase.DELETING: ("the cluster is being deleted", "storage.deletePolicy"),
}


@pytest.mark.parametrize("phase", list(phases.ALL), ids=str)
def test_every_phase_is_explained(phase: Phase) -> None:
    summary = summarize(phases.ALL[phase]())
    assert summary["phase"] == phase
    text = render(summary)
    assert text.startswith(f"PostgresCluster pg in namespace apps: {phase}\n")
    assert "Means:" in text and "Next:" in text
    for phrase in EXPECTED[phase]:
        assert phrase in text, f"{phase}: {phrase!r} not in\n{text}"
    json.dumps(summary)  # -o json prints it as it is


def test_every_phase_of_the_api_has_a_scenario() -> None:
    assert set(phases.ALL) == set(Phase)


def test_the_members_table_reads_status_and_pods() -> None:
    text = render(summarize(phases.upgrading()))
    header = next(line for line in text.splitlines() if line.strip().startswith("MEMBER"))
    for column in ("ROLE", "READY", "TL", "LSN", "LAG", "LAG TIME", "NODE", "RESTARTS", "VERSION"):
        assert column in header
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("pg-2 "))
    assert row[:4] == ["pg-2", "replica", "yes", "1"]
    assert "100" in row and "node-2" in row and "16.4" in row  # lag bytes, node, version


def test_replication_archiving_backups_certificates() -> None:
    text = render(summarize(phases.running()))
    assert 'synchronous_standby_names: ANY 1 ("pg-1", "pg-2")' in text
    assert "Quorum: pg-0, pg-1, pg-2: 2 needed" in text
    assert "last archived segment, failures, segments waiting: unknown" in text
    assert (
        "last Completed: pg-nightly-2 at 2026-01-01T03:00:00Z (9 h 0 min ago)" in text and "verified" in text
    )
    assert "first recoverability point: 2025-12-30T12:00:00Z" in text
    assert "pg-agent tls.crt: expires in 400 d" in text


def test_archiving_as_reported_in_status() -> None:
    document = phases.running()
    document["cluster"]["status"]["archiving"] = {
        "lastArchivedWal": "000000010000000000000007",
        "lastArchivedTime": "2026-01-01T11:59:50Z",
        "failedCount": 2,
        "lastFailedWal": "000000010000000000000005",
        "lastFailedTime": "2026-01-01T11:00:00Z",
        "pending": 1,
    }
    text = render(summarize(document))
    assert "last archived: 000000010000000000000007 at 2026-01-01T11:59:50Z (10 s ago)" in text
    assert "failures: 2, last 000000010000000000000005" in text
    assert "segments waiting: 1" in text


def test_a_certificate_close_to_its_end_is_flagged() -> None:
    document = phases.running()
    assert document["certificates"] is not None
    document["certificates"][0]["not_after"] = "2026-01-05T12:00:00Z"
    assert "EXPIRES in 4 d" in render(summarize(document))
    document["certificates"][0]["not_after"] = "2025-12-31T12:00:00Z"
    assert "EXPIRED 24 h 0 min ago" in render(summarize(document))


def test_a_major_upgrade_names_its_steps_and_the_way_back() -> None:
    text = render(summarize(phases.upgrading_major()))
    assert "Operation: MajorUpgrade" in text
    assert "[>] a Completed Backup of PostgreSQL 16" in text
    assert "[ ] pg_upgrade --link on pg-0" in text
    kept = render(summarize(phases.old_major_kept()))
    assert "pg-2 stays on PostgreSQL 16 as the way back until 2026-01-01T12:50:00Z (in 50 min)" in kept
    assert "kubectl pgherd upgrade confirm" in kept


def test_a_cluster_the_operator_never_wrote_says_so() -> None:
    document = phases.running()
    document["cluster"]["status"] = {}
    document["operator"] = None
    text = render(summarize(document))
    assert "the operator has not written a status yet" in text
    assert "Operator: none found" in text


def test_events_and_notes_are_shown() -> None:
    document = phases.running()
    document["events"] = [
        {
            "type": "Warning",
            "reason": "Switchover",
            "message": "switchover to pg-9 refused: no member of that name",
            "time": "2026-01-01T11:58:00Z",
            "count": 2,
            "regarding": "PostgresCluster/pg",
        }
    ]
    document["notes"] = ["Events: no permission to list events in namespace 'apps'"]
    text = render(summarize(document))
    assert "2 min ago  Warning Switchover x2: switchover to pg-9 refused" in text
    assert "Not shown:\n  Events: no permission" in text


def test_engine_memory_a_merge_patch_left_behind_is_not_believed() -> None:
    """The operator writes status by JSON merge patches, which keep a key left out: status.engine may
    still hold a finished operation, an old lost-primary clock, an abort. The top-level fields and the
    conditions (written whole) decide."""
    stale = phases.failing_over()["cluster"]["status"]["engine"]
    document = phases.running()
    document["cluster"]["status"]["engine"] = {
        **document["cluster"]["status"]["engine"],
        "operation": stale["operation"],
        "primaryLostSince": stale["primaryLostSince"],
        "aborted": {"kind": "Switchover", "startedAt": "2026-01-01T11:00:00+00:00", "failed": "old"},
    }
    text = render(summarize(document))
    assert "Operation:" not in text and "fails over" not in text and "abandoned" not in text
    assert "nothing: it watches" in text
    requests.rolling_restart(document["cluster"], phases.NOW)  # not refused for a stale Failover


def test_certificates_reported_in_status_name_their_secret_and_no_empty_subject() -> None:
    # As the operator reports them on localkube: a name and a Secret, no subject.
    from pgherd.plugin.certificates import from_status

    document = phases.running()
    document["certificates"] = from_status(
        [{"name": "server", "notAfter": "2027-02-25T21:05:37Z", "secret": "pg-agent"}]
    )
    line = next(line for line in render(summarize(document)).splitlines() if "expires in" in line)
    assert line == "  server (Secret pg-agent): expires in 420 d (2027-02-25T21:05:37Z)"


def test_a_quorum_being_reconfigured_reads_as_a_sentence() -> None:
    document = phases.running()
    for condition in document["cluster"]["status"]["conditions"]:
        if condition["type"] == "QuorumHealthy":
            condition["message"] = "3 of 3; synchronous standbys changing"
    text = render(summarize(document))
    assert "Quorum: pg-0, pg-1, pg-2: 2 needed; 3 of 3 reachable; synchronous standbys changing" in text


def test_a_restore_in_progress_shows_its_size_as_a_person_reads_it() -> None:
    document = phases.restoring()
    document["restores"][0]["status"] = {
        "phase": "Restoring",
        "progress": {"bytesDone": 32034304, "bytesTotal": 64068608},
    }
    assert "r1: Restoring (from b1, 50% of 61.1Mi)" in render(summarize(document))
