"""Failures a person must understand: S3 unreachable, bad credentials, a missing bucket, a
corrupted object, S3 lost in the middle of a snapshot. One clear message, non-zero exit, no
traceback, and nothing half-written that looks complete."""

from __future__ import annotations

import subprocess
import time

import pytest
from backup_helpers import TRACEBACK, fill, random_blob_table

from pgherd.local.ports import free_port


def _assert_clean_failure(result, *fragments):
    assert result.returncode != 0
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    assert TRACEBACK not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_s3_unreachable(agent):
    result = agent(
        "list", env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "PGHERD_S3_RETRIES": "2"}
    )
    _assert_clean_failure(result, "cannot reach the S3 endpoint", "AWS_ENDPOINT_URL")


def test_bad_credentials(agent):
    result = agent("list", env={"AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    _assert_clean_failure(result, "refused the credentials", "AWS_SECRET_ACCESS_KEY")
    assert "not-the-secret" not in result.stderr


def test_missing_bucket(agent, s3_store):
    result = agent("list", "--store", "s3://no-such-bucket/x")
    _assert_clean_failure(result, "bucket 'no-such-bucket' does not exist")


def test_corruption_is_found_by_verify_and_refused_by_restore(pg_factory, s3_store, agent):
    primary = pg_factory("primary").initdb().start()
    fill(primary, rows=20000)
    snap = agent("snapshot", "--source", primary.dsn, "--part-size", "1", "--object-size", "1")
    assert snap.returncode == 0, snap.stderr
    data_keys = sorted(s3_store.keys("/data/"))
    assert len(data_keys) > 1
    victim = data_keys[len(data_keys) // 2]
    client = s3_store.endpoint.client()
    blob = bytearray(client.get_object(Bucket=s3_store.endpoint.bucket, Key=victim)["Body"].read())
    blob[len(blob) // 2] ^= 0x01
    client.put_object(Bucket=s3_store.endpoint.bucket, Key=victim, Body=bytes(blob))

    checked = agent("verify", snap.json()["id"])
    _assert_clean_failure(checked, victim, "corrupted")
    target = pg_factory("target").pgdata
    restored = agent("restore", "--pgdata", str(target))
    _assert_clean_failure(restored, victim, "corrupted")
    assert not target.exists(), "a refused restore must not leave a startable directory behind"


def test_a_manifest_that_does_not_describe_its_backup_is_refused(pg_factory, s3_store, agent):
    """The manifest of a compressed stream comes from pg_basebackup's messages: verify and restore
    check it against the backup's own backup_label and pg_control."""
    import json

    primary = pg_factory("primary").initdb().start()
    fill(primary, rows=2000)
    snap = agent("snapshot", "--source", primary.dsn)
    assert snap.returncode == 0, snap.stderr
    [key] = [k for k in s3_store.keys("") if k.endswith("manifest.json")]
    client = s3_store.endpoint.client()
    manifest = json.loads(client.get_object(Bucket=s3_store.endpoint.bucket, Key=key)["Body"].read())
    manifest["start_lsn"] = "0/1000028"
    client.put_object(Bucket=s3_store.endpoint.bucket, Key=key, Body=json.dumps(manifest).encode())

    checked = agent("verify", snap.json()["id"])
    _assert_clean_failure(checked, "not at 0/1000028", "damaged")
    target = pg_factory("target").pgdata
    restored = agent("restore", "--pgdata", str(target), "--target-immediate")
    _assert_clean_failure(restored, "not at 0/1000028", "damaged")
    assert not target.exists(), "a refused restore must not leave a startable directory behind"


@pytest.mark.parametrize(
    ("site", "field", "message"),
    [("server", "object_sha256", "does not match its manifest"), ("agent", "size", "decompresses to")],
)
def test_the_checks_at_the_end_of_the_stream_stop_a_restore(
    pg_factory, s3_store, agent, site, field, message
):
    """The last object's own checksum, and a format-1 snapshot's total size, are known only after the
    tar's end marker: restore still waits for their verdict."""
    import json

    primary = pg_factory("primary").initdb().start()
    fill(primary, rows=500)
    snap = agent("snapshot", "--source", primary.dsn, "--compress-on", site)
    assert snap.returncode == 0, snap.stderr
    [key] = [k for k in s3_store.keys("") if k.endswith("manifest.json")]
    client = s3_store.endpoint.client()
    manifest = json.loads(client.get_object(Bucket=s3_store.endpoint.bucket, Key=key)["Body"].read())
    if field == "size":
        manifest["size"] += 512
    else:
        manifest["objects"][-1]["sha256"] = "0" * 64
    client.put_object(Bucket=s3_store.endpoint.bucket, Key=key, Body=json.dumps(manifest).encode())

    target = pg_factory("target").pgdata
    restored = agent("restore", "--pgdata", str(target), "--target-immediate")
    _assert_clean_failure(restored, message)
    assert not target.exists(), "a refused restore must not leave a startable directory behind"
    _assert_clean_failure(agent("verify", "latest"), message)


def test_s3_lost_during_a_snapshot_leaves_no_complete_snapshot(
    pg_factory, s3_store, s3_server, agent, tmp_path
):
    primary = pg_factory("primary").initdb().start()
    random_blob_table(primary, megabytes=48)
    import os

    env = {
        **os.environ,
        **s3_store.env(),
        "PGHERD_S3_RETRIES": "2",
        "PGHERD_S3_READ_TIMEOUT": "5",
        "PGHERD_S3_CONNECT_TIMEOUT": "2",
    }
    from pgherd_backup.restore import agent_executable

    proc = subprocess.Popen(
        [
            agent_executable(),
            "snapshot",
            "--source",
            primary.dsn,
            "--part-size",
            "5",
            "--object-size",
            "8",
            "--compression",
            "lz4",
            "--max-rate",
            "16M",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 30
    while not s3_store.keys("/snapshots/") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the snapshot should still be running"
    with s3_server.outage():
        out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, out
    assert "cannot reach the S3 endpoint" in err and TRACEBACK not in err
    assert not [k for k in s3_store.keys("") if k.endswith("manifest.json")]
    assert agent("list", "--json").json() == []
    nothing = agent("restore", "--pgdata", str(tmp_path / "nothing"))
    assert nothing.returncode != 0 and "no complete snapshot" in nothing.stderr


def test_an_interrupted_snapshot_cleans_up_and_is_never_listed(pg_factory, s3_store, agent):
    import os
    import signal

    from pgherd_backup.restore import agent_executable

    primary = pg_factory("primary").initdb().start()
    random_blob_table(primary, megabytes=24)
    proc = subprocess.Popen(
        [
            agent_executable(),
            "snapshot",
            "--source",
            primary.dsn,
            "--part-size",
            "5",
            "--object-size",
            "8",
            "--compression",
            "lz4",
            "--max-rate",
            "8M",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **s3_store.env()},
    )
    deadline = time.monotonic() + 30
    while not s3_store.keys("/snapshots/") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the snapshot should still be running"
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "interrupted" in err and TRACEBACK not in err
    assert s3_store.keys("/snapshots/") == [], "the objects of an interrupted snapshot are removed"
    assert agent("list", "--json").json() == []
