"""The PodDisruptionBudget: voluntary disruptions (node drains, evictions) keep a majority of members,
the number a failover needs (quorum-confirmed failure, R + W > N in quorum mode)."""

from __future__ import annotations

from pgherd.kube import names
from pgherd.kube.builders.common import ClusterRef, Manifest, metadata


def majority(instances: int) -> int:
    return instances // 2 + 1


def pdb(ref: ClusterRef) -> Manifest | None:
    """minAvailable = a majority of `spec.instances`; None for one instance, where any budget would
    block every drain forever (the adapter deletes an owned budget then). With two instances the
    majority is both: while both are ready no member can be evicted, and a drain waits for a person
    (scale to three first, or delete the pod by hand): two members have no majority to spare.
    `unhealthyPodEvictionPolicy: AlwaysAllow` lets a drain evict a member that is not ready anyway
    (crash-looping, seeding): it holds no vote worth protecting, and must not block the node."""
    instances = ref.spec.instances
    if instances <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(ref, names.pdb(ref.name), names.COMPONENT_POSTGRES),
        "spec": {
            "minAvailable": majority(instances),
            "selector": {"matchLabels": names.selector_labels(ref.name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
