"""The plugin's version and the operator's: its Deployment, found by the labels the chart gives it
(any namespace), with its image, version label and readiness."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pgherd import __version__
from pgherd.plugin.document import OperatorRecord
from pgherd.plugin.errors import PluginError
from pgherd.plugin.kube import OPERATOR_SELECTOR, Kube

LABEL_VERSION = "app.kubernetes.io/version"


def record(deployment: Mapping[str, Any]) -> OperatorRecord:
    meta, spec, status = deployment["metadata"], deployment.get("spec") or {}, deployment.get("status") or {}
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or []
    operator = next(
        (c for c in containers if c.get("name") == "operator"), containers[0] if containers else {}
    )
    return OperatorRecord(
        name=f"{meta['namespace']}/{meta['name']}",
        image=operator.get("image"),
        version=(meta.get("labels") or {}).get(LABEL_VERSION),
        ready=int(status.get("readyReplicas") or 0),
        wanted=int(spec["replicas"]) if spec.get("replicas") is not None else 1,
    )


def operator_records(kube: Kube) -> list[OperatorRecord]:
    return sorted((record(d) for d in kube.operator_deployments()), key=lambda r: (-r["ready"], r["name"]))


def operator_record(kube: Kube) -> OperatorRecord | None:
    """The operator Deployment (the ready one first when there are several), or None: none installed."""
    found = operator_records(kube)
    return found[0] if found else None


def require_operator(kube: Kube) -> None:
    """Refuse a request nothing would act on: no operator Deployment, or none ready. A person who may not
    list Deployments in every namespace is not refused for that: the request goes ahead."""
    try:
        found = operator_record(kube)
    except PluginError:
        return
    if found is None:
        raise PluginError(
            f"no pgherd operator is installed (no Deployment labelled {OPERATOR_SELECTOR} in any namespace):"
            " nothing would act on this request; install the chart first (docs/install.md)"
        )
    if found["ready"] == 0:
        raise PluginError(
            f"the pgherd operator {found['name']} has no ready replica (0/{found['wanted']}): nothing would act"
            f" on this request now; see kubectl -n {found['name'].split('/')[0]} describe deployment"
        )


def lines(kube: Kube | None) -> tuple[list[str], str | None]:
    """What `version` prints, and the error line when the operator cannot be told."""
    out = [f"kubectl-pgherd {__version__}"]
    if kube is None:
        return out, None
    try:
        found = operator_records(kube)
    except PluginError as exc:  # e.g. no right to list Deployments: the plugin's own version still told
        return out, f"the operator's version is unknown: {exc}"
    if not found:
        return out, f"no pgherd operator found (no Deployment labelled {OPERATOR_SELECTOR} in any namespace)"
    for op in found:
        out.append(
            f"operator {op['version'] or 'unknown'}: {op['name']}, image {op['image']}, {op['ready']}/{op['wanted']} ready"
        )
    return out, None
