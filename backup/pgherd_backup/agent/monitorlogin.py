"""Who the agent's kept connections log in as: pgherd_monitor (pg_monitor's rights, no password), else
the superuser while that role cannot log in: a replica whose primary has not created it yet, every
connection slot but the superuser's taken. Used by the probes' view (view.py) and the WAL receiver's
watch (upstream.py)."""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg

from pgherd_backup.agent.instance import Instance
from pgherd_backup.agent.seeding import MONITOR_ROLE

log = logging.getLogger("pgherd.agent")

# When pgherd_monitor cannot log in (a replica whose primary has not created it yet, every connection slot
# but the superuser's taken), a reader reads as the superuser, and tries pgherd_monitor again this often.
MONITOR_RETRY = 60.0


class MonitorLogin:
    """Who a kept connection logs in as: pgherd_monitor, else the superuser until MONITOR_RETRY has passed
    (the probes' view, the WAL receiver's watch). `who` names the reader in the log."""

    def __init__(self, inst: Instance, who: str, statement_timeout: float, application: str = "pgherd-agent"):
        self.inst = inst
        self.who = who
        self.statement_timeout = statement_timeout
        self.application = application
        self._superuser_until = 0.0  # reading as the superuser until then

    def retry_due(self) -> bool:
        """A superuser connection is kept until pgherd_monitor is to be tried again."""
        return bool(self._superuser_until) and time.monotonic() >= self._superuser_until

    def as_monitor(self) -> psycopg.Connection[Any]:
        conn = self.connect(MONITOR_ROLE)
        if self._superuser_until:
            log.info("%s read PostgreSQL as %s again", self.who, MONITOR_ROLE)
            self._superuser_until = 0.0
        return conn

    def as_superuser(self, refused: psycopg.OperationalError) -> psycopg.Connection[Any]:
        """Raised when PostgreSQL does not answer; `refused`: pgherd_monitor's refusal."""
        conn = self.connect(None)
        self.fell_back(_last_line(refused))
        return conn

    def fell_back(self, refused: str) -> None:
        if not self._superuser_until:
            log.warning(
                "%s read PostgreSQL as the superuser for now: %s cannot log in (%s); on a replica it comes "
                "by replication once the primary's agent has created it",
                self.who,
                MONITOR_ROLE,
                refused,
            )
        self._superuser_until = time.monotonic() + MONITOR_RETRY

    def connect(self, user: str | None) -> psycopg.Connection[Any]:
        """A connection as `user` (None: the superuser), on the Unix socket."""
        return self.inst.open_local(
            timeout=1, statement_timeout=self.statement_timeout, user=user, application=self.application
        )


def _last_line(exc: Exception) -> str:
    """A refused connection says why on its last line."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
