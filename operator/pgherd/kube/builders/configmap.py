"""`<cluster>-config`: the user's PostgreSQL parameters (`spec.parameters`) as `parameters.conf`, over
the replication timing derived from `spec.failover.detectionSeconds`,
mounted in every member at names.CONFIG_MOUNT and read by the agent (`--parameters-file`) again at each
start. The mount is a whole-directory ConfigMap volume (no subPath) so that the kubelet refreshes it in
place; settings PostgreSQL applies on reload take effect without a restart, and those that need one
change the spec revision, which the operator rolls out member by member."""

from __future__ import annotations

from collections.abc import Mapping

from pgherd.kube import names
from pgherd.kube.builders.common import ClusterRef, Manifest, metadata
from pgherd_backup.postgres import parameters as user_parameters


def render_parameters(parameters: Mapping[str, str] | None) -> str:
    """The file the agent's read_parameters parses back to the same strings; a parameter no user may
    set is refused here (ValueError naming it) rather than written for every member to refuse."""
    return user_parameters.render(parameters)


def configmap(ref: ClusterRef) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(ref, names.configmap(ref.name), names.COMPONENT_POSTGRES),
        "data": {
            names.PARAMETERS_FILE: render_parameters(
                {
                    **user_parameters.replication_timing(ref.spec.failover.detection_seconds),
                    **(ref.spec.parameters or {}),
                }
            )
        },
    }
