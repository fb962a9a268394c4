"""Pure pieces, without PostgreSQL or S3: names, tar streaming, manifests, settings files, codecs."""

from __future__ import annotations

import io
import os
import tarfile

import pytest
from backup_helpers import recording_agent, run_restore_command

from pgherd_backup.compression import CODECS, Codec
from pgherd_backup.errors import IntegrityError, UsageError
from pgherd_backup.manifest import DataObject, Manifest, Part, parse_time, snapshot_id
from pgherd_backup.postgres.config import (
    quote,
    read_pgherd_conf,
    restore_command,
    update_pgherd_conf,
    write_pgherd_conf,
)
from pgherd_backup.restore import RecoveryTarget
from pgherd_backup.store import StoreLocation
from pgherd_backup.tarstream import TarTap, extract
from pgherd_backup.walnames import Segment, format_lsn, is_wal_name, parse_lsn, segment_number_of


def test_lsn_and_segment_names():
    assert parse_lsn("0/16B3748") == 0x16B3748
    assert format_lsn(parse_lsn("1A/FF000028")) == "1A/FF000028"
    seg = Segment.of_lsn(2, parse_lsn("1/2000028"))
    assert seg.name() == "000000020000000100000002"
    assert Segment.parse(seg.name()) == seg
    assert segment_number_of("000000010000000000000003.partial") == 3
    assert is_wal_name("00000002.history") and is_wal_name("000000010000000000000002.00000028.backup")
    assert not is_wal_name("../etc/passwd")
    with pytest.raises(ValueError):
        parse_lsn("16B3748")


def _tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        dir_info = tarfile.TarInfo("global")
        dir_info.type, dir_info.mode = tarfile.DIRTYPE, 0o700
        archive.addfile(dir_info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o600
            archive.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("pg_tblspc_link")
        link.type, link.linkname = tarfile.SYMTYPE, "global"
        archive.addfile(link)
    return buffer.getvalue()


def test_tar_tap_sees_files_through_any_slicing_and_extract_restores_them(tmp_path):
    files = {"PG_VERSION": b"15\n", "global/pg_control": os.urandom(8192), "base/1/1259": os.urandom(100_000)}
    stream = _tar(files)
    for step in (1, 511, 512, 4096, len(stream)):
        tap = TarTap({"PG_VERSION", "global/pg_control"})
        for start in range(0, len(stream), step):
            tap.feed(stream[start : start + step])
        assert tap.files == {"PG_VERSION": b"15\n", "global/pg_control": files["global/pg_control"]}
        assert tap.ended
    written = extract(io.BytesIO(stream), tmp_path / "out")
    assert written == sum(len(v) for v in files.values())
    for name, data in files.items():
        assert (tmp_path / "out" / name).read_bytes() == data
    assert os.readlink(tmp_path / "out" / "pg_tblspc_link") == "global"


def test_extract_refuses_paths_outside_the_target(tmp_path):
    with pytest.raises(IntegrityError, match="unsafe path"):
        extract(io.BytesIO(_tar({"../escape": b"x"})), tmp_path / "out")
    assert not (tmp_path / "escape").exists()


def test_extract_notices_a_truncated_stream(tmp_path):
    stream = _tar({"base/big": os.urandom(50_000)})
    with pytest.raises(IntegrityError, match="ends"):
        extract(io.BytesIO(stream[:20_000]), tmp_path / "out")


@pytest.mark.parametrize("name", CODECS)
def test_codecs_round_trip_and_detect_damage(name):
    codec = Codec.get(name)
    data = os.urandom(300_000) + bytes(2_000_000)
    packed = codec.compress(data)
    assert codec.decompress(packed) == data
    if name != "none":
        damaged = bytearray(packed)
        damaged[len(damaged) // 2] ^= 0xFF
        with pytest.raises(IntegrityError):
            assert codec.decompress(bytes(damaged)) != data  # a damaged stream must not decode silently
    with pytest.raises(UsageError):
        Codec.get("brotli")


def test_manifest_round_trip():
    manifest = Manifest(
        id=snapshot_id(parse_time("2025-01-31T12:00:00.123+00:00")),
        cluster="c",
        system_id="7",
        timeline=1,
        start_lsn="0/2000028",
        stop_lsn="0/2000100",
        start_wal="000000010000000000000002",
        stop_wal="000000010000000000000002",
        start_time="2025-01-31T12:00:00+00:00",
        stop_time="2025-01-31T12:00:01+00:00",
        pg_version="15.8",
        pg_major=15,
        compression="zstd",
        source="standby",
        size=10,
        stored_size=5,
        objects=(DataObject("data/00000.tar.zst", 5, 10, "ab" * 32, (Part(5, "cd" * 32),)),),
    )
    assert manifest.id == "20250131T120000123Z"
    assert Manifest.from_json(manifest.to_json()) == manifest
    with pytest.raises(IntegrityError):
        Manifest.from_json('{"id": 1}')


def test_pgherd_settings_file(tmp_path):
    (tmp_path / "postgresql.conf").write_text("shared_buffers = 128MB\n")
    write_pgherd_conf(
        tmp_path, {"port": 5433, "hot_standby": True, "primary_conninfo": "host=a password='x'"}
    )
    update_pgherd_conf(tmp_path, {"port": 5434, "hot_standby": None})
    assert read_pgherd_conf(tmp_path) == {"port": "5434", "primary_conninfo": "host=a password='x'"}
    conf = (tmp_path / "postgresql.conf").read_text()
    assert conf.startswith("shared_buffers") and conf.count("include_if_exists") == 1
    update_pgherd_conf(tmp_path, {"port": 1})
    assert (tmp_path / "postgresql.conf").read_text().count("include_if_exists") == 1
    assert quote("it's") == "'it''s'" and quote(False) == "off"


def test_targets_and_locations():
    assert RecoveryTarget(lsn="0/3000000").settings() == {"recovery_target_lsn": "0/3000000"}
    assert RecoveryTarget(immediate=True).settings() == {"recovery_target": "immediate"}
    with pytest.raises(UsageError):
        RecoveryTarget(lsn="0/1", immediate=True)
    location = StoreLocation.parse("s3://bucket/some/path/", "main")
    assert location.system_prefix("42") == "some/path/main/42/"
    assert StoreLocation.parse("s3://bucket", "main").cluster_prefix == "main/"


def test_restore_command_takes_a_streamed_history_file_from_pg_wal(tmp_path):
    """A history file already in pg_wal is copied without the agent; anything else goes to the agent."""
    agent, calls = recording_agent(tmp_path)
    pgdata = tmp_path / "data"
    (pgdata / "pg_wal").mkdir(parents=True)
    (pgdata / "pg_wal" / "00000002.history").write_text("1\t0/3000000\tno recovery target specified\n")
    command = restore_command(agent)

    assert run_restore_command(command, "00000002.history", pgdata, "pg_wal/RECOVERYHISTORY") == 0
    assert (pgdata / "pg_wal" / "RECOVERYHISTORY").read_text().startswith("1\t0/3000000")
    assert not calls.exists()
    assert run_restore_command(command, "00000003.history", pgdata) == 1  # not streamed: the archive
    assert run_restore_command(command, "000000020000000000000004", pgdata) == 1  # segments: the archive
    assert calls.read_text().splitlines() == [
        "wal-fetch 00000003.history pg_wal/RECOVERYXLOG",
        "wal-fetch 000000020000000000000004 pg_wal/RECOVERYXLOG",
    ]
