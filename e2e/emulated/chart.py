"""The operator as the chart installs it: `helm template` of charts/pgherd with the project's values,
and what the emulated cluster takes from it (the objects to store, the RBAC rules of the operator's
ServiceAccount, the operator container's command line and environment)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pgherd"
RELEASE = "pgherd"
NAMESPACE = "pgherd-system"
# Rendered kinds stored in the emulated API (the Deployment is not: its pod is a local process).
STORED_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def find_helm() -> str:
    """helm from PATH, else the copy `make setup` (scripts/ensure-helm.sh) unpacks into .tools/bin."""
    local = REPO / ".tools" / "bin" / "helm"
    found = shutil.which("helm") or (str(local) if os.access(local, os.X_OK) else None)
    if found is None:
        raise RuntimeError(
            "helm not found on PATH nor in .tools/bin: run `make setup` (scripts/ensure-helm.sh)"
        )
    return found


def render(*values: str, release: str = RELEASE, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """The chart's objects as `helm template` renders them with `values` (`--set`/`-f` arguments)."""
    result = subprocess.run(
        [find_helm(), "template", release, str(CHART), "--namespace", namespace, *values],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"helm template failed: {result.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@dataclass
class OperatorInstall:
    """What the chart's rendering says about the operator."""

    objects: list[dict[str, Any]]
    namespace: str = NAMESPACE
    service_account: str = ""
    rules: list[dict[str, Any]] = field(default_factory=list)
    command: list[str] = field(default_factory=list)
    env: list[dict[str, Any]] = field(default_factory=list)

    @property
    def user(self) -> str:
        """The user name a ServiceAccount's token authenticates as."""
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"

    def stored(self) -> list[dict[str, Any]]:
        return [doc for doc in self.objects if doc.get("kind") in STORED_KINDS]


def operator_install(*values: str, namespace: str = NAMESPACE) -> OperatorInstall:
    objects = render(*values, namespace=namespace)
    deployment = next(doc for doc in objects if doc["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "operator")
    rules: list[dict[str, Any]] = []
    for doc in objects:
        if doc["kind"] in ("ClusterRole", "Role"):
            rules += doc.get("rules") or []
    return OperatorInstall(
        objects=objects,
        namespace=namespace,
        service_account=str(pod.get("serviceAccountName") or "default"),
        rules=rules,
        command=[*container.get("command", []), *container.get("args", [])],
        env=list(container.get("env") or []),
    )


def operator_argv(install: OperatorInstall, *, venv_bin: Path, liveness: str) -> list[str]:
    """The container's command line for a local process: the virtualenv's `pgherd`, the liveness
    endpoint at `liveness` (HOST:PORT: every process shares this machine's ports) and `--member-address ip` (there
    is no DNS: members reach each other at their pod IPs)."""
    argv = list(install.command)
    if argv and not os.path.isabs(argv[0]):
        argv[0] = str(venv_bin / argv[0])
    for i, arg in enumerate(argv[:-1]):
        if arg == "--liveness":
            parts = urlsplit(argv[i + 1])
            argv[i + 1] = urlunsplit(parts._replace(netloc=liveness))
    return [*argv, "--member-address", "ip"]


def operator_env(install: OperatorInstall, *, pod_name: str) -> dict[str, str]:
    """The container's environment: values as written, fieldRefs as the kubelet resolves them."""
    fields = {"metadata.namespace": install.namespace, "metadata.name": pod_name}
    env: dict[str, str] = {}
    for var in install.env:
        if "value" in var:
            env[var["name"]] = str(var["value"])
        elif "fieldRef" in (var.get("valueFrom") or {}):
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            if path not in fields:
                raise RuntimeError(f"the chart's env {var['name']} refers to {path}, not emulated")
            env[var["name"]] = fields[path]
        else:
            raise RuntimeError(f"the chart's env {var['name']}: only values and fieldRefs are emulated")
    return env
