"""`pgherd operator --log-format json`, the real command in a process of its own (kopf.run, as the chart's
Deployment runs it) against the real API server, as the chart's ServiceAccount: every line it writes,
kopf's own included, is one JSON object; the lines of a cluster's reconcile name its namespace and
cluster; and the members' StatefulSet tells their agents to log JSON too."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from pgherd.kube import names

from .realkube import ChartIdentity, Kube
from .test_operator import cluster_manifest
from .waiting import eventually

PGHERD = str(Path(sys.executable).parent / "pgherd")
KEYS = {"time", "level", "logger", "namespace", "cluster", "member", "message"}


def kubeconfig(identity: ChartIdentity, path: Path) -> Path:
    """The chart ServiceAccount's token, the API server and its CA: what kopf's kubeconfig login reads."""
    ca = base64.b64encode(identity.ca_file.read_bytes()).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": identity.server, "certificate-authority-data": ca}}],
        "users": [{"name": "operator", "user": {"token": identity.token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "c", "user": "operator"}}],
        "current-context": "operator",
    }
    path.write_text(yaml.safe_dump(config))
    return path


class Output:
    """A process's stderr, line by line, as it comes."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        assert process.stderr is not None
        self._stream = process.stderr
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._stream:
            self.lines.append(line.rstrip("\n"))

    def join(self) -> None:
        self._reader.join(10)


@contextmanager
def operator_process(identity: ChartIdentity, tmp_path: Path, *flags: str) -> Iterator[Output]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "POD_", "PGHERD_"))}
    env["KUBECONFIG"] = str(kubeconfig(identity, tmp_path / "kubeconfig"))
    process = subprocess.Popen(
        [PGHERD, "operator", "--namespace", identity.watched, "--metrics-port", "0", *flags],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    output = Output(process)
    try:
        yield output
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        output.join()


def parsed(lines: list[str]) -> list[dict[str, Any]]:
    docs = []
    for line in lines:
        try:
            doc = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\n" + "\n".join(lines[-30:])) from None
        assert isinstance(doc, dict) and set(doc) >= KEYS, line
        docs.append(doc)
    return docs


def test_the_operator_logs_json_lines_naming_the_cluster(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, tmp_path: Path
) -> None:
    ns = namespace
    kube.create(cluster_manifest(ns))
    with operator_process(chart_operator, tmp_path, "--log-format", "json") as output:

        def reconciled() -> list[dict[str, Any]] | None:
            docs = parsed(list(output.lines))
            ours = [d for d in docs if d["logger"].startswith("pgherd.kube") and d["cluster"] == "hippo"]
            return docs if any("phase" in d["message"] for d in ours) else None

        eventually(reconciled, 60, "a JSON line of the loop naming the cluster")
        sts = eventually(
            lambda: kube.read("statefulsets", ns, names.statefulset("hippo")), what="the StatefulSet"
        )
        kube.remove("postgresclusters", ns, "hippo")
        eventually(lambda: kube.read("postgresclusters", ns, "hippo") is None, 30, "the cluster's deletion")
    docs = parsed(output.lines)
    loop = [d for d in docs if d["logger"] == "pgherd.kube.loop"]
    assert loop and all((d["namespace"], d["cluster"], d["member"]) == (ns, "hippo", None) for d in loop)
    # kopf's own records about the cluster (its finalizer's handler) name it too.
    kopfs = [d for d in docs if d["logger"].startswith("kopf") and d["cluster"] == "hippo"]
    assert kopfs and all(d["namespace"] == ns for d in kopfs), [d["message"] for d in docs]
    # A line not about a cluster names none.
    assert any(d["cluster"] is None for d in docs)
    assert all(d["level"] in ("debug", "info", "warning", "error", "critical") for d in docs)
    assert chart_operator.token not in "\n".join(output.lines)
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["PGHERD_LOG_FORMAT"], env["PGHERD_NAMESPACE"]) == ("json", ns)


def test_text_stays_the_default(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, tmp_path: Path
) -> None:
    ns = namespace
    kube.create(cluster_manifest(ns))
    with operator_process(chart_operator, tmp_path) as output:
        eventually(
            lambda: any("pgherd.kube.loop: " in line and "phase" in line for line in output.lines),
            60,
            "a text line of the loop",
        )
        sts = eventually(
            lambda: kube.read("statefulsets", ns, names.statefulset("hippo")), what="the StatefulSet"
        )
    assert not any(line.startswith("{") for line in output.lines)
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert "PGHERD_LOG_FORMAT" not in {e["name"] for e in container["env"]}
