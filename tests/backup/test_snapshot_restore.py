"""Snapshot and restore round trips: content, compression codecs, standby sources, the archive
continued on a new timeline, and the refusals."""

from __future__ import annotations

import json

import pytest
from backup_helpers import TRACEBACK, fill, set_port


def test_round_trip_keeps_every_table_and_continues_the_archive(pg_factory, s3_store, agent, pg_bin):
    primary = pg_factory("primary", env=s3_store.env()).initdb(archive=True).start()
    fill(primary)
    import subprocess

    subprocess.run([pg_bin.pgbench, "-i", "-s", "2", "-q", primary.dsn], check=True, capture_output=True)
    before = primary.table_checksums()

    snap = agent("snapshot", "--source", primary.dsn)
    assert snap.returncode == 0, snap.stderr
    summary = snap.json()
    for key in ("id", "start_lsn", "stop_lsn", "timeline", "system_id", "pg_version", "size", "stored_size"):
        assert key in summary
    assert summary["stored_size"] < summary["size"]

    listed = agent("list", "--json")
    assert listed.returncode == 0 and [s["id"] for s in listed.json()] == [summary["id"]]
    table = agent("list")
    assert summary["id"] in table.stdout and "SYSTEM ID" in table.stdout

    checked = agent("verify", summary["id"])
    assert checked.returncode == 0, checked.stderr
    # the size in the manifest is the server's count of uncompressed bytes, in whole kB
    assert 0 <= checked.json()["raw_bytes"] - summary["size"] < 1024
    assert summary["compressed_by"] == "server" and summary["source"] == "primary"

    primary.sql("INSERT INTO events (note) VALUES ('after the snapshot')")
    primary.switch_and_wait_archived()
    after = primary.table_checksums()

    restored = pg_factory("restored", env=s3_store.env())
    result = agent("restore", "--pgdata", str(restored.pgdata))
    assert result.returncode == 0, result.stderr
    assert (restored.pgdata / "recovery.signal").exists()
    set_port(restored)
    restored.start()
    restored.wait_promoted()
    assert restored.table_checksums() == after != before
    assert restored.timeline() == 2
    # the restored cluster (same system id) archives its new timeline next to the old one
    restored.switch_and_wait_archived()
    assert any(k.endswith("/wal/00000002.history") for k in s3_store.keys(""))
    assert any("/wal/00000002" in k and not k.endswith(".history") for k in s3_store.keys(""))


@pytest.mark.parametrize(
    ("codec", "site"),
    [
        ("lz4", "server"),
        ("gzip", "server"),
        ("none", "auto"),
        ("zstd", "client"),
        ("zstd", "agent"),
        ("lz4", "agent"),
    ],
)
def test_other_codecs_round_trip(pg_factory, s3_store, agent, codec, site):
    """Every codec, compressed by the server, by pg_basebackup, or by the agent (the way for servers
    before 15: one frame per object, manifest format 1)."""
    primary = pg_factory("primary").initdb().start()
    fill(primary, rows=3000)
    # objects and parts of 1 MiB: several objects, and objects that end exactly on a part's end
    flags = ["--compression", codec, "--compress-on", site, "--object-size", "1", "--part-size", "1"]
    snap = agent("snapshot", "--source", primary.dsn, *flags)
    assert snap.returncode == 0, snap.stderr
    assert snap.json()["compression"] == codec
    assert snap.json()["objects"] > 1
    [key] = [k for k in s3_store.keys("") if k.endswith("manifest.json")]
    manifest = json.loads(
        s3_store.endpoint.client().get_object(Bucket=s3_store.endpoint.bucket, Key=key)["Body"].read()
    )
    assert all(part["size"] > 0 for obj in manifest["objects"] for part in obj["parts"]), "no empty part"
    expected_site = "none" if codec == "none" else site
    assert snap.json()["compressed_by"] == expected_site
    checked = agent("verify", "latest")
    assert checked.returncode == 0, checked.stderr
    restored = pg_factory("restored")
    result = agent("restore", "--pgdata", str(restored.pgdata), "--target-immediate")
    assert result.returncode == 0, result.stderr
    set_port(restored)
    restored.start()
    restored.wait_promoted()
    assert restored.table_checksums() == primary.table_checksums()


def test_snapshot_from_a_standby(pg_pair, pg_factory, s3_store, agent):
    primary, standby = pg_pair
    fill(primary, rows=5000)
    lsn = primary.value("SELECT pg_current_wal_lsn()")
    standby.wait_until(lambda: standby.value(f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'"), "replay")
    snap = agent("snapshot", "--source", standby.dsn)
    assert snap.returncode == 0, snap.stderr
    manifest = agent("list", "--json").json()[0]
    assert manifest["id"] == snap.json()["id"]
    assert manifest["source"] == "standby"
    restored = pg_factory("restored")
    result = agent("restore", "--pgdata", str(restored.pgdata), "--target-immediate")
    assert result.returncode == 0, result.stderr
    set_port(restored)
    restored.start()
    restored.wait_promoted()
    assert restored.table_checksums() == primary.table_checksums()


def test_restore_refuses_a_non_empty_directory(pg_factory, s3_store, agent):
    primary = pg_factory("primary").initdb().start()
    assert agent("snapshot", "--source", primary.dsn).returncode == 0
    target = pg_factory("target").pgdata
    target.mkdir()
    (target / "precious").write_text("keep me")
    result = agent("restore", "--pgdata", str(target))
    assert result.returncode != 0
    assert "not an empty directory" in result.stderr and TRACEBACK not in result.stderr
    assert (target / "precious").read_text() == "keep me"


def test_snapshot_without_wal_waits_for_the_archive(pg_factory, s3_store, agent):
    primary = pg_factory("primary", env=s3_store.env()).initdb(archive=True).start()
    fill(primary, rows=2000)
    snap = agent("snapshot", "--source", primary.dsn, "--wal-method", "none")
    assert snap.returncode == 0, snap.stderr
    assert any(k.endswith("/wal/" + snap.json()["start_wal"]) for k in s3_store.keys("/wal/"))
    restored = pg_factory("restored", env=s3_store.env())
    result = agent("restore", "--pgdata", str(restored.pgdata), "--target-immediate")
    assert result.returncode == 0, result.stderr
    set_port(restored)
    restored.start()
    restored.wait_promoted()
    assert restored.table_checksums() == primary.table_checksums()


def test_a_server_without_the_codec_leaves_the_compression_to_the_agent(
    pg_factory, s3_store, agent, pg_bin, tmp_path
):
    """A server built without zstd refuses server-side compression before it sends anything: by default
    pgherd-backup then compresses itself, and says so; asked explicitly for the server, it fails."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for program in pg_bin.bindir.iterdir():
        if program.name != "pg_basebackup":
            (bindir / program.name).symlink_to(program)
    script = bindir / "pg_basebackup"
    script.write_text(
        "#!/bin/sh\n"
        'for arg in "$@"; do case "$arg" in --compress=server-*)\n'
        "  echo 'pg_basebackup: error: could not initiate base backup: ERROR:  zstd compression is not "
        "supported by this build' >&2; exit 1;; esac; done\n"
        f'exec {pg_bin.pg_basebackup} "$@"\n'
    )
    script.chmod(0o755)
    primary = pg_factory("primary").initdb().start()
    fill(primary, rows=1000)
    env = {"PG_BIN": str(bindir)}

    snap = agent("snapshot", "--source", primary.dsn, env=env)
    assert snap.returncode == 0, snap.stderr
    assert snap.json()["compressed_by"] == "agent"
    assert "compressing in pgherd-backup instead" in snap.stderr
    assert agent("verify", "latest").returncode == 0

    explicit = agent("snapshot", "--source", primary.dsn, "--compress-on", "server", env=env)
    assert explicit.returncode != 0
    assert "not supported by this build" in explicit.stderr and TRACEBACK not in explicit.stderr
    assert len(agent("list", "--json").json()) == 1


def test_a_snapshot_shows_its_progress_on_a_terminal(pg_factory, s3_store):
    """Bytes, rate and ETA on stderr when it is a terminal (the server's count of uncompressed
    bytes against its estimate); the JSON summary on stdout all the same."""
    import json
    import os
    import pty
    import re
    import subprocess

    from backup_helpers import random_blob_table

    from pgherd_backup.restore import agent_executable

    primary = pg_factory("primary").initdb().start()
    random_blob_table(primary, megabytes=32)
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [agent_executable(), "snapshot", "--source", primary.dsn, "--max-rate", "16M"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=follower,
        env={**os.environ, **s3_store.env()},
    )
    os.close(follower)
    shown = b""
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # EIO: the last writer closed the terminal
            break
        if not data:
            break
        shown += data
    os.close(leader)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, shown.decode(errors="replace")
    text = shown.decode(errors="replace")
    assert re.search(
        r"snapshot: [\d.]+ (KiB|MiB) / [\d.]+ MiB \(\d+%\)\s+[\d.]+ (KiB|MiB)/s\s+ETA \d+:\d\d", text
    ), text
    assert re.search(r"\(100%\)", text), text
    assert json.loads(out)["size"] > 32 << 20


def test_a_snapshot_under_a_translated_locale(pg_factory, s3_store, agent):
    """The manifest is built from pg_basebackup's messages: they must not come out in German."""
    primary = pg_factory("primary").initdb().start()
    fill(primary, rows=500)
    snap = agent("snapshot", "--source", primary.dsn, env={"LANGUAGE": "de", "LC_ALL": "C.UTF-8"})
    assert snap.returncode == 0, snap.stderr
    assert agent("verify", "latest").returncode == 0
