"""The operator, installed as the README's "Installing on a cluster" tells users:

    helm install pgherd charts/pgherd --namespace pgherd-system --create-namespace

plus `-f DIR/values.yaml`: the image loaded into containerd (pulled never: no registry holds it) and
short probe periods (the e2e suite restarts the operator and waits for it)."""

from __future__ import annotations

import subprocess
from typing import Any

import yaml

from e2e.localkube.binaries import tool
from e2e.localkube.kubectl import Kubectl
from e2e.localkube.processes import StartError, wait_until
from e2e.localkube.settings import OPERATOR_NAMESPACE, RELEASE, REPO, Layout

CHART = REPO / "charts" / "pgherd"


def values(image: str) -> dict[str, Any]:
    repository, tag = image.rsplit(":", 1)
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "livenessProbe": {
            "initialDelaySeconds": 5,
            "periodSeconds": 5,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "readinessProbe": {
            "initialDelaySeconds": 1,
            "periodSeconds": 2,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
    }


def helm_install_argv(layout: Layout) -> list[str]:
    return [
        tool("helm"), "install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
        "-f", str(layout.values), "--kubeconfig", str(layout.kubeconfig),
    ]  # fmt: skip


def install(layout: Layout, image: str, kubectl: Kubectl, *, timeout: float = 300) -> None:
    layout.values.write_text(yaml.safe_dump(values(image), sort_keys=False))
    argv = helm_install_argv(layout)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    (layout.logs / "helm-install.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` exited with {result.returncode}: {result.stderr.strip()}")
    deployment = operator_deployment(kubectl)
    wait_until(
        f"deployment {OPERATOR_NAMESPACE}/{deployment} Available",
        lambda: available(kubectl, deployment),
        timeout=timeout,
    )


# Container states that do not get better by waiting: say so at once, with the container's last output.
HOPELESS = {
    "ErrImageNeverPull", "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CrashLoopBackOff",
    "CreateContainerError", "CreateContainerConfigError", "RunContainerError",
}  # fmt: skip


def available(kubectl: Kubectl, deployment: str) -> bool:
    status = kubectl.json("-n", OPERATOR_NAMESPACE, "get", "deployment", deployment).get("status") or {}
    if any(c["type"] == "Available" and c["status"] == "True" for c in status.get("conditions") or []):
        return True
    pods = kubectl.json(
        "-n", OPERATOR_NAMESPACE, "get", "pods", "-l", f"app.kubernetes.io/instance={RELEASE}"
    )
    for pod in pods["items"]:
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in HOPELESS:
                name = pod["metadata"]["name"]
                logs = kubectl.run(
                    "-n", OPERATOR_NAMESPACE, "logs", name, "--tail=20", "--previous", check=False
                )
                raise OperatorFailed(
                    f"the operator pod {name} cannot run: {waiting['reason']}: {waiting.get('message', '')}"
                    + (f"\n  its last output:\n{logs}" if logs else "")
                )
    return False


class OperatorFailed(StartError):
    pass


def operator_deployment(kubectl: Kubectl) -> str:
    """The release's Deployment (its name follows the chart's fullname rules)."""
    listed = kubectl.json(
        "-n", OPERATOR_NAMESPACE, "get", "deployments", "-l", f"app.kubernetes.io/instance={RELEASE}"
    )
    names = [item["metadata"]["name"] for item in listed["items"]]
    if len(names) != 1:
        raise RuntimeError(
            f"expected one Deployment of release {RELEASE} in {OPERATOR_NAMESPACE}, found {names}"
        )
    return str(names[0])
