"""A real single-node Kubernetes on this machine, for the e2e suite's `localkube` driver and for people:
`python -m e2e.localkube up --dir DIR`, then `kubectl --kubeconfig DIR/kubeconfig ...`, then
`python -m e2e.localkube down --dir DIR`.

Every component is a real one, run as a plain process with its state under DIR: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler (built from Kubernetes' Go modules by
scripts/ensure-kubernetes.sh), containerd and runc (Debian's), the kubelet and kube-proxy; pods get
addresses on a bridge (Debian's CNI plugins). Add-ons: CoreDNS (cluster DNS) and
local-path-provisioner (the default StorageClass, as in kind), an S3 server (`rclone serve s3`) on the
bridge, the project's image loaded into containerd, and the chart installed by helm as the README says.
Only one such cluster runs on a machine at a time (see lock.py). Why each setting is what it is:
NOTES.md beside this file.

The modules, in the order `up` uses them: settings (addresses, ports, the layout of DIR), lock,
state (DIR/state.json), binaries, host (bridge, sysctls, cgroups), certs, control_plane, node,
images, dns, storage, s3, chart; up.py and down.py put them together.
"""
