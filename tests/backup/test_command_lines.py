"""archive_command and restore_command carry values a cluster editor chooses (the store's path): after
PostgreSQL's %-substitution, the shell must see exactly the intended arguments and run nothing else.

A real PostgreSQL archives through a command rendered with a hostile path, and random store locations
that admission accepts are run through a real `sh` after the substitution PostgreSQL makes."""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgherd.api.cluster import S3_PATH_PATTERN
from pgherd_backup.postgres import config

HOSTILE_PATHS = ["x%%;touch PWNED;#", "x';touch PWNED;'", "x%p$(touch PWNED)", "a b`touch PWNED`%f"]


def recorder(directory: Path) -> tuple[str, Path]:
    """A stand-in for pgherd-backup that writes its arguments, each ended by a NUL."""
    calls = directory / "calls"
    script = directory / "agent"
    script.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" >> {shlex.quote(str(calls))}\nexit 1\n")
    script.chmod(0o755)
    return str(script), calls


def postgres_substitutes(command: str, **values: str) -> str:
    """PostgreSQL's substitution in archive_command/restore_command (PostgreSQL 16's strict form: a
    placeholder it does not know is an error, where 15 left it as it was)."""

    def replace(match: re.Match[str]) -> str:
        letter = match.group(1)
        if letter == "%":
            return "%"
        if letter in values:
            return values[letter]
        raise ValueError(f"unexpected placeholder %{letter} in {command!r}")

    if re.search(r"%$", command):
        raise ValueError(f"a command ending in a lone % ({command!r})")
    return re.sub(r"%(.)", replace, command)


def run_in_shell(command: str, cwd: Path) -> None:
    subprocess.run(["sh", "-c", command], cwd=cwd, timeout=30, check=False, capture_output=True)


def test_a_real_postgresql_archives_through_a_hostile_store_path(pg_factory: Callable[..., Any]) -> None:
    primary = pg_factory("primary").initdb()
    folder = primary.pgdata.parent / "recorder"  # PostgreSQL's user writes there
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    agent, calls = recorder(folder)
    stores = [f"s3://bucket/{path}" for path in HOSTILE_PATHS]
    command = " ; ".join(config.archive_command(agent, store, "hippo") for store in stores)
    config.update_pgherd_conf(primary.pgdata, {"archive_mode": True, "archive_command": command})
    primary.start()
    primary.sql("SELECT pg_switch_wal()")
    primary.sql("CREATE TABLE t AS SELECT 1")
    primary.sql("SELECT pg_switch_wal()")
    primary.wait_until(
        lambda: primary.value("SELECT archived_count + failed_count FROM pg_stat_archiver") > 0,
        "archiving tried",
    )
    lines = calls.read_bytes().decode().split("\0")
    first = lines[: 6 * len(stores)]
    for index, store in enumerate(stores):
        wal = first[6 * index + 5]
        assert first[6 * index : 6 * index + 5] == ["wal-push", "--store", store, "--cluster", "hippo"]
        assert re.fullmatch(r"pg_wal/[0-9A-F]{24}", wal), wal
    assert not list(folder.rglob("PWNED")) and not list(primary.pgdata.rglob("PWNED"))


_SEGMENT = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-", min_size=1, max_size=12
)
_ACCEPTED_PATHS = (
    st.lists(_SEGMENT, min_size=0, max_size=4)
    .map("/".join)
    .filter(lambda p: re.fullmatch(S3_PATH_PATTERN, p) is not None)
)
# Beyond what admission accepts: the quoting alone must hold for any text the agent is given.
_ANY_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.one_of(_ACCEPTED_PATHS, _ANY_TEXT), cluster=st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True)
)
def test_the_shell_sees_exactly_the_intended_arguments(tmp_path: Path, path: str, cluster: str) -> None:
    agent, calls = recorder(tmp_path)
    store = f"s3://bucket/{path}"
    wal, name = "pg_wal/000000010000000000000003", "000000010000000000000003"

    calls.unlink(missing_ok=True)
    archive = postgres_substitutes(config.archive_command(agent, store, cluster), p=wal, f=name)
    assert shlex.split(archive) == [agent, "wal-push", "--store", store, "--cluster", cluster, wal]
    run_in_shell(archive, tmp_path)
    assert calls.read_bytes().decode().split("\0")[:-1] == [
        "wal-push",
        "--store",
        store,
        "--cluster",
        cluster,
        wal,
    ]

    calls.unlink(missing_ok=True)
    restore = config.restore_command(agent, store, cluster, wal_service=str(tmp_path / "no-such.sock"))
    run_in_shell(postgres_substitutes(restore, p="pg_wal/RECOVERYXLOG", f=name), tmp_path)
    assert calls.read_bytes().decode().split("\0")[:-1] == [
        "wal-fetch",
        "--store",
        store,
        "--cluster",
        cluster,
        name,
        "pg_wal/RECOVERYXLOG",
    ]
    assert not list(tmp_path.rglob("PWNED"))
