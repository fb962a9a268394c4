"""A rolling restart asked for (annotation pgherd.io/restart, `kubectl pgherd restart`): the operator, as
the chart's ServiceAccount against the real API server, gives the StatefulSet's pod template the
revision the engine computes with the request, so that each member the rollout restarts comes back at
it. (No pod runs here: the rollout itself is the engine's, tests/engine/test_restart_request.py.)"""

from __future__ import annotations

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine.revision import spec_revision
from pgherd.kube import names

from .realkube import ChartIdentity, Kube, running_as
from .waiting import eventually

ASKED = "2026-01-01T12:00:00Z"


def _template(kube: Kube, ns: str) -> tuple[str, str] | None:
    sts = kube.read("statefulsets", ns, "hippo")
    if sts is None:
        return None
    template = sts["spec"]["template"]
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == names.CONTAINER_POSTGRES]
    return str(template["metadata"]["labels"][names.LABEL_REVISION]), str(container["image"])


def test_the_restart_request_is_the_templates_revision(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    spec = {"instances": 3, "postgresVersion": 16, "storage": {"size": "1Gi"}}
    kube.create({"apiVersion": "pgherd.io/v1alpha1", "kind": "PostgresCluster",
                 "metadata": {"name": "hippo", "namespace": namespace}, "spec": spec})  # fmt: skip
    parsed = PostgresClusterSpec.model_validate(spec)
    with running_as(chart_operator):
        before, image = eventually(lambda: _template(kube, namespace), what="the StatefulSet")
        assert before == spec_revision(parsed, image)
        kube.merge(
            "postgresclusters",
            namespace,
            "hippo",
            {"metadata": {"annotations": {"pgherd.io/restart": ASKED}}},
        )
        wanted = spec_revision(parsed, image, ASKED)
        assert wanted != before
        eventually(
            lambda: (t := _template(kube, namespace)) is not None and t[0] == wanted, what="the new revision"
        )
