"""A primary that can reach neither the operator nor enough of its replicas fences itself.

In async mode a primary cut off from everything but some clients (a node partitioned, its kubelet with
it, so that the operator's fence cannot land) goes on acknowledging writes that a promoted replica will
never have. The operator bounds that window: with every /status it sends an order (the header
ISOLATION_HEADER: `seconds=S;peers=P`), and when the agent has heard no authorized request for S
seconds and fewer than P replicas replied over the replication protocol within S seconds, it fences
itself (PostgreSQL stopped, kept stopped; the operator sends Unfence again once it sees its recorded
primary fenced with nothing promoted, engine/failover.unfence_again). In quorum mode a primary cut off
from the standbys acknowledges nothing anyway: it is left running. An agent never ordered (a test's,
or an operator that does not send one) never fences itself.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import psycopg

log = logging.getLogger("pgherd.agent")

ISOLATION_HEADER = "X-Pgherd-Isolation"


@dataclass(frozen=True)
class IsolationOrder:
    """Fence itself after `seconds` without the operator and with fewer than `peers` replicas replying."""

    seconds: float
    peers: int

    def render(self) -> str:
        return f"seconds={self.seconds:g};peers={self.peers}"

    @classmethod
    def parse(cls, text: str | None) -> IsolationOrder | None:
        """The header's order; None when absent or not understood (then nothing changes)."""
        if not text:
            return None
        try:
            fields = dict(part.strip().split("=", 1) for part in text.split(";") if part.strip())
            order = cls(float(fields["seconds"]), int(fields["peers"]))
        except (KeyError, ValueError):
            return None
        return order if order.seconds > 0 and order.peers >= 0 else None


class Isolation:
    """When the operator was last heard from, and its last order (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._heard = time.monotonic()
        self._order: IsolationOrder | None = None

    def heard_operator(self, order: IsolationOrder | None) -> None:
        with self._lock:
            self._heard = time.monotonic()
            if order is not None:
                self._order = order

    def due(self) -> IsolationOrder | None:
        """The order, when the operator has been silent for its `seconds`."""
        with self._lock:
            order = self._order
            if order is None or order.peers == 0 or time.monotonic() - self._heard < order.seconds:
                return None
            return order


_QUERY = """
SELECT pg_is_in_recovery(),
       current_setting('synchronous_standby_names'),
       (SELECT count(*) FROM pg_stat_replication WHERE reply_time >= now() - make_interval(secs => %s))
"""


def isolated(conn: psycopg.Connection[tuple[object, ...]], order: IsolationOrder) -> str | None:
    """Why this member, a primary in async mode, is cut off (None when it is not, or is no such primary)."""
    row = conn.execute(_QUERY, (order.seconds,)).fetchone()
    if row is None:
        return None
    in_recovery, sync, replying = row
    if in_recovery or sync:
        return None  # a replica writes nothing; a quorum primary acknowledges nothing alone
    replying = int(str(replying))
    if replying >= order.peers:
        return None
    return (
        f"no word from the operator for {order.seconds:g}s and {replying} of the {order.peers} replicas"
        f" needed replied within it: fencing itself, so that a primary cut off stops taking writes"
    )
