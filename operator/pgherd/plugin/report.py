"""`report`: a support bundle of one cluster, a .tar.gz or a .zip (by the file's name): its objects,
Backups, Restores, pods, PVCs, Jobs, StatefulSet, Events, the operator's and each member's recent logs,
and the `status` output.

No Secret value goes in: the bundle reads no Secret but the agent Secret, for the status inside it, and
of that only the certificates (their public part), as `status` does. Objects that name Secrets (a pod's
`secretKeyRef`, the store's `secretName`) name them only.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pgherd.kube import names
from pgherd.plugin.document import now_text
from pgherd.plugin.errors import PluginError
from pgherd.plugin.gather import gather, member_selector
from pgherd.plugin.kube import Kube
from pgherd.plugin.render import render
from pgherd.plugin.summary import summarize

JSON = dict[str, Any]
LOG_LINES = 2000  # of each container: recent enough for an incident, small enough to mail


@dataclass
class Bundle:
    files: dict[str, bytes] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def add(self, path: str, content: str | bytes) -> None:
        self.files[path] = content.encode() if isinstance(content, str) else content

    def collect(self, what: str, read: Callable[[], Any], path: str) -> Any:
        try:
            value = read()
        except PluginError as exc:
            self.errors.append(f"{what}: {exc}")
            return None
        self.add(path, _yaml(value))
        return value


def _lean(obj: Any) -> Any:
    """An object without its managedFields (the write history: noise in a report)."""
    if isinstance(obj, dict):
        meta = obj.get("metadata")
        if isinstance(meta, dict) and "managedFields" in meta:
            obj = {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
        return {k: _lean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_lean(item) for item in obj]
    return obj


def _yaml(value: Any) -> str:
    return yaml.safe_dump(_lean(value), sort_keys=False, default_flow_style=False, allow_unicode=True)


def collect(kube: Kube, name: str) -> Bundle:
    bundle = Bundle()
    document = gather(kube, name)  # the cluster must be readable: else the error ends the command
    summary = summarize(document)
    bundle.add("status.txt", render(summary, verbose=True))
    bundle.add("status.json", json.dumps(summary, indent=2, sort_keys=True) + "\n")
    bundle.add("cluster.yaml", _yaml(document["cluster"]))
    bundle.add("backups.yaml", _yaml(document["backups"]))
    bundle.add("restores.yaml", _yaml(document["restores"]))
    bundle.errors += document["notes"]
    selector = f"{names.LABEL_CLUSTER}={name}"
    pods = bundle.collect("pods", lambda: kube.pods(selector), "pods.yaml") or []
    pvcs = bundle.collect("PVCs", lambda: kube.pvcs(selector), "pvcs.yaml") or []
    jobs = bundle.collect("Jobs", lambda: kube.jobs(selector), "jobs.yaml") or []
    bundle.collect("StatefulSet", lambda: kube.statefulset(names.statefulset(name)), "statefulset.yaml")
    objects = pods + pvcs + jobs + document["backups"] + document["restores"]
    related = {name} | {str(o["metadata"]["name"]) for o in objects}
    bundle.collect(
        "Events",
        lambda: [e for e in kube.events() if (e.get("involvedObject") or {}).get("name") in related],
        "events.yaml",
    )
    members = {p["metadata"]["name"] for p in _members(kube, name, bundle)}
    for pod in pods:
        pod_name = pod["metadata"]["name"]
        containers = [c["name"] for c in (pod.get("spec") or {}).get("containers") or []]
        for container in containers:
            folder = "logs/members" if pod_name in members else "logs/jobs"
            _logs(kube, bundle, pod, container, f"{folder}/{pod_name}.{container}")
    _operator_logs(kube, bundle)
    return bundle


def _members(kube: Kube, name: str, bundle: Bundle) -> list[JSON]:
    try:
        return kube.pods(member_selector(name))
    except PluginError as exc:
        bundle.errors.append(f"members' pods: {exc}")
        return []


def _restarts(pod: JSON, container: str) -> int:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == container:
            return int(status.get("restartCount") or 0)
    return 0


def _logs(
    kube: Kube, bundle: Bundle, pod: JSON, container: str, path: str, namespace: str | None = None
) -> None:
    name = pod["metadata"]["name"]
    try:
        bundle.add(
            f"{path}.log",
            "\n".join(kube.log_lines(name, container, namespace=namespace, tail_lines=LOG_LINES)) + "\n",
        )
    except PluginError as exc:
        bundle.errors.append(f"log of {name}/{container}: {exc}")


def _operator_logs(kube: Kube, bundle: Bundle) -> None:
    try:
        deployments = kube.operator_deployments()
    except PluginError as exc:
        bundle.errors.append(f"the operator: {exc}")
        return
    if not deployments:
        bundle.errors.append("the operator: no Deployment found (by the chart's labels) in any namespace")
    for deployment in deployments:
        meta = deployment["metadata"]
        labels = ((deployment.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        try:
            pods = kube.pods_in(meta["namespace"], selector)
        except PluginError as exc:
            bundle.errors.append(f"the operator's pods: {exc}")
            continue
        bundle.add(f"operator/{meta['name']}.yaml", _yaml(deployment))
        for pod in pods:
            _logs(
                kube, bundle, pod, "operator", f"logs/operator/{pod['metadata']['name']}", meta["namespace"]
            )


def readme(kube: Kube, name: str, bundle: Bundle) -> str:
    lines = [
        f"pgherd support bundle of PostgresCluster {name}, namespace {kube.namespace}",
        f"made {now_text()} by kubectl pgherd report, context {kube.context or '-'}, API server {kube.server}",
        "",
        "No Secret value is in it: no Secret is read but the agent Secret, and of it only the certificates",
        "(their expiry, in status.txt). Logs: the last lines of each container, times from the API server.",
        "",
        "Files:",
        *(f"  {path}" for path in sorted(bundle.files)),
    ]
    if bundle.errors:
        lines += ["", "Not collected:", *(f"  {error}" for error in bundle.errors)]
    return "\n".join(lines) + "\n"


def write(kube: Kube, name: str, target: Path) -> Bundle:
    """The bundle of ``name``, written to ``target`` (.tar.gz, .tgz or .zip)."""
    suffix = "".join(target.suffixes[-2:]) if target.name.endswith(".tar.gz") else target.suffix
    if suffix not in (".tar.gz", ".tgz", ".zip"):
        raise PluginError(f"{target}: name the bundle .tar.gz, .tgz or .zip")
    bundle = collect(kube, name)
    bundle.add("README.txt", readme(kube, name, bundle))
    root = f"pgherd-report-{name}"
    if suffix == ".zip":
        with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for path, content in sorted(bundle.files.items()):
                archive.writestr(f"{root}/{path}", content)
    else:
        with tarfile.open(target, "w:gz") as archive:
            for path, content in sorted(bundle.files.items()):
                info = tarfile.TarInfo(f"{root}/{path}")
                info.size, info.mtime, info.mode = len(content), int(time.time()), 0o644
                archive.addfile(info, io.BytesIO(content))
    return bundle
