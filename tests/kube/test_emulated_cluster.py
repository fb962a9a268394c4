"""`python -m e2e.emulated up|down` as a person uses it (docs/e2e.md): kubectl applies an example
manifest, the real operator (started from the chart, with its ServiceAccount's rendered RBAC enforced)
makes it Running, PostgreSQL answers at the primary pod's IP with the `<name>-app` Secret, the operator
can be killed and started again, and `down` leaves no process and no directory behind."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import yaml

from .emulator import REPO
from .waiting import eventually


def read_state(directory: Path) -> dict[str, Any]:
    return dict(json.loads((directory / "emulated.json").read_text()))


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def processes_naming(directory: Path) -> list[int]:
    needle = str(directory).encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def run(*argv: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=True)


def test_up_apply_connect_and_down(work_root: Path, kubectl_binary: Path) -> None:
    directory = work_root / "emulated-cli"
    run(sys.executable, "-m", "e2e.emulated", "up", "--dir", str(directory))
    try:

        def kubectl(*args: str, stdin: str | None = None) -> str:
            return subprocess.run(
                [str(kubectl_binary), "--kubeconfig", str(directory / "kubeconfig"), *args],
                capture_output=True, text=True, timeout=60, check=True, input=stdin,
            ).stdout  # fmt: skip

        manifest = yaml.safe_load((REPO / "examples" / "cluster-minimal.yaml").read_text())
        manifest["spec"]["instances"] = 1
        kubectl("apply", "-f", "-", stdin=json.dumps(manifest))

        def running() -> dict[str, Any] | None:
            cluster = json.loads(kubectl("get", "pgc", "hippo", "-o", "json"))
            return cluster if (cluster.get("status") or {}).get("phase") == "Running" else None

        cluster = eventually(running, 120, "the cluster Running", interval=0.3)
        primary = cluster["status"]["currentPrimary"]
        ip = kubectl("get", "pod", primary, "-o", "jsonpath={.status.podIP}")
        secret = json.loads(kubectl("get", "secret", "hippo-app", "-o", "json"))["data"]
        creds = {k: base64.b64decode(v).decode() for k, v in secret.items()}
        with psycopg.connect(
            host=ip,
            user=creds["username"],
            password=creds["password"],
            dbname=creds["dbname"],
            connect_timeout=5,
        ) as conn:
            assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (False,)

        # The operator killed and started again: a new process, a new pod name (leader identity).
        before = read_state(directory)
        run(sys.executable, "-m", "e2e.emulated", "operator", "kill", "--dir", str(directory))
        assert not alive(before["operatorPid"])
        run(sys.executable, "-m", "e2e.emulated", "operator", "start", "--dir", str(directory))
        after = read_state(directory)
        assert alive(after["operatorPid"]) and after["operatorPod"] != before["operatorPod"]
        log = (directory / "operator.log").read_text()
        assert " 403" not in log and "Forbidden" not in log, "the chart's RBAC refused a request"
    finally:
        run(sys.executable, "-m", "e2e.emulated", "down", "--dir", str(directory))
    assert not directory.exists()
    assert processes_naming(directory) == []
