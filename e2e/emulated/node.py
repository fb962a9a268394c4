"""The node process of an emulated cluster (`python -m e2e.emulated serve`, started by `up`): the emulated
API server (tests/kube/emulator.py) with pgherd's CRDs, the chart's RBAC objects and its namespace; the
emulated node and controllers (tests/kube/cluster_sim.py); an S3 server on 127.0.0.1 for backups with
its credentials Secret. It runs until SIGTERM, then stops the pods (SIGTERM, SIGKILL after the grace),
the S3 server and the API server."""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import signal
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from e2e.emulated import chart
from e2e.emulated.state import OPERATOR, write_state

REPO = chart.REPO
VENV_BIN = REPO / ".venv" / "bin"
S3_BUCKET = "pgherd-e2e"
S3_SECRET = "pgherd-e2e-s3"  # in every namespace the driver creates, and in `default`
ADMIN_USER = "admin"
NODE_USER = "system:node:emulated"


def chart_values() -> list[str]:
    """The project's chart values: the defaults (the operator watches every namespace)."""
    return []


def pod_ips() -> str:
    """The first pod IP: 127.A.B.2 at random, away from another emulated cluster or a test's pods."""
    octets = uuid.uuid4().bytes
    return f"127.{octets[0] % 250 + 1}.{octets[1]}.2"


def s3_secret(namespace: str, access_key: str, secret_key: str) -> dict[str, Any]:
    encode = lambda text: base64.b64encode(text.encode()).decode()  # noqa: E731
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": S3_SECRET, "namespace": namespace},
        "data": {"AWS_ACCESS_KEY_ID": encode(access_key), "AWS_SECRET_ACCESS_KEY": encode(secret_key)},
    }


def serve(directory: Path, *, max_probe_period: float, stop_grace: float, restart_delay: float) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from kube.cluster_sim import ClusterSim
    from kube.emulator import CRDS_DIR, EmulatedApiServer, pgherd_validator, write_kubeconfig
    from pgherd.local.s3server import S3Server

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    install = chart.operator_install(*chart_values())
    tokens = {secrets.token_hex(16): ADMIN_USER, secrets.token_hex(16): install.user}
    admin_token, operator_token = list(tokens)
    node_token = secrets.token_hex(16)
    tokens[node_token] = NODE_USER
    server = EmulatedApiServer(
        crds=[CRDS_DIR],
        validators=[pgherd_validator],
        tokens=tokens,
        rbac={install.user: install.rules},  # the operator gets what the chart grants, nothing more
        namespaces=["default", "kube-system", "kube-public", "kube-node-lease", install.namespace],
        graceful_pod_deletion=True,
        history_limit=2,
        record_requests=False,
    )
    url = server.start()
    for doc in install.stored():
        doc.setdefault("metadata", {}).setdefault("namespace", install.namespace)
        if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            doc["metadata"].pop("namespace", None)
        server.create(doc)
    write_kubeconfig(directory / "kubeconfig", url, token=admin_token)
    write_kubeconfig(
        directory / "operator.kubeconfig", url, token=operator_token, namespace=install.namespace
    )

    s3 = S3Server(directory / "s3", log_file=directory / "s3server.log").start()
    s3.create_bucket(S3_BUCKET)
    server.create(s3_secret("default", s3.access_key, s3.secret_key))

    sim = ClusterSim(
        url,
        directory / "root",
        token=node_token,
        first_ip=pod_ips(),
        max_probe_period=max_probe_period,
        stop_grace=stop_grace,
        restart_backoff=(restart_delay, restart_delay),
    ).start()

    (directory / OPERATOR).write_text(
        json.dumps(
            {
                "argv": chart.operator_argv(install, venv_bin=VENV_BIN, liveness="127.0.0.1:{livenessPort}"),
                "env": chart.operator_env(install, pod_name="{podName}"),
                "podNamePrefix": f"{chart.RELEASE}-emulated-",
                "venvBin": str(VENV_BIN),
            },
            indent=2,
        )
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    write_state(
        directory,
        api=url,
        nodePid=os.getpid(),
        operatorNamespace=install.namespace,
        operatorUser=install.user,
        s3={
            "endpoint": s3.endpoint_url,
            "bucket": S3_BUCKET,
            "secret": S3_SECRET,
            "secretNamespace": "default",
        },
        ready=True,
    )
    logging.getLogger("e2e.emulated").info("ready: API %s, S3 %s", url, s3.endpoint_url)
    try:
        stop.wait()
    finally:
        sim.stop()
        s3.stop()
        server.stop()
        for error in sim.errors:
            logging.getLogger("e2e.emulated").error("cluster simulator: %s", error)
