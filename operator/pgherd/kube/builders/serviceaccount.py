"""`<cluster>-postgres`: the ServiceAccount of the cluster's member pods and backup Jobs. Bound to no
Role and with no token mounted (docs/rbac.md, "Members' pods and backup Jobs"): they never call the
Kubernetes API, and a compromised pod gets no API credential. It exists so that these pods do not run
as the namespace's `default` account, which other workloads may have been granted rights to."""

from __future__ import annotations

from pgherd.kube import names
from pgherd.kube.builders.common import ClusterRef, Manifest, metadata


def service_account(ref: ClusterRef) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(ref, names.service_account(ref.name), names.COMPONENT_POSTGRES),
        "automountServiceAccountToken": False,
    }
