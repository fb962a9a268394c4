"""The default StorageClass: local-path-provisioner (the provisioner of kind's and k3s' default class,
built by scripts/ensure-kubernetes.sh), run as a process, makes a directory under DIR/volumes for each
claim through a helper pod, and removes it when the volume is released (reclaimPolicy Delete).

Why not kube-controller-manager's built-in hostPath provisioner (`--enable-hostpath-provisioner`, as
hack/local-up-cluster.sh uses): it makes `/tmp/hostpath_pv/<uuid>` (a fixed path outside DIR) owned by
root with mode 0750, and the kubelet applies no fsGroup to hostPath volumes, so a pod of the restricted
profile (pgherd's run as uid 999 with fsGroup 999) cannot write to its own volume. The volumes here are
`local` PersistentVolumes (the class's defaultVolumeType), pinned to the node, and the kubelet gives
them the pod's fsGroup, as it does a cloud disk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from e2e.localkube.certs import STORAGE
from e2e.localkube.kubectl import Kubectl
from e2e.localkube.processes import Process, start, wait_until
from e2e.localkube.settings import BUSYBOX_IMAGE, STORAGE_CLASS, Layout

NAMESPACE = "local-path-storage"
SERVICE_ACCOUNT = "local-path-provisioner-service-account"
PROVISIONER = "rancher.io/local-path"
CONFIG_MAP = "local-path-config"

SETUP = """#!/bin/sh
set -eu
mkdir -m 0777 -p "$VOL_DIR"
"""
TEARDOWN = """#!/bin/sh
set -eu
rm -rf "$VOL_DIR"
"""
HELPER_POD = f"""apiVersion: v1
kind: Pod
metadata:
  name: helper-pod
spec:
  containers:
  - name: helper-pod
    image: {BUSYBOX_IMAGE}
    imagePullPolicy: Never
"""


def objects(layout: Layout) -> list[dict[str, Any]]:
    """Its namespace, the helper pods' ServiceAccount, the ConfigMap the helper pods mount their scripts
    from, its RBAC (the project's deploy/local-path-storage.yaml rules, granted to its certificate's
    user) and the default StorageClass."""
    rbac = "rbac.authorization.k8s.io/v1"
    user = {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": STORAGE.user}
    config = {"nodePathMap": [{"node": "DEFAULT_PATH_FOR_NON_LISTED_NODES", "paths": [str(layout.volumes)]}]}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": SERVICE_ACCOUNT, "namespace": NAMESPACE},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": CONFIG_MAP, "namespace": NAMESPACE},
            "data": {
                "config.json": json.dumps(config),
                "setup": SETUP,
                "teardown": TEARDOWN,
                "helperPod.yaml": HELPER_POD,
            },
        },
        {
            "apiVersion": rbac,
            "kind": "ClusterRole",
            "metadata": {"name": "localkube:local-path-provisioner"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["nodes", "persistentvolumeclaims", "configmaps", "pods", "pods/log"],
                    "verbs": ["get", "list", "watch"],
                },
                {
                    "apiGroups": [""],
                    "resources": ["persistentvolumes"],
                    "verbs": ["get", "list", "watch", "create", "patch", "update", "delete"],
                },
                {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
                {
                    "apiGroups": ["storage.k8s.io"],
                    "resources": ["storageclasses"],
                    "verbs": ["get", "list", "watch"],
                },
            ],
        },
        {
            "apiVersion": rbac,
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "localkube:local-path-provisioner"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "localkube:local-path-provisioner",
            },
            "subjects": [user],
        },
        {
            "apiVersion": rbac,
            "kind": "Role",
            "metadata": {"name": "localkube:local-path-provisioner", "namespace": NAMESPACE},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["pods"],
                    "verbs": ["get", "list", "watch", "create", "patch", "update", "delete"],
                }
            ],
        },
        {
            "apiVersion": rbac,
            "kind": "RoleBinding",
            "metadata": {"name": "localkube:local-path-provisioner", "namespace": NAMESPACE},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "localkube:local-path-provisioner",
            },
            "subjects": [user],
        },
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {
                    "storageclass.kubernetes.io/is-default-class": "true",
                    "defaultVolumeType": "local",
                },
            },
            "provisioner": PROVISIONER,
            # The provisioner needs the node a claim's pod is scheduled to (a local volume is pinned to it).
            "volumeBindingMode": "WaitForFirstConsumer",
            "reclaimPolicy": "Delete",
        },
    ]


def local_path_provisioner(layout: Layout, bin_dir: Path, kubectl: Kubectl) -> Process:
    layout.volumes.mkdir(parents=True, exist_ok=True)
    kubectl.apply(objects(layout))
    argv = [
        str(bin_dir / "local-path-provisioner"), "--debug", "start",
        "--kubeconfig", str(layout.component_kubeconfig(STORAGE.name)),
        "--namespace", NAMESPACE, "--configmap-name", CONFIG_MAP,
        "--service-account-name", SERVICE_ACCOUNT,
        "--helper-image", BUSYBOX_IMAGE, "--provisioner-name", PROVISIONER,
    ]  # fmt: skip
    log = layout.log("local-path-provisioner")
    process = start(layout, "local-path-provisioner", argv)
    wait_until(
        "local-path-provisioner started",
        lambda: "Provisioner started" in log.read_text(errors="replace"),
        timeout=30,
        process=process,
        log=log,
    )
    return process
