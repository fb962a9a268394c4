"""A member whose agent does not answer is fenced by deleting its pod, and the deletion must be graceful:
the pod object stays (Terminating) until its kubelet confirms that every process of it is gone. A
deletion with a grace period of 0 removes the object at once, unconfirmed: the StatefulSet then makes
the member's pod again on the same volume while the old PostgreSQL may still run there (a frozen or
partitioned node), and two postmasters write one data directory. Played on a real API server without a
kubelet: the pod is bound to a node nobody runs, so only a graceful deletion leaves it in place."""

from __future__ import annotations

import asyncio

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import actions as act
from pgherd.kube import names
from pgherd.kube.actions import ActContext, apply_all
from pgherd.kube.agents import Agents
from pgherd.kube.api import KubeApi
from pgherd.kube.events import Events
from pgherd.kube.observe import ClusterObjects, slice_summary
from pgherd.kube.restores import Restores
from pgherd.local.ports import free_port

from .realkube import JSON, ChartIdentity, Kube
from .test_operator import cluster_manifest


def test_an_unanswering_member_is_fenced_by_a_deletion_its_kubelet_must_confirm(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    ns = namespace
    kube.create(cluster_manifest(ns))
    kube.create(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}}
    )
    pod = kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "hippo-0",
                "namespace": ns,
                "labels": {names.LABEL_CLUSTER: "hippo", names.LABEL_ROLE: names.ROLE_PRIMARY},
            },
            "spec": {
                "nodeName": "node-a",  # bound: its kubelet (none here) must confirm the deletion
                "containers": [{"name": names.CONTAINER_POSTGRES, "image": "pgherd:test"}],
            },
        }
    )
    pod["status"] = {
        "phase": "Running",
        "podIP": "127.0.0.1",
        "containerStatuses": [{"name": names.CONTAINER_POSTGRES, "state": {"running": {}}, "started": True}],
    }
    apply_as_operator(
        kube, ns, chart_operator, [pod], (act.Fence("hippo-0", reason="primary hippo-0 failed"),)
    )
    left = kube.read("pods", ns, "hippo-0")
    assert left is not None, "the pod was removed unconfirmed (a grace period of 0): two postmasters may run"
    assert left["metadata"].get("deletionTimestamp"), left["metadata"]
    assert (left["metadata"].get("deletionGracePeriodSeconds") or 0) > 0, left["metadata"]
    # Out of -rw: a terminating pod may still serve through kube-proxy while no other is ready.
    assert names.LABEL_ROLE not in (left["metadata"].get("labels") or {}), left["metadata"]


def apply_as_operator(
    kube: Kube, ns: str, chart_operator: ChartIdentity, pods: list[JSON], actions: tuple[act.Action, ...]
) -> None:
    """The actions carried out by the operator's code as the chart's identity, on the -rw slice as the
    API server has it (what the operator's watch would show); no agent answers."""
    cluster = kube.read("postgresclusters", ns, "hippo")
    assert cluster is not None
    found = kube.read("endpointslices", ns, names.rw_slice("hippo"))
    rw_slices = [] if found is None else [slice_summary(found)]

    async def scenario() -> None:
        api = KubeApi(chart_operator.credentials())
        agents = Agents("hippo", token="t", ca_pem=None, server_hostname=lambda _: None, scheme="http")
        agents.port = free_port()  # nothing listens there: the agent does not answer
        events = Events(api)
        context = ActContext(
            api=api,
            objects=ClusterObjects(cluster=cluster, pods=pods, rw_slices=rw_slices),
            spec=PostgresClusterSpec.model_validate(cluster["spec"]),
            statuses={},
            agents=agents,
            current_primary="hippo-0",
            member_address=lambda member: f"{member}.hippo-headless:5432",
            may_act=lambda: True,
            snapshot_job=lambda backup, member, host: {},
            prune_job=lambda action: {},
            event=lambda action: events.post(cluster, action),
            event_on=events.record,
            restores=Restores(api, ns, "hippo"),
        )
        try:
            await apply_all(context, actions)
        finally:
            await agents.close()
            await api.close()

    asyncio.run(scenario())
