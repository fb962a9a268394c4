"""Pure builders of the Kubernetes objects a PostgresCluster owns: one module per kind.

Each function takes a `ClusterRef` (the cluster's identity, spec, resolved image and revision) and
returns a plain dict, ready to send to the API server: no I/O, no clock, no randomness. The only
exceptions are the `generate_*` functions of `secrets`, which make new random credentials and
certificates, and are named so. Names, labels, ports and paths come from `pgherd.kube.names`.
docs/kube.md ("Objects a cluster owns") says why each notable setting is what it is.
"""

from __future__ import annotations

from pgherd.kube.builders.common import ClusterRef, metadata, owner_reference, resolve_image

__all__ = ["ClusterRef", "metadata", "owner_reference", "resolve_image"]
