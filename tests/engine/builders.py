"""Small builders for the engine's unit tests: a settled cluster, and members to tweak from it."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import ClusterView, EngineStatus, MemberView, Role
from pgherd.engine.quorum import steady_config
from pgherd.engine.revision import spec_revision

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
CLUSTER = "pg"


def make_spec(**fields: Any) -> PostgresClusterSpec:
    data: dict[str, Any] = {"instances": 3, "failover": {"detectionSeconds": 5}, "image": "img:1"}
    data.update(fields)
    return PostgresClusterSpec.model_validate(data)


def name(ordinal: int) -> str:
    return f"{CLUSTER}-{ordinal}"


def primary(ordinal: int, spec: PostgresClusterSpec, lsn: int = 1000, timeline: int = 1) -> MemberView:
    return MemberView(
        name(ordinal),
        ordinal,
        reachable=True,
        role=Role.PRIMARY,
        timeline=timeline,
        received_lsn=lsn,
        replayed_lsn=lsn,
        held_lsn=lsn,
        ready=True,
        revision=spec_revision(spec),
    )


def replica(
    ordinal: int, spec: PostgresClusterSpec, lsn: int = 1000, upstream: str = "pg-0", timeline: int = 1
) -> MemberView:
    return MemberView(
        name(ordinal),
        ordinal,
        reachable=True,
        role=Role.REPLICA,
        timeline=timeline,
        received_lsn=lsn,
        replayed_lsn=lsn,
        held_lsn=lsn,
        wal_receiver_streaming=True,
        upstream=upstream,
        ready=True,
        revision=spec_revision(spec),
    )


def down(member: MemberView) -> MemberView:
    """The member as the operator sees it when it cannot reach it."""
    return replace(
        member,
        reachable=False,
        role=Role.UNKNOWN,
        received_lsn=None,
        replayed_lsn=None,
        held_lsn=None,
        wal_receiver_streaming=False,
        ready=False,
        sync=None,
    )


def lost_primary(member: MemberView) -> MemberView:
    """A replica whose WAL receiver lost its primary."""
    return replace(member, wal_receiver_streaming=False, ready=False)


def settled(
    spec: PostgresClusterSpec | None = None, primary_ordinal: int = 0, lsns: dict[int, int] | None = None
) -> tuple[PostgresClusterSpec, ClusterView, EngineStatus]:
    """A Running cluster: every member streaming, quorum steady."""
    spec = spec or make_spec()
    lsns = lsns or {}
    primary_name = name(primary_ordinal)
    voters = frozenset(name(i) for i in range(spec.instances))
    config = steady_config(voters, primary_name, spec.replication_mode.value == "quorum")
    members = []
    for i in range(spec.instances):
        if i == primary_ordinal:
            members.append(replace(primary(i, spec, lsns.get(i, 1000)), sync=config))
        else:
            # A voting replica carries the sync standbys it would need as the primary (upkeep sets them).
            ready = steady_config(voters, name(i), spec.replication_mode.value == "quorum")
            members.append(replace(replica(i, spec, lsns.get(i, 1000), upstream=primary_name), sync=ready))
    view = ClusterView(CLUSTER, NOW, tuple(members), rw_member=primary_name)
    status = EngineStatus(
        initialized=True,
        complete=True,
        current_primary=primary_name,
        timeline=1,
        voters=voters,
        sync=config,
    )
    return spec, view, status


def with_members(view: ClusterView, *members: MemberView, seconds: float = 0) -> ClusterView:
    by_name = {m.name: m for m in view.members}
    for member in members:
        by_name[member.name] = member
    ordered = tuple(sorted(by_name.values(), key=lambda m: m.ordinal))
    return replace(view, members=ordered, now=view.now + timedelta(seconds=seconds))


def later(view: ClusterView, seconds: float) -> ClusterView:
    return replace(view, now=view.now + timedelta(seconds=seconds))
