"""`pgherd-backup snapshot`'s client key: a key libpq would refuse for its mode (a Secret's file seen
under another owner) is copied into a private file for the connection, and removed after; a key libpq
takes is used as it is."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict

from pgherd_backup.postgres.sslkey import libpq_accepts, usable_sslkey

KEY = b"-----BEGIN PRIVATE KEY-----\nnot really\n-----END PRIVATE KEY-----\n"


# A Secret's file as a pod in a user namespace sees it: owned by an unmapped user, not by root.
OVERFLOW_UID = 65534


def key_file(folder: Path, mode: int, *, foreign: bool = False, name: str = "replication.key") -> Path:
    path = folder / name
    path.write_bytes(KEY)
    os.chmod(path, mode)
    if foreign and os.geteuid() == 0:
        os.chown(path, OVERFLOW_UID, -1)
    return path


def dsn(key: Path) -> str:
    return f"host=db user=streaming_replica sslmode=verify-ca sslcert=/x/replication.crt sslkey={key}"


@pytest.mark.parametrize("mode", [0o640, 0o440, 0o644, 0o604])
def test_a_key_others_may_read_is_copied_privately_for_the_connection(tmp_path: Path, mode: int) -> None:
    key = key_file(tmp_path, mode, foreign=True)
    assert not libpq_accepts(key)
    with usable_sslkey(dsn(key)) as used:
        params = conninfo_to_dict(used)
        copy = Path(str(params["sslkey"]))
        assert copy != key and copy.read_bytes() == KEY
        assert stat.S_IMODE(copy.stat().st_mode) == 0o600
        assert stat.S_IMODE(copy.parent.stat().st_mode) == 0o700
        assert libpq_accepts(copy)
        assert {k: v for k, v in params.items() if k != "sslkey"} == {
            k: v for k, v in conninfo_to_dict(dsn(key)).items() if k != "sslkey"
        }
    assert not copy.exists() and not copy.parent.exists()


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_key_libpq_takes_is_used_as_it_is(tmp_path: Path, mode: int) -> None:
    key = key_file(tmp_path, mode)
    assert libpq_accepts(key)
    with usable_sslkey(dsn(key)) as used:
        assert used == dsn(key)


@pytest.mark.skipif(os.geteuid() != 0, reason="a root-owned file needs root to make")
def test_a_root_owned_key_readable_by_its_group_is_used_as_it_is(tmp_path: Path) -> None:
    """What the kubelet mounts with fsGroup (root:fsGroup, 0440): libpq takes it."""
    key = key_file(tmp_path, 0o440)
    assert libpq_accepts(key)
    assert not libpq_accepts(key_file(tmp_path, 0o644, name="other.key"))
    with usable_sslkey(dsn(key)) as used:
        assert used == dsn(key)


def test_no_key_or_an_unreadable_one_is_left_to_libpq(tmp_path: Path) -> None:
    with usable_sslkey("host=db user=app") as used:
        assert used == "host=db user=app"
    missing = dsn(tmp_path / "absent.key")
    with usable_sslkey(missing) as used:
        assert used == missing
