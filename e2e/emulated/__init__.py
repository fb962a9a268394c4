"""An emulated Kubernetes cluster running the real pgherd operator, for the e2e suite's `kube-emulated`
driver and for people: `python -m e2e.emulated up --dir DIR`, then `kubectl --kubeconfig DIR/kubeconfig`.

Test support only (never installed). The parts: tests/kube/emulator.py (the API server),
tests/kube/cluster_sim.py (the node: pods as local processes, StatefulSet and Job controllers), an S3
server, and `pgherd operator` as a local process started from the chart's rendered Deployment (see
chart.py), authenticated as the chart's ServiceAccount, whose rendered RBAC the API server enforces.
What is and is not emulated: docs/e2e.md.
"""
