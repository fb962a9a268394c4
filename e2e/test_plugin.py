"""`kubectl pgherd` on a real Kubernetes (localkube, kind), run as a person runs it: `kubectl pgherd ...`,
kubectl finding the console script kubectl-pgherd on PATH. What needs running pods, the exec API and
the kubelet's logs: psql in a member's pod (a query's output, piped input, the exit status,
--replica), every member's logs interleaved, the status of a live cluster, a switchover and restarts
followed with --wait, a report with the members' logs and no Secret value of the namespace, the status
during a failover (its why names the lost primary) and during a restore (Restoring), a backup and a
restore to a point in time followed with --wait, and refusals in one line.

One cluster for the module, the tests in order (each leaves it Running). The same commands against an
API server without a node, and without pods: tests/plugin/test_real_api.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from e2e import manifests
from e2e.checks import insert_ids, secret_values
from e2e.driver import NewCluster, healthy
from e2e.drivers.kube import KubeDriver
from e2e.workload import present_ids

DRIVER = os.environ.get("PGHERD_E2E_DRIVER", "local")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        DRIVER not in ("localkube", "kind"),
        reason="Kubernetes only (pods, the exec API, the kubelet's logs): run with PGHERD_E2E_DRIVER=localkube",
    ),
]

NAME = "e2e-plugin"
BACKUP = "e2e-plugin-before"
SCRIPT = Path(sys.executable).parent / "kubectl-pgherd"


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, pg_version: int) -> KubeDriver:
    driver = new_cluster(manifests.cluster(NAME, postgres_version=pg_version, instances=3, mode="quorum"))
    assert isinstance(driver, KubeDriver)
    return driver


def argv(driver: KubeDriver, *args: str) -> list[str]:
    """`kubectl pgherd ...` as a person types it (kubectl finds the console script on PATH: plugin_env),
    with the driver's kubeconfig and context, in the cluster's namespace."""
    flags: list[str] = []
    kubectl = driver.kube.kubectl
    for flag in ("--kubeconfig", "--context"):
        if flag in kubectl:
            flags += [flag, kubectl[kubectl.index(flag) + 1]]
    return [kubectl[0], "pgherd", *flags, "-n", driver.namespace, *args]


def plugin_env() -> dict[str, str]:
    """PATH with the directory `pip install pgherd` put kubectl-pgherd in, first."""
    return {**os.environ, "PATH": f"{SCRIPT.parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def plugin(
    driver: KubeDriver, *args: str, stdin: str | None = None, timeout: float = 120, check: int | None = 0
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        argv(driver, *args),
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=plugin_env(),
    )
    if check is not None:
        assert result.returncode == check, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def test_status_of_a_live_cluster(cluster: KubeDriver) -> None:
    shown = plugin(cluster, "status", NAME).stdout
    assert shown.startswith(f"PostgresCluster {NAME} in namespace {cluster.namespace}: Running\n"), shown
    rows = [line.split() for line in shown.splitlines() if line.strip().startswith(f"{NAME}-")]
    assert len(rows) == 3 and all(row[2] == "yes" for row in rows), shown  # ready, with a node and a version
    assert "Operator: " in shown and "ready" in shown
    assert "expires in" in shown  # the agent Secret's certificate, read from its public part


def test_psql_runs_a_query_in_the_primarys_pod(cluster: KubeDriver) -> None:
    assert plugin(cluster, "psql", NAME, "--", "-Atc", "select 1").stdout == "1\n"
    assert plugin(cluster, "psql", NAME, "--", "-Atc", "select pg_is_in_recovery()").stdout == "f\n"
    assert (
        plugin(cluster, "psql", NAME, "--replica", "--", "-Atc", "select pg_is_in_recovery()").stdout == "t\n"
    )


def test_psql_reads_piped_input_and_exits_with_psqls_status(cluster: KubeDriver) -> None:
    piped = plugin(cluster, "psql", NAME, "--", "-At", stdin="select 40 + 2;\n")
    assert piped.stdout == "42\n"
    failed = plugin(cluster, "psql", NAME, "--", "-v", "ON_ERROR_STOP=1", "-c", "select nope", check=None)
    assert failed.returncode != 0 and 'column "nope" does not exist' in failed.stderr


def test_logs_interleave_every_member_by_time(cluster: KubeDriver) -> None:
    lines = plugin(cluster, "logs", NAME, "--since", "30m").stdout.splitlines()
    members = {line.split()[0] for line in lines if line.strip()}
    assert members == {f"{NAME}-0", f"{NAME}-1", f"{NAME}-2"}, members
    stamps = [line.split()[1] for line in lines]
    assert stamps == sorted(stamps)
    tail = plugin(cluster, "logs", NAME, "--tail", "3").stdout.splitlines()
    assert 0 < len(tail) <= 9


def test_logs_follow_prints_as_lines_come(cluster: KubeDriver) -> None:
    following = subprocess.Popen(
        argv(cluster, "logs", NAME, "-f", "--tail", "1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=plugin_env(),
    )
    try:
        assert following.stdout is not None
        first = following.stdout.readline()
        assert first.split()[0].startswith(f"{NAME}-")
    finally:
        following.terminate()
        following.wait(timeout=10)


def test_switchover_wait(cluster: KubeDriver) -> None:
    before = cluster.wait_for(healthy(3), 120, "a healthy cluster")
    target = sorted(m["name"] for m in before["members"] if m["name"] != before["primary"])[0]
    done = plugin(cluster, "switchover", NAME, "--to", target, "--wait", "--timeout", "120", timeout=180)
    assert f"switched over: {target} is the primary" in done.stdout


def test_rolling_restart_wait_restarts_every_member_replicas_first(cluster: KubeDriver) -> None:
    cluster.wait_for(healthy(3), 120, "a healthy cluster")
    done = plugin(cluster, "restart", NAME, "--wait", "--timeout", "900", timeout=960)
    assert "3/3 members restarted" in done.stdout and "restarted (pgherd.io/restart=" in done.stdout
    cluster.wait_for(healthy(3), 120, "a healthy cluster after the rolling restart")


def test_one_member_restart_wait(cluster: KubeDriver) -> None:
    status = cluster.wait_for(healthy(3), 120, "a healthy cluster")
    replica = sorted(m["name"] for m in status["members"] if m["name"] != status["primary"])[0]
    done = plugin(cluster, "restart", NAME, replica, "--wait", "--timeout", "300", timeout=360)
    assert f"{replica} restarted and ready" in done.stdout


def namespace_secret_values(cluster: KubeDriver) -> set[bytes]:
    """Every secret value of the cluster's namespace (the passwords, the agent's token and keys, the S3
    keys), at least 8 bytes long."""
    items = cluster.kube.json("-n", cluster.namespace, "get", "secrets")["items"]
    return {v for v in secret_values(items) if len(v) >= 8}


def test_report_bundles_the_members_logs_and_no_secret(cluster: KubeDriver, tmp_path: Path) -> None:
    bundle = tmp_path / "report.tar.gz"
    plugin(cluster, "report", NAME, "-o", str(bundle), timeout=300)
    with tarfile.open(bundle) as archive:
        files = {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}  # type: ignore[union-attr]
    names = {name.split("/", 1)[1] for name in files}
    assert {f"logs/members/{NAME}-{i}.postgres.log" for i in range(3)} <= names
    assert any(name.startswith("logs/operator/") for name in names)
    values = namespace_secret_values(cluster)
    assert len(values) > 10, "the namespace's Secrets were not read"
    leaked = [(path, v[:6]) for path, content in files.items() for v in values if v in content]
    assert not leaked, f"Secret values in the bundle: {leaked}"


def test_status_says_why_during_a_failover(cluster: KubeDriver) -> None:
    status = cluster.wait_for(healthy(3), 120, "a healthy cluster")
    old = str(status["primary"])
    seen: list[tuple[str, str]] = []
    cluster.kill(old, keep_down=True)  # kept down: a failover, not the same member restarted in place
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            summary = json.loads(plugin(cluster, "status", NAME, "-o", "json").stdout)
            seen.append((summary["phase"], summary["why"]["reason"] or ""))
            if summary["primary"] not in (None, old):
                break
            time.sleep(0.5)
    finally:
        cluster.bring_back(old)
    cluster.wait_for(healthy(3), 240, f"{old} back as a replica")
    during = [(phase, reason) for phase, reason in seen if phase != "Running"]
    assert any(old in reason for _, reason in during), seen
    summary = json.loads(plugin(cluster, "status", NAME, "-o", "json").stdout)
    assert summary["phase"] == "Running" and summary["primary"] != old, summary


def test_backup_then_restore_to_a_point_in_time_with_wait(cluster: KubeDriver) -> None:
    cluster.wait_for(healthy(3), 120, "a healthy cluster")
    insert_ids(cluster.rw_dsn(), range(1, 51))
    done = plugin(cluster, "backup", NAME, "--backup-name", BACKUP, "--wait", "--timeout", "300", timeout=360)
    assert "Completed" in done.stdout, done.stdout
    insert_ids(cluster.rw_dsn(), range(51, 101))
    time.sleep(1.5)
    point = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    time.sleep(1.5)
    insert_ids(cluster.rw_dsn(), range(101, 151))  # after the point: not restored
    cluster.superuser_value("SELECT pg_switch_wal()")  # the point's WAL archived

    restoring: list[tuple[str, str]] = []

    def watch() -> None:
        while not finished.is_set():
            result = plugin(cluster, "status", NAME, "-o", "json", check=None)
            if result.returncode == 0:
                summary = json.loads(result.stdout)
                restoring.append((summary["phase"], summary["why"]["reason"] or ""))
            time.sleep(1.0)

    finished = threading.Event()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        done = plugin(
            cluster, "restore", NAME, "--backup", BACKUP, "--time", point, "--yes", "--wait", "--timeout", "600",
            timeout=660,
        )  # fmt: skip
    finally:
        finished.set()
        watcher.join(timeout=30)
    assert "Completed" in done.stdout, done.stdout
    assert any(phase == "Restoring" for phase, _ in restoring), restoring
    cluster.wait_for(healthy(3), 300, "a healthy cluster after the restore")
    assert present_ids(cluster.rw_dsn()) == set(range(1, 101))


def test_refusals_are_one_clear_line(cluster: KubeDriver) -> None:
    missing = plugin(cluster, "status", "no-such-cluster", check=None)
    assert (
        missing.returncode != 0 and "no-such-cluster" in missing.stderr and "Traceback" not in missing.stderr
    )
    wrong = plugin(cluster, "switchover", NAME, "--to", f"{NAME}-9", check=None)
    assert wrong.returncode != 0 and f"{NAME}-9" in wrong.stderr and "Traceback" not in wrong.stderr
    nothing = plugin(cluster, "upgrade", "confirm", NAME, check=None)
    assert nothing.returncode != 0 and "Traceback" not in nothing.stderr and nothing.stderr.count("\n") == 1
