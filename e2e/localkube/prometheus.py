"""`up --prometheus`: a real Prometheus (built by scripts/ensure-prometheus.sh) on the host, scraping the
cluster's pods as the chart's PodMonitors select them and evaluating charts/pgherd/monitoring/alerts.yaml.

The scrape configuration is what the Prometheus Operator generates for the two PodMonitors of
charts/pgherd/templates/podmonitor.yaml: Kubernetes pod discovery through the API server, kept by the
monitors' label selectors and the container port named `metrics`, with the target labels namespace,
pod, container, endpoint and job `<release namespace>/<monitor name>`; the operator's monitor honours
the labels its series carry. Prometheus listens on 127.0.0.1 (a free port), and DIR/prometheus.json
says where: {"url", "rules", "scrapeInterval"}. The rules file is a copy that a scenario may replace
and load with POST /-/reload (e2e/monitoring.py compresses the alerts' durations that way)."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from e2e.localkube.processes import Process, start, wait_until
from e2e.localkube.prometheus_binaries import prometheus_bin
from e2e.localkube.settings import OPERATOR_NAMESPACE, REPO, Layout
from pgherd.local.ports import free_port

ALERTS = REPO / "charts" / "pgherd" / "monitoring" / "alerts.yaml"
SCRAPE_INTERVAL = "5s"
MEMBERS_JOB = f"{OPERATOR_NAMESPACE}/pgherd-members"
OPERATOR_JOB = f"{OPERATOR_NAMESPACE}/pgherd-operator"


def _keep_label(label: str, regex: str) -> dict[str, Any]:
    name = "".join(c if c.isalnum() else "_" for c in label)
    return {
        "action": "keep",
        "source_labels": [
            f"__meta_kubernetes_pod_label_{name}",
            f"__meta_kubernetes_pod_labelpresent_{name}",
        ],
        "regex": f"({regex});true",
    }


def _target_labels(job: str) -> list[dict[str, Any]]:
    """The labels the Prometheus Operator gives a PodMonitor's targets, after its selectors."""
    return [
        {
            "action": "keep",
            "source_labels": ["__meta_kubernetes_pod_container_port_name"],
            "regex": "metrics",
        },
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "endpoint", "replacement": "metrics"},
        {"target_label": "job", "replacement": job},
    ]


def scrape_config(kubeconfig: Path) -> dict[str, Any]:
    discovery = [{"role": "pod", "kubeconfig_file": str(kubeconfig)}]
    members = {
        "job_name": f"podMonitor/{MEMBERS_JOB}/0",
        "honor_labels": False,
        "kubernetes_sd_configs": discovery,
        "relabel_configs": [
            _keep_label("app.kubernetes.io/component", "postgres"),
            {
                "action": "keep",
                "source_labels": ["__meta_kubernetes_pod_labelpresent_pgherd_io_cluster"],
                "regex": "true",
            },
            *_target_labels(MEMBERS_JOB),
        ],
    }
    operator = {
        "job_name": f"podMonitor/{OPERATOR_JOB}/0",
        "honor_labels": True,
        "kubernetes_sd_configs": [{**discovery[0], "namespaces": {"names": [OPERATOR_NAMESPACE]}}],
        "relabel_configs": [
            _keep_label("app.kubernetes.io/name", "pgherd"),
            _keep_label("app.kubernetes.io/instance", "pgherd"),
            _keep_label("app.kubernetes.io/component", "operator"),
            *_target_labels(OPERATOR_JOB),
        ],
    }
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": ["rules/*.yaml"],
        "scrape_configs": [members, operator],
    }


def folder(layout: Layout) -> Path:
    return layout.root / "prometheus"


def info_file(layout: Layout) -> Path:
    return layout.root / "prometheus.json"


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start_prometheus(layout: Layout) -> Process:
    bin_dir = prometheus_bin()
    if bin_dir is None:
        raise RuntimeError("Prometheus is not built: run scripts/ensure-prometheus.sh (or make setup-kube)")
    home = folder(layout)
    rules = home / "rules"
    rules.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ALERTS, rules / "alerts.yaml")
    config = home / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(layout.kubeconfig), sort_keys=False))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        str(bin_dir / "prometheus"), f"--config.file={config}", f"--storage.tsdb.path={home / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle",
        "--storage.tsdb.retention.time=1d", "--log.level=warn",
    ]  # fmt: skip
    process = start(layout, "prometheus", argv)
    wait_until(f"Prometheus at {url}", lambda: _ready(url), timeout=60, process=process,
               log=layout.log("prometheus"))  # fmt: skip
    info_file(layout).write_text(
        json.dumps({"url": url, "rules": str(rules / "alerts.yaml"), "scrapeInterval": SCRAPE_INTERVAL})
        + "\n"
    )
    return process
