"""Quorum commit: which synchronous standbys the primary waits for, and how to change that safely.

The guarantee of ``replication.mode: quorum`` is that a commit is acknowledged only once a majority
of the members, primary included, holds it. PostgreSQL provides it with
``synchronous_standby_names = 'ANY k (s1, s2, ...)'``: the primary plus any ``k`` of the listed
standbys form the *ack set* of each commit.

The engine, in turn, promotes only a member of the *voters* (the members counted for majorities,
recorded in status) and only when a majority of the voters is reachable. Failover keeps every
acknowledged commit when the reachable replicas intersect every possible ack set; the member with
the highest received LSN among them then holds all of them (WAL is a single ordered stream).

Membership changes move both sides, the voters (engine memory, changed at once) and the sync
configuration (applied by the adapter on the primary, confirmed only when observed). The resolver
below yields one step at a time, in an order where every configuration that may be in force
(confirmed or pending) keeps the invariant with the voters in force -- the shape of Patroni's
``QuorumStateResolver``, reworked for an operator that is the only one promoting:

* growing: first widen the sync set *and* raise ``k`` (``ANY k+1 (S + x)``), then add ``x`` to the
  voters; one member at a time.
* shrinking: first drop ``x`` from the voters, then narrow the sync set and lower ``k``; one member at a
  time (dropping two voters at once is unsafe: the two could be the whole replica part of an ack set).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


class QuorumError(Exception):
    """A configuration or step that would let a failover lose an acknowledged commit."""


def majority(count: int) -> int:
    """Smallest number of members that is more than half of ``count``."""
    return count // 2 + 1


@dataclass(frozen=True)
class SyncConfig:
    """``synchronous_standby_names = ANY k (standbys)``; k = 0 means asynchronous (empty setting)."""

    k: int = 0
    standbys: frozenset[str] = field(default_factory=frozenset)

    def render(self) -> str:
        """The value of synchronous_standby_names (members are application_names)."""
        if self.k == 0 or not self.standbys:
            return ""
        names = ", ".join(f'"{name}"' for name in sorted(self.standbys))
        return f"ANY {self.k} ({names})"

    def to_dict(self) -> dict[str, object]:
        return {"k": self.k, "standbys": sorted(self.standbys)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> SyncConfig:
        k = data.get("k", 0)
        standbys = data.get("standbys", [])
        if not isinstance(k, int) or not isinstance(standbys, list):
            raise ValueError(f"malformed sync configuration in status: {data!r}")
        return cls(k, frozenset(str(name) for name in standbys))


ASYNC = SyncConfig()


def steady_config(voters: Iterable[str], primary: str, quorum: bool) -> SyncConfig:
    """The target: every other voter listed, k such that the primary plus k is a majority."""
    members = frozenset(voters)
    if not quorum:
        return ASYNC
    standbys = members - {primary}
    return SyncConfig(min(majority(len(members)) - 1, len(standbys)), standbys)


def invariant_violation(voters: Iterable[str], primary: str, config: SyncConfig) -> str | None:
    """Why ``config`` on ``primary`` is unsafe with ``voters``, or None when it is safe.

    Unsafe means: some majority of the voters, not counting the primary (which is the member that
    failed), could avoid every standby of some ack set. The adversary's ack set takes as many of its
    ``k`` standbys as it can outside the voters; the others must be voters.
    """
    members = frozenset(voters)
    if primary not in members:
        return f"primary {primary} is not a voter"
    standbys = config.standbys - {primary}
    replicas = len(members) - 1
    if replicas == 0:
        return None
    needed = majority(len(members))
    if replicas < needed:
        return None  # no failover is ever possible: nothing to protect
    ack_voters = max(0, config.k - len(standbys - members))
    if replicas - ack_voters >= needed:
        return (
            f"{needed} of the {replicas} replicas could be promoted without any of the {config.k}"
            f" standbys acknowledging ({config.render() or 'asynchronous'})"
        )
    return None


def check(voters: Iterable[str], primary: str, configs: Iterable[SyncConfig]) -> None:
    """Raise QuorumError unless every configuration that may be in force is safe."""
    members = frozenset(voters)
    for config in configs:
        problem = invariant_violation(members, primary, config)
        if problem is not None:
            raise QuorumError(problem)


def failover_keeps_commits(reachable: Iterable[str], primary: str, configs: Iterable[SyncConfig]) -> bool:
    """Do the reachable replicas intersect every ack set of every configuration that may be in force?

    True when fewer than ``k`` of the listed standbys are unreachable: any ``k`` of them then include
    a reachable one. With ``k = 0`` (asynchronous) nothing is guaranteed and the answer is False, unless
    the old primary is among the reachable (fenced, started read-only). With no configuration known,
    nothing is known of the ack sets: False.
    """
    seen = frozenset(reachable)
    if primary in seen:
        return True  # the old primary itself, fenced and read-only: it holds every commit it acknowledged
    configs = list(configs)
    if not configs:
        return False
    for config in configs:
        standbys = config.standbys - {primary}
        if config.k == 0 or len(standbys - seen) >= config.k:
            return False
    return True


@dataclass(frozen=True)
class VotersStep:
    """Change the voters (engine memory only: takes effect when the status is written)."""

    voters: frozenset[str]


@dataclass(frozen=True)
class SyncStep:
    """Set synchronous_standby_names on the primary; wait until it is observed before the next step."""

    config: SyncConfig


QuorumStep = VotersStep | SyncStep


def next_step(
    voters: frozenset[str],
    primary: str,
    config: SyncConfig,
    wanted_voters: frozenset[str],
    quorum: bool,
) -> QuorumStep | None:
    """The next safe step from (voters, config) towards wanted_voters and its steady config.

    ``config`` is the configuration confirmed on the primary; the caller must not ask for a step while
    a previous SyncStep is unconfirmed. The primary is never removed from the voters here (switch over
    first). Members are added and removed one at a time, in name order, so the answer is deterministic.
    """
    wanted = wanted_voters | {primary}
    if not quorum:
        if config != ASYNC:
            return SyncStep(ASYNC)
        return VotersStep(wanted) if wanted != voters else None
    steady = steady_config(voters, primary, quorum)
    to_remove = sorted(voters - wanted)
    to_add = sorted(wanted - voters)
    if to_add and not to_remove:
        grown = voters | {to_add[0]}
        wider = steady_config(grown, primary, quorum)
        if config == wider:
            return VotersStep(grown)  # the wider set is confirmed: the new member may now count
        if config == steady:
            return SyncStep(wider)  # raise k and widen first
    if config != steady:
        return SyncStep(steady)  # settle before (or after) a membership change
    if to_remove:
        return VotersStep(voters - {to_remove[-1]})
    return None
