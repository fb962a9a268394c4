"""The roles a new cluster's first member creates after initdb (the replication account with its rewind
grants, the application's owner and database): a concurrent catalog update, such as the agent's own
probe granting the rewind functions at the same moment, must not leave the cluster without them."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg

from pgherd_backup.agent import seeding
from pgherd_backup.agent.credentials import SecretFile


def _inst(dsn: str, folder: Path) -> Any:
    """What _create_roles reads of an Instance, on a real PostgreSQL."""
    (folder / "replication").write_text("replication-secret\n")
    (folder / "app").write_text("app-secret\n")

    @contextlib.contextmanager
    def connect(timeout: float = 2.0, statement_timeout: float | None = None) -> Iterator[Any]:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=max(1, int(timeout))) as conn:
            yield conn

    return SimpleNamespace(
        options=SimpleNamespace(
            superuser="postgres",
            replication_role="replication",
            app_user="app",
            app_database="app",
            start_timeout=30.0,
        ),
        credentials=SimpleNamespace(
            replication_password=SecretFile(folder / "replication", "replication password"),
            app_password=SecretFile(folder / "app", "application password"),
        ),
        wait_accepting=lambda timeout: "primary",
        connect=connect,
    )


def _wait_blocked(dsn: str, pid_of_other: int) -> None:
    deadline = time.monotonic() + 20
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> %s",
                (pid_of_other,),
            ).fetchone()
            if row and row[0]:
                return
            time.sleep(0.05)
    raise AssertionError("the seeding's grant never waited on the concurrent one")


def test_the_roles_are_created_despite_a_concurrent_grant(pg_factory, tmp_path):
    pg = pg_factory("seeded").initdb().start()
    # a first attempt got as far as the replication role (or the probe saw it): the next step is its grants
    pg.sql("CREATE ROLE replication LOGIN REPLICATION")
    inst = _inst(pg.dsn, tmp_path)

    other = psycopg.connect(pg.dsn)  # the probe's transaction, updating pg_proc's rows first
    other.execute("GRANT EXECUTE ON FUNCTION pg_catalog.pg_ls_dir(text, boolean, boolean) TO replication")
    other_pid = other.info.backend_pid
    failure: list[BaseException] = []

    def create() -> None:
        try:
            seeding._create_roles(inst)
        except BaseException as exc:  # reported by the assertion below
            failure.append(exc)

    worker = threading.Thread(target=create)
    worker.start()
    try:
        _wait_blocked(pg.dsn, other_pid)
    finally:
        other.commit()  # the seeding's update now finds the row changed under it
        other.close()
    worker.join(60)
    assert not worker.is_alive()
    assert not failure, failure
    assert (
        pg.value("SELECT count(*) FROM pg_roles WHERE rolname IN ('app', 'replication', 'pgherd_monitor')")
        == 3
    )
    assert pg.value("SELECT count(*) FROM pg_database WHERE datname = 'app'") == 1
    assert pg.value(
        "SELECT has_function_privilege('replication', 'pg_catalog.pg_read_binary_file(text)', 'EXECUTE')"
    )
