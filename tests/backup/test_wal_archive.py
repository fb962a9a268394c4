"""wal-push / wal-fetch: idempotence, conflicts, quiet misses, corruption, keeping up with
pgbench, and an archive that continues across a promotion."""

from __future__ import annotations

import os
import subprocess
import time

from backup_helpers import TRACEBACK

SEGMENT = "000000010000000000000042"
SYSTEM_ID = "7000000000000000001"


def test_wal_push_is_idempotent_and_refuses_a_conflicting_segment(tmp_path, s3_store, agent):
    wal = tmp_path / SEGMENT
    wal.write_bytes(os.urandom(1 << 20) + bytes(15 << 20))
    assert agent("wal-push", "--system-id", SYSTEM_ID, str(wal)).returncode == 0
    again = agent("wal-push", "--system-id", SYSTEM_ID, str(wal))
    assert again.returncode == 0, again.stderr

    fetched = tmp_path / "RECOVERYXLOG"
    result = agent("wal-fetch", "--system-id", SYSTEM_ID, SEGMENT, str(fetched))
    assert result.returncode == 0, result.stderr
    assert fetched.read_bytes() == wal.read_bytes()

    wal.write_bytes(os.urandom(16 << 20))
    conflict = agent("wal-push", "--system-id", SYSTEM_ID, str(wal))
    assert conflict.returncode != 0
    assert "already archived" in conflict.stderr and "different content" in conflict.stderr
    assert TRACEBACK not in conflict.stderr
    assert len(s3_store.keys("/wal/")) == 1


def test_wal_fetch_misses_quietly_and_fails_fatally_on_corruption(tmp_path, s3_store, agent):
    for name in ("000000010000000000000099", "00000005.history"):
        miss = agent("wal-fetch", "--system-id", SYSTEM_ID, name, str(tmp_path / "x"))
        assert miss.returncode == 1 and miss.stderr == ""
        assert not (tmp_path / "x").exists()

    wal = tmp_path / SEGMENT
    wal.write_bytes(os.urandom(4096) * 16)
    assert agent("wal-push", "--system-id", SYSTEM_ID, str(wal)).returncode == 0
    key = s3_store.keys("/wal/")[0]
    client = s3_store.endpoint.client()
    blob = bytearray(client.get_object(Bucket=s3_store.endpoint.bucket, Key=key)["Body"].read())
    blob[-100] ^= 0xFF
    client.put_object(Bucket=s3_store.endpoint.bucket, Key=key, Body=bytes(blob))
    bad = agent("wal-fetch", "--system-id", SYSTEM_ID, SEGMENT, str(tmp_path / "y"))
    assert bad.returncode > 125, "a damaged segment must stop PostgreSQL's recovery, not end it quietly"
    assert SEGMENT in bad.stderr and TRACEBACK not in bad.stderr
    assert not (tmp_path / "y").exists()


def test_archiving_keeps_up_with_pgbench(pg_factory, s3_store, pg_bin):
    """The archiver's backlog (.ready files) stays small under a pgbench write load, and drains."""
    import threading

    primary = pg_factory("primary", env=s3_store.env()).initdb(archive=True).start()
    subprocess.run([pg_bin.pgbench, "-i", "-s", "5", "-q", primary.dsn], check=True, capture_output=True)
    start_lsn = primary.value("SELECT pg_current_wal_lsn()")
    status = primary.pgdata / "pg_wal" / "archive_status"
    backlog: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            backlog.append(len(list(status.glob("*.ready"))))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        subprocess.run(
            [pg_bin.pgbench, "-c", "4", "-j", "2", "-T", "8", primary.dsn], check=True, capture_output=True
        )
    finally:
        done.set()
        watcher.join()
    written = primary.value(f"SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '{start_lsn}')")
    primary.switch_and_wait_archived(timeout=60)
    assert primary.value("SELECT failed_count FROM pg_stat_archiver") == 0
    assert max(backlog) <= 8, (
        f"archiving fell behind: {max(backlog)} segments waiting ({written / 2**20:.0f} MiB written)"
    )


def test_archive_continues_across_a_promotion(pg_factory, s3_store, agent):
    from pgherd_backup.postgres import seed

    primary = pg_factory("primary", env=s3_store.env()).initdb(archive=True).start()
    primary.sql("CREATE TABLE t (x text)")
    primary.sql("INSERT INTO t VALUES ('timeline 1')")
    assert agent("snapshot", "--source", primary.dsn).returncode == 0
    standby = pg_factory("standby", env=s3_store.env())
    seed.basebackup_seed(
        standby.pgdata, primary.dsn, bins=standby.bins, settings=standby.settings(archive=True)
    )
    standby.start()
    primary.switch_and_wait_archived()
    lsn = primary.value("SELECT pg_current_wal_lsn()")
    standby.wait_until(lambda: standby.value(f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'"), "replay")
    primary.stop()
    standby.promote()
    standby.wait_promoted()
    assert standby.timeline() == 2
    standby.sql("INSERT INTO t VALUES ('timeline 2')")
    standby.switch_and_wait_archived()
    keys = s3_store.keys("/wal/")
    assert any(k.endswith("00000002.history") for k in keys)

    restored = pg_factory("restored", env=s3_store.env())
    result = agent("restore", "--pgdata", str(restored.pgdata))
    assert result.returncode == 0, result.stderr
    from backup_helpers import set_port

    set_port(restored)
    restored.start()
    restored.wait_promoted()
    assert sorted(r[0] for r in restored.sql("SELECT x FROM t")) == ["timeline 1", "timeline 2"]
    assert restored.timeline() == 3  # 2 is taken in the archive: PostgreSQL picked the next one
