"""The sandbox's status.json is the document Kubernetes writes (pgherd/clusterstatus.py), with the
sandbox's own keys beside: a member is ready by its agent's word, LSNs as PostgreSQL prints them,
conditions with their transition times."""

from __future__ import annotations

from collections.abc import Callable

from local_helpers import LocalCluster

from pgherd.engine import decide
from pgherd.engine.lsn import parse_lsn
from pgherd.local.layout import read_json
from pgherd.local.supervisor import Supervisor


def test_the_sandbox_writes_the_shared_status_document(local_cluster: Callable[..., LocalCluster]) -> None:
    cluster = local_cluster(2)
    primary, replica = cluster.name(0), cluster.name(1)
    cluster.wait_streaming(replica)
    supervisor = Supervisor(cluster.paths.root)
    view, seen = supervisor.platform.view(cluster.spec, None)
    decision = decide(cluster.spec, view, supervisor.engine_status())

    supervisor.write_status(decision, view, seen)

    written = read_json(cluster.paths.status_file, {}) or {}
    members = {m["name"]: m for m in written["members"]}
    assert set(members) == {primary, replica}
    for name, member in members.items():
        assert member["ready"] is True and member["reachable"] is True, member
        assert parse_lsn(member["receivedLSN"]) > 0, member  # text, as PostgreSQL prints it
        assert member["port"] == supervisor.platform.members[name].port
        assert member["dsn"] and member["agent"]
    assert members[replica]["streaming"] is True
    assert written["readyInstances"] == 2 and written["instances"] == 2
    assert all(c["lastTransitionTime"] for c in written["conditions"])
    # A second write keeps each condition's transition time while its status holds.
    since = {c["type"]: c["lastTransitionTime"] for c in written["conditions"]}
    supervisor.write_status(decision, view, seen)
    again = read_json(cluster.paths.status_file, {}) or {}
    assert {c["type"]: c["lastTransitionTime"] for c in again["conditions"]} == since
