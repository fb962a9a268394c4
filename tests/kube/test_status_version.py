"""status.members[].version on Kubernetes: the server version each member's agent reports (its
/status `serverVersion`), null for a member whose agent or PostgreSQL does not answer; the CRD's status
schema admits it."""

from __future__ import annotations

from datetime import UTC, datetime

from pgherd.api.cluster import PostgresClusterStatus
from pgherd.clusterstatus import members
from pgherd.engine.view import ClusterView, MemberView, Role
from pgherd_backup.agent.wire import Status


def test_each_member_shows_the_version_its_agent_reports() -> None:
    view = ClusterView(
        cluster="db",
        now=datetime.now(UTC),
        members=(
            MemberView(name="db-0", ordinal=0, exists=True, reachable=True, role=Role.PRIMARY),
            MemberView(name="db-1", ordinal=1, exists=True, reachable=True, role=Role.REPLICA),
            MemberView(name="db-2", ordinal=2, exists=True, reachable=False),
        ),
    )
    statuses = {
        "db-0": Status(member="db-0", cluster="db", role="primary", server_version="16.15"),
        "db-1": Status(member="db-1", cluster="db", role="replica", server_version="16.14"),
        "db-2": None,
    }
    listed = members(view, "db-0", statuses)
    assert [(m["name"], m["version"]) for m in listed] == [
        ("db-0", "16.15"),
        ("db-1", "16.14"),
        ("db-2", None),
    ]
    assert [m["version"] for m in members(view, "db-0")] == [None, None, None]
    parsed = PostgresClusterStatus.model_validate({"members": listed})
    assert [m.version for m in parsed.members] == ["16.15", "16.14", None]
