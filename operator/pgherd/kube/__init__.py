"""The Kubernetes platform adapter: `pgherd operator` on kopf (see docs/kube.md).

``names``: every name, label, port and path the adapter, its builders and the pods agree on.
``builders``: pure functions, one module per kind of object, from a cluster to its object specs.
"""
