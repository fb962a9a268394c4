"""What every decision module reads (the inputs and facts derived from them) and what it returns."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from pgherd.api.cluster import Phase, PostgresClusterSpec, ReplicationMode
from pgherd.engine.actions import Action
from pgherd.engine.quorum import majority
from pgherd.engine.status import EngineStatus
from pgherd.engine.view import ClusterView, MemberView, Role, member_name, ordinal_of

# A replica at most this far behind the primary counts as caught up for rollout steps and backups
# (one WAL segment). A switchover target must match the old primary's final LSN exactly.
CATCH_UP_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Context:
    spec: PostgresClusterSpec
    view: ClusterView
    status: EngineStatus
    revision: str

    @property
    def now(self) -> datetime:
        return self.view.now

    @property
    def quorum_mode(self) -> bool:
        return self.spec.replication_mode is ReplicationMode.QUORUM

    @property
    def detection(self) -> timedelta:
        return timedelta(seconds=self.spec.failover.detection_seconds)

    def expected_names(self) -> list[str]:
        return [member_name(self.view.cluster, i) for i in range(self.spec.instances)]

    @property
    def kept_member(self) -> str | None:
        """The replica kept fenced on the old major after an upgrade, until it is confirmed."""
        return self.status.kept.member if self.status.kept is not None else None

    def wanted(self, name: str) -> bool:
        return ordinal_of(name) < self.spec.instances

    def primary(self) -> MemberView | None:
        """The recorded primary's view, whatever its state."""
        return self.view.member(self.status.current_primary)

    def healthy_primary(self) -> MemberView | None:
        member = self.primary()
        return member if member is not None and member.is_primary else None

    def voter_views(self) -> list[MemberView]:
        return [m for m in (self.view.member(n) for n in sorted(self.status.voters)) if m is not None]

    def needed(self) -> int:
        return majority(len(self.status.voters))

    def reachable_voters(self) -> list[MemberView]:
        """Voters the operator reaches that cannot write behind its back: unfenced members, and
        fenced ones running read-only as standbys (Demote)."""
        return [m for m in self.voter_views() if m.reachable and (not m.fenced or m.role is Role.REPLICA)]

    def lag(self, member: MemberView) -> int | None:
        """Bytes behind the primary; None when unknown (unreachable, or no primary)."""
        primary = self.healthy_primary()
        if primary is None or primary.received_lsn is None or member.received_lsn is None:
            return None
        return max(0, primary.received_lsn - member.received_lsn)

    def caught_up(self, member: MemberView) -> bool:
        lag = self.lag(member)
        primary = self.status.current_primary
        return (
            primary is not None and member.streams_from(primary) and lag is not None and lag <= CATCH_UP_BYTES
        )

    def on_current_timeline(self, member: MemberView) -> bool:
        return self.status.timeline is None or member.timeline == self.status.timeline

    def healthy_replicas(self) -> list[MemberView]:
        """Replicas streaming from the primary, ready, on its timeline."""
        primary = self.status.current_primary
        if primary is None:
            return []
        return [
            m
            for m in self.view.existing()
            if m.name != primary
            and m.streams_from(primary)
            and m.ready
            and not m.fenced
            and self.on_current_timeline(m)
        ]


def by_most_data(member: MemberView) -> tuple[int, int, bool, str]:
    """Sort key: the most WAL the member provably holds, then the highest replayed LSN, then one whose
    agent carries out no action (it takes an order at once), then name.

    Not the received LSN first: a restarted replica's pg_last_wal_receive_lsn() starts again at the
    segment where streaming resumes, below WAL it already holds."""
    return (-(member.most_wal or 0), -(member.replayed_lsn or 0), member.busy, member.name)


def cannot_write(member: MemberView | None) -> bool:
    """Evidence that ``member`` cannot accept a write: it is gone, the platform confirms its PostgreSQL
    stopped, or it answers as a read-only standby. Being asked to fence (``fenced``) is not evidence:
    a fence that has not landed leaves a primary running, and an unreachable member may be running."""
    if member is None or not member.exists or member.stopped:
        return True
    return member.reachable and member.role is Role.REPLICA


def data_lost(member: MemberView | None) -> bool:
    """Positive evidence that the member's data is gone (its volume or data directory). A member the
    operator merely cannot reach, or one not observed at all, keeps its data as far as we know."""
    return member is not None and not member.data_present


@dataclass(frozen=True)
class Outcome:
    """One decision module's answer; decide() adds the common conditions around it."""

    phase: Phase
    status: EngineStatus
    actions: tuple[Action, ...] = ()
    message: str = ""  # why it waits, or what it does
