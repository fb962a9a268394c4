"""The PodDisruptionBudget: voluntary disruptions (node drains, evictions) keep a majority of members,
the number a failover needs (quorum-confirmed failure, R + W > N in quorum mode)."""

from __future__ import annotations

from pgherd.kube import names
from pgherd.kube.builders.common import ClusterRef, Manifest, metadata

# A majority of the members the StatefulSet has: the disruption controller rounds a percentage of
# minAvailable up, and ceil(0.51 n) = n // 2 + 1 for every n up to 49 (spec.instances is at most 15).
# A percentage, unlike a count, is the same object for every size: scaling writes no budget.
MAJORITY = "51%"


def pdb(ref: ClusterRef) -> Manifest | None:
    """minAvailable = a majority of the members (MAJORITY, of the StatefulSet's replicas); None for one
    instance, where any budget would block every drain forever (the adapter deletes an owned budget
    then). With two instances the majority is both: while both are ready no member can be evicted, and a
    drain waits for a person (scale to three first, or delete the pod by hand): two members have no
    majority to spare. Of the StatefulSet's replicas rather than of spec.instances: through a scale-down
    to two or more the members still there (and voting) keep their majority, not the smaller one of the
    new size (a scale-down to one deletes the budget at once, as before).
    `unhealthyPodEvictionPolicy: AlwaysAllow` lets a drain evict a member that is not ready anyway
    (crash-looping, seeding): it holds no vote worth protecting, and must not block the node."""
    if ref.spec.instances <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(ref, names.pdb(ref.name), names.COMPONENT_POSTGRES),
        "spec": {
            "minAvailable": MAJORITY,
            "selector": {"matchLabels": names.selector_labels(ref.name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
