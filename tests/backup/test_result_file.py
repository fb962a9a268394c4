"""`--result-file` of `pgherd-backup snapshot` and `prune`: the summary a Kubernetes Job leaves in its
termination message (/dev/termination-log, at most 4096 bytes), where the operator reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pgherd_backup import cli


def test_both_commands_accept_a_result_file():
    parser = cli.build_parser()
    for command in (["snapshot", "--source", "host=x"], ["prune", "--keep-last", "3"]):
        args = parser.parse_args([*command, "--result-file", "/dev/termination-log"])
        assert args.result_file == "/dev/termination-log"
        assert parser.parse_args(command).result_file is None


def test_a_small_summary_is_written_whole_and_compact():
    value = {"id": "20250101T000000Z", "size": 123, "kept": ["a", "b"], "dry_run": False}
    text = cli.result_document(value)
    assert json.loads(text) == value
    assert "\n" not in text and ": " not in text


def test_long_lists_keep_their_newest_items_and_say_how_many_there_were():
    kept = [f"2025{i:04d}T000000Z-{'x' * 20}" for i in range(400)]
    value = {"kept": kept, "deleted_snapshots": ["old"], "deleted_wal_files": 7, "dry_run": False}
    text = cli.result_document(value)
    assert len(text.encode()) <= cli.RESULT_LIMIT
    document = json.loads(text)
    assert document["truncated"] is True
    assert document["kept_total"] == 400
    assert document["kept"] and document["kept"] == kept[-len(document["kept"]) :]
    assert document["deleted_snapshots"] == ["old"]
    assert document["deleted_wal_files"] == 7


def test_prune_writes_its_result_file(s3_store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for name, value in s3_store.endpoint.env().items():
        monkeypatch.setenv(name, value)
    result = tmp_path / "termination-log"
    code = cli.main(
        [
            "prune",
            "--store",
            s3_store.url,
            "--cluster",
            s3_store.cluster,
            "--keep-last",
            "2",
            "--result-file",
            str(result),
        ]
    )
    assert code == 0
    document = json.loads(result.read_text())
    assert document["kept"] == [] and document["deleted_snapshots"] == []
    assert document["dry_run"] is False


def test_an_unwritable_result_file_is_a_warning_not_a_failure(capsys: pytest.CaptureFixture[str]):
    cli._emit({"id": "x"}, "/nonexistent-directory/termination-log")
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"id": "x"}
    assert "warning: cannot write /nonexistent-directory/termination-log" in captured.err


def test_snapshot_with_verify_reads_every_object_back_and_says_so(
    pg_factory, s3_store, agent, tmp_path: Path
):
    """`snapshot --verify` (what the Kubernetes snapshot Job runs): the Backup's `verified` comes from
    every object re-read and checked, not from the upload having returned."""
    primary = pg_factory("primary").initdb().start()
    result = tmp_path / "termination-log"
    run = agent("snapshot", "--source", primary.dsn, "--verify", "--result-file", str(result))
    assert run.returncode == 0, run.stderr
    document = json.loads(result.read_text())
    assert document["verified"] is True and "verify_error" not in document
    assert run.json()["verified"] is True
    without = agent("snapshot", "--source", primary.dsn)
    assert without.returncode == 0, without.stderr
    assert "verified" not in without.json()


def test_a_snapshot_that_does_not_read_back_is_reported_unverified(
    pg_factory, s3_store, agent, monkeypatch: pytest.MonkeyPatch
):
    from pgherd_backup.catalog import find_snapshot

    primary = pg_factory("primary").initdb().start()
    snap = agent("snapshot", "--source", primary.dsn, "--part-size", "1", "--object-size", "1")
    assert snap.returncode == 0, snap.stderr
    victim = sorted(s3_store.keys("/data/"))[0]
    client = s3_store.endpoint.client()
    blob = bytearray(client.get_object(Bucket=s3_store.endpoint.bucket, Key=victim)["Body"].read())
    blob[len(blob) // 2] ^= 0x01
    client.put_object(Bucket=s3_store.endpoint.bucket, Key=victim, Body=bytes(blob))
    for name, value in s3_store.endpoint.env().items():
        monkeypatch.setenv(name, value)
    args = cli.build_parser().parse_args(["list", "--store", s3_store.url, "--cluster", s3_store.cluster])
    store = cli._open_store(args)
    verdict = cli.verification(store, find_snapshot(store, snap.json()["id"]))
    assert verdict["verified"] is False
    assert victim.rsplit("/", 1)[-1] in verdict["verify_error"] or "corrupt" in verdict["verify_error"]
