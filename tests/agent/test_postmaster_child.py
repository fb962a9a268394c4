"""PostmasterChild on a real PostgreSQL, in this process: what makes an exit a crash, and what a start
clears first. A crash must be restarted at once, whatever the moment it comes and whatever the dead
postmaster left running."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from pgherd_backup.agent import supervisor
from pgherd_backup.agent.supervisor import PostmasterChild, PostmasterState, pid_file_status
from pgherd_backup.postgres import postmaster


class Watched:
    """A PostmasterChild of a PgInstance's data directory, whose crash reports are recorded."""

    def __init__(self, pg) -> None:
        self.pg = pg
        self.crashed = threading.Event()
        self.codes: list[int] = []
        self.child = PostmasterChild(
            pg.pgdata,
            bins=pg.bins,
            log_file=postmaster.default_log_file(pg.pgdata),
            env=dict,
            on_crash=self._on_crash,
        )

    def _on_crash(self, code: int) -> None:
        self.codes.append(code)
        self.crashed.set()

    def start(self) -> bool:
        return self.child.start(lambda: None, timeout=30)


@pytest.fixture
def watched(pg_factory) -> Iterator[Watched]:
    pg = pg_factory("child").initdb()
    made = Watched(pg)
    yield made
    made.child.shutdown(stop_timeout=5)
    postmaster.kill_leftovers(pg.pgdata)


def test_an_exit_after_it_accepted_connections_is_a_crash_even_before_its_start_looked(
    watched: Watched, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The start looks at postmaster.pid rarely: a client (the operator's /status, a test) sees the server
    # accept connections first, and the kill comes before the start has seen it.
    monkeypatch.setattr(supervisor, "_START_POLL", 2.0)
    outcome: list[object] = []

    def start() -> None:
        try:
            outcome.append(watched.start())
        except Exception as exc:
            outcome.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    pgdata = watched.child.pgdata
    deadline = time.monotonic() + 30
    while watched.child.pid is None or pid_file_status(pgdata, watched.child.pid) != "ready":
        assert time.monotonic() < deadline, "PostgreSQL did not start"
        time.sleep(0.002)
    os.kill(watched.child.pid, signal.SIGKILL)

    # Reported as a crash at once (the agent restarts it), not left for the start to call a failed start.
    assert watched.crashed.wait(1.5), "an exit after the server accepted connections was not reported"
    assert watched.codes == [-signal.SIGKILL]
    assert watched.child.exit_is_crash and watched.child.state is PostmasterState.CRASHED
    starter.join(10)
    assert outcome == [True], "the start failed although the server had accepted connections"


def test_a_start_kills_what_a_dead_postmaster_left_running(watched: Watched) -> None:
    assert watched.start()
    pgdata = watched.child.pgdata

    def long_query() -> None:
        # Counting in a tight loop: a backend notices its postmaster's death only when it next waits.
        with contextlib.suppress(psycopg.Error), psycopg.connect(watched.pg.dsn, autocommit=True) as conn:
            conn.execute("SELECT count(*) FROM generate_series(1, 1000000000)")

    threading.Thread(target=long_query, daemon=True).start()
    counting = (
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND pid <> pg_backend_pid() "
        "AND query LIKE '%generate_series%'"
    )
    watched.pg.wait_until(lambda: watched.pg.value(counting) == 1, "the long query")
    assert watched.child.pid is not None
    os.kill(watched.child.pid, signal.SIGKILL)  # the postmaster alone (its OOM kill, a kill -9)
    assert watched.crashed.wait(5)
    assert postmaster.leftovers(pgdata), "the backend in its long query did not outlive its postmaster"

    started = time.monotonic()
    assert watched.start()  # not "pre-existing shared memory block ... is still in use"
    assert time.monotonic() - started < 5
    assert watched.child.state is PostmasterState.RUNNING
    assert not postmaster.leftovers(pgdata)
