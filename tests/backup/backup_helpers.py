"""Small helpers shared by the data-plane tests."""

from __future__ import annotations

from typing import Any

from pgherd_backup.postgres import config

TRACEBACK = "Traceback (most recent call last)"


def fill(instance: Any, rows: int = 20000) -> None:
    """A few tables with varied content (text, numbers, a bytea that does not compress)."""
    instance.sql(
        "CREATE TABLE IF NOT EXISTS items (id int PRIMARY KEY, label text, amount numeric, payload bytea)"
    )
    instance.sql(
        "INSERT INTO items SELECT g, md5(g::text), g * 1.5, decode(md5(random()::text), 'hex') "
        f"FROM generate_series(1, {rows}) g ON CONFLICT DO NOTHING"
    )
    instance.sql("CREATE TABLE IF NOT EXISTS events (at timestamptz DEFAULT clock_timestamp(), note text)")


def random_blob_table(instance: Any, megabytes: int) -> None:
    """Incompressible data: ~1 KiB of random bytes per row."""
    instance.sql("CREATE TABLE IF NOT EXISTS blobs (id serial, data bytea)")
    instance.sql("ALTER TABLE blobs ALTER COLUMN data SET STORAGE EXTERNAL")
    instance.sql(
        "INSERT INTO blobs (data) SELECT (SELECT string_agg(decode(md5(random()::text || g::text || s::text), 'hex'), '') "
        f"FROM generate_series(1, 64) s) FROM generate_series(1, {megabytes * 1024}) g"
    )


def set_port(instance: Any) -> None:
    config.update_pgherd_conf(instance.pgdata, {"port": instance.port})


def run_restore_command(
    command: str,
    name: str,
    pgdata: Any,
    dest: str = "pg_wal/RECOVERYXLOG",
    env: dict[str, str] | None = None,
) -> int:
    """Run a restore_command as PostgreSQL does: %f, %p and %% replaced, through sh, in the data
    directory (with `env` added to the environment); returns its exit status."""
    import os
    import re
    import subprocess

    line = re.sub(r"%([fp%])", lambda m: {"f": name, "p": dest, "%": "%"}[m.group(1)], command)
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(["sh", "-c", line], cwd=pgdata, env=full_env, timeout=60).returncode


def recording_agent(directory: Any) -> tuple[str, Any]:
    """A stand-in for pgherd-backup that records its arguments and answers "not archived" (exit 1):
    (its path, the file its calls are written to)."""
    calls = directory / "agent-calls"
    agent = directory / "recording-agent"
    agent.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 1\n')
    agent.chmod(0o755)
    return str(agent), calls
